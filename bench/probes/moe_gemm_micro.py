"""Micro-benchmarks behind the MoE's rank pieces, on one CUDA device.

1. Grouped-GEMM time per row of the expert projections (``torch._grouped_mm``, the shapes of a
   preset, bf16, with the fused swiglu between) by groups (local experts) and rows per group:
   does a piece of fewer rows per expert cost more per row? (An earlier version also timed
   them beside a copy from a second device, issued as a cross-device ``copy_``; PyTorch orders
   such a copy against both devices' current streams, so the two ran back to back and that
   column said nothing about contention: removed. The layer's own pulls are same-device copies
   from symmetric memory; profile the layer to see them beside its GEMMs.)
2. Host time per launch of the ops a rank piece issues (grouped GEMM, the fused swiglu, a gather,
   a device-to-device copy, an event, a stream wait): where the eager MoE's host time goes.
3. ``--counts``: each projection's grouped GEMM alone (the preset's local experts at EP 4) by
   rows per call, with every group's rows even, drawn uniformly at random (as a routing spreads
   them: most groups end in a part tile), or those drawn rounded down to 128 (whole tiles only),
   and the random ones beside copy-engine traffic (64 MiB device-to-device copies on a side
   stream): what the device path's parts lose against one whole GEMM (about 35% per row at
   qwen3-30b-a3b, EP 4, on H200).
4. ``--layout``: one rank's experts (gate/up, the fused swiglu, down) over every source's rows at
   EP ``--ep``, each source's counts per expert drawn as a routing draws them, in ``ep`` launches
   three ways: by source (the device path's parts: about rows / (ep * experts) rows per group),
   by source with the parts on two streams (a part's GEMMs free to start in the previous part's
   last wave), and by chunk of experts over fixed regions (each (source, expert) a region of an
   even routing's share and 1/8 more, rows past a count unwritten and computed anyway, the counts
   past a region in one more launch); and as one whole launch with the rows packed by expert (the
   bound). On 1x H200 (2026-11-27; qwen3, ms, EP 4 / EP 2): 1.322 / 1.216 by source, 1.209 / 1.216
   on two streams, 1.228 / 1.364 over regions, 1.024 / 1.154 packed ([Note: MoE training graphs]
   in ``layers/moe/device.py`` says what the layer made of them).

    python bench/probes/moe_gemm_micro.py [--preset qwen3-30b-a3b] [--counts | --layout [--ep 4]] \
        [--out OUT.json]

Prints its tables and writes them as JSON.
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/probes/../..
sys.path.insert(0, ROOT)


def device_ms(fn, reps: int = 20) -> float:
    """Median device time of ``fn`` (ms), each timed by events on the current stream."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def host_us(fn, reps: int = 300) -> float:
    """Host time per launch of ``fn`` (us, mean over ``reps`` back to back; small operands, so the
    device keeps up and the launch queue never fills)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / reps * 1e6


def by_counts(groups: int, H: int, F: int, dev) -> list:
    """Table 3 (module docstring): per rows and counts' kind, each projection's time (us) and
    its time per 16384 counted rows."""
    bf, side = torch.bfloat16, torch.cuda.Stream(dev)
    g = torch.Generator().manual_seed(0)
    w_in_t = torch.randn((groups, H, 2 * F), dtype=bf, device=dev) * 0.02
    w_out_t = torch.randn((groups, F, H), dtype=bf, device=dev) * 0.02
    src = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def beside_copies(fn):
        def run():
            with torch.cuda.stream(side):
                for _ in range(4):
                    dst.copy_(src)
            fn()
        return run
    out = []
    for rows in (65536, 32768, 16384, 8192):
        x = torch.randn((rows, H), dtype=bf, device=dev)
        a = torch.randn((rows, F), dtype=bf, device=dev)
        drawn = torch.bincount(torch.randint(0, groups, (rows,), generator=g), minlength=groups)
        for kind, counts, copies in (("even", torch.full((groups,), rows // groups), False), ("random", drawn, False),
                                     ("random, rounded to 128", drawn // 128 * 128, False),
                                     ("random, beside copies", drawn, True)):
            offs = torch.cumsum(counts, 0).to(device=dev, dtype=torch.int32)
            n = int(counts.sum())
            wrap = beside_copies if copies else (lambda fn: fn)
            gate_up = device_ms(wrap(lambda: torch._grouped_mm(x, w_in_t, offs=offs))) * 1e3
            down = device_ms(wrap(lambda: torch._grouped_mm(a, w_out_t, offs=offs))) * 1e3
            out.append({"rows": rows, "kind": kind, "counted": n, "gate_up_us": gate_up, "down_us": down,
                        "gate_up_us_per_16k": gate_up * 16384 / n, "down_us_per_16k": down * 16384 / n})
        torch.cuda.synchronize()
    return out


def by_layout(experts: int, ep: int, tokens: int, top_k: int, H: int, F: int, dev) -> dict:
    """Table 4 (module docstring): ms per layout for one rank's ``experts / ep`` local experts."""
    from overlap_layers.layers.common.activations import act
    El, bf = experts // ep, torch.bfloat16
    per_source = tokens * top_k // ep  # rows each source sends this rank under an even routing
    g = torch.Generator().manual_seed(0)
    counts = torch.stack([torch.bincount(torch.randint(0, El, (per_source,), generator=g), minlength=El)
                          for _ in range(ep)])  # [source, expert]
    cap = -(-(-(-per_source * 9 // (8 * El))) // 8) * 8  # an even share and 1/8 more, up to a multiple of 8 rows
    w_in_t = torch.randn((El, H, 2 * F), dtype=bf, device=dev) * 0.02
    w_out_t = torch.randn((El, F, H), dtype=bf, device=dev) * 0.02
    chunk = El // ep

    def experts_of(x, w_a, w_b, offs):
        return torch._grouped_mm(act("swiglu", torch._grouped_mm(x, w_a, offs=offs)), w_b, offs=offs)

    def ends(c):
        return torch.cumsum(c, 0).to(device=dev, dtype=torch.int32)
    by_source = [(torch.randn((per_source, H), dtype=bf, device=dev), ends(counts[s])) for s in range(ep)]
    regions = torch.full((chunk,), ep * cap)
    by_chunk = [(torch.randn((chunk * ep * cap, H), dtype=bf, device=dev), ends(regions)) for _ in range(ep)]
    over = (counts - cap).clamp(min=0).sum(0)  # [expert]: the rows past their regions
    rest = (torch.randn((int(over.sum()), H), dtype=bf, device=dev), ends(over)) if int(over.sum()) else None
    packed = (torch.randn((ep * per_source, H), dtype=bf, device=dev), ends(counts.sum(0)))
    streams = [torch.cuda.current_stream(dev), torch.cuda.Stream(dev)]

    def sources():
        for x, offs in by_source:
            experts_of(x, w_in_t, w_out_t, offs)

    def sources_two_streams():
        for s, (x, offs) in enumerate(by_source):
            with torch.cuda.stream(streams[s % 2]):
                experts_of(x, w_in_t, w_out_t, offs)
        streams[0].wait_stream(streams[1])

    def chunks():
        for j, (x, offs) in enumerate(by_chunk):
            experts_of(x, w_in_t[j * chunk:(j + 1) * chunk], w_out_t[j * chunk:(j + 1) * chunk], offs)
        if rest is not None:
            experts_of(rest[0], w_in_t, w_out_t, rest[1])

    streams[1].wait_stream(streams[0])
    out = {name: device_ms(fn) for name, fn in (("by source", sources), ("by source, two streams", sources_two_streams),
                                               ("by chunk over regions", chunks),
                                               ("packed by expert, one launch",
                                                lambda: experts_of(packed[0], w_in_t, w_out_t, packed[1])))}
    return {"ep": ep, "local_experts": El, "rows_per_source": per_source, "region_rows": cap,
            "rows_past_regions": int(over.sum()), "ms": out}


def main() -> None:
    from overlap_layers.bench.moe import PRESETS
    from overlap_layers.layers.common.activations import act
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--counts", action="store_true", help="table 3 only")
    p.add_argument("--layout", action="store_true", help="table 4 only")
    p.add_argument("--ep", type=int, default=4, help="table 4's expert-parallel size")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    preset = PRESETS[args.preset]
    H, F = preset["hidden"], preset["ffn"]
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)

    def write(**tables) -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": {"preset": args.preset, "torch": torch.__version__,
                                    "device": torch.cuda.get_device_name(dev)}, **tables}, f, indent=1)
    if args.layout:
        res = by_layout(preset["experts"], args.ep, preset["tokens"], preset["top_k"], H, F, dev)
        print(f"EP {res['ep']}: {res['local_experts']} local experts, {res['rows_per_source']} rows per source, "
              f"regions of {res['region_rows']} rows, {res['rows_past_regions']} rows past them")
        for name, ms in res["ms"].items():
            print(f"{name:>30} {ms:8.3f} ms")
        write(by_layout=res)
        return
    if args.counts:
        rows = by_counts(preset["experts"] // 4, H, F, dev)
        print(f"{'rows':>6} {'counts':>24} {'counted':>8} {'gate_up us':>10} {'down us':>8} "
              f"{'per 16k':>8} {'per 16k':>8}")
        for r in rows:
            print(f"{r['rows']:6d} {r['kind']:>24} {r['counted']:8d} {r['gate_up_us']:10.1f} {r['down_us']:8.1f} "
                  f"{r['gate_up_us_per_16k']:8.1f} {r['down_us_per_16k']:8.1f}")
        write(by_counts=rows)
        return
    bf = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    side = torch.cuda.Stream(dev)
    gemm_rows = []
    for groups, per in ((64, 1024), (64, 512), (64, 256), (32, 1024), (32, 512), (128, 512), (128, 256)):
        w_in = torch.randn((groups, 2 * F, H), dtype=bf, device=dev, generator=g) * 0.02
        w_out = torch.randn((groups, H, F), dtype=bf, device=dev, generator=g) * 0.02
        x = torch.randn((groups * per, H), dtype=bf, device=dev, generator=g)
        offs = torch.arange(per, groups * per + 1, per, device=dev, dtype=torch.int32)

        def experts():
            pre = torch._grouped_mm(x, w_in.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(act("swiglu", pre), w_out.transpose(-2, -1), offs=offs)

        ms = device_ms(experts)
        gemm_rows.append({"groups": groups, "rows_per_group": per, "ms": ms,
                          "us_per_1k_rows": ms * 1e6 / (groups * per)})
    # host cost per launch (tiny operands)
    xs = torch.randn((64 * 8, H), dtype=bf, device=dev)
    ws_in = torch.randn((64, 2 * F, H), dtype=bf, device=dev) * 0.02
    offs = torch.arange(8, 64 * 8 + 1, 8, device=dev, dtype=torch.int32)
    pre = torch._grouped_mm(xs, ws_in.transpose(-2, -1), offs=offs)
    idx = torch.randint(0, 512, (512,), device=dev)
    buf = torch.empty_like(xs)
    ev = torch.cuda.Event()

    def switch():
        with torch.cuda.stream(side):
            pass
    host = {
        "grouped_mm": host_us(lambda: torch._grouped_mm(xs, ws_in.transpose(-2, -1), offs=offs)),
        "swiglu (fused)": host_us(lambda: act("swiglu", pre)),
        "index_select": host_us(lambda: xs.index_select(0, idx)),
        "copy_ (device to device)": host_us(lambda: buf.copy_(xs)),
        "add_": host_us(lambda: buf.add_(xs)),
        "event record": host_us(lambda: ev.record()),
        "wait_stream": host_us(lambda: side.wait_stream(torch.cuda.current_stream())),
        "stream switch (enter, exit)": host_us(switch),
        "empty": host_us(lambda: torch.empty((512, H), dtype=bf, device=dev)),
    }
    print(f"{'groups':>6} {'rows/grp':>8} {'ms':>8} {'us/1k rows':>10}")
    for r in gemm_rows:
        print(f"{r['groups']:6d} {r['rows_per_group']:8d} {r['ms']:8.3f} {r['us_per_1k_rows']:10.2f}")
    print("host us per launch: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
    write(grouped_gemm=gemm_rows, host_us=host)


if __name__ == "__main__":
    main()
