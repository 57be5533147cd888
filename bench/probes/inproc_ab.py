"""Same-process A/B of two versions of the library on one layer shape (MoE, attention or MLP).

Eager calls that are host-bound, or nearly, time differently from one process launch to the next
(on 4xH200 one MoE code measured 2.7 and 4.4 ms per call in two runs of ``bench/probes/gpu_ab.sh``; on
2xH200 one attention plan 2.36 to 2.69), which hides changes of 5-10%. Here both versions run in
the same processes, interleaved round by round (old, new, then new, old, ...), each round a timed
loop of ``--calls`` back-to-back calls of a layer with the same weights and inputs; the first
round warms up. Prints, per plan and pass, the median over rounds of each side (max over ranks)
of the time per call and of the host's time per call (until the loop returns, before waiting for
the device: a side whose host time reaches its call time is host-bound), and rank 0's peak memory
of one call of each; writes the per-round times as JSON.

The old version is a copy of the package (``git archive OLD overlap_layers | tar x -C .ab_old``),
imported under another name. From the repo root, on the GPU machine:

    torchrun --nproc-per-node 2 bench/probes/inproc_ab.py .ab_old/overlap_layers --layer attention \\
        --preset llama3-8b --plans rank_ce,serial --out OUT/attention_inproc_ab.json

Shapes are the per-layer benchmark's presets (``--layer moe``: ``--tokens`` per rank;
attention: ``--batch`` sequences of the preset's length; mlp: its batch and sequence). Off CUDA
it runs over gloo on the CPU with the ``tiny`` presets (a dry run of the script itself).
"""
import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/probes/../..
sys.path.insert(0, ROOT)  # the repo's package, as "new"
from overlap_layers.launch import run_ranks  # noqa: E402


def load_old(path: str):
    """The package at ``path`` imported as ``ol_old`` (its imports are relative)."""
    spec = importlib.util.spec_from_file_location("ol_old", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ol_old"] = mod
    spec.loader.exec_module(mod)
    return mod


def submodule(pkg: str, *names: str):
    """The first of the submodules ``names`` of the package ``pkg`` that it has: a module's paths
    before and after a move (an old copy may have either layout)."""
    for name in names:
        try:
            return importlib.import_module(f"{pkg}.{name}")
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"{pkg} has none of {names}")


def make_case(layer: str, preset: str, args, dev, dt, rank: int, ws: int):
    """``(dense weights, make(pkg) -> layer, x, dy, extra call kwargs, shape)`` of one preset."""
    torch.manual_seed(0)

    def randn(*shape, fan_in):
        return torch.randn(*shape, device=dev, dtype=dt) * fan_in ** -0.5
    if layer == "moe":
        from overlap_layers.bench.moe import PRESETS
        s = dict(PRESETS[preset])
        if args.tokens:
            s["tokens"] = args.tokens
        H, F, E, k = s["hidden"], s["ffn"], s["experts"], s["top_k"]
        dense = dict(router_weight=randn(E, H, fan_in=H), w_in=randn(E, 2 * F, H, fan_in=H),
                     w_out=randn(E, H, F, fan_in=F))
        torch.manual_seed(1 + rank)  # every rank its own tokens
        x = torch.randn(1, s["tokens"], H, device=dev, dtype=dt)

        def make(pk):
            return pk.OverlapMoE.from_dense(**dense, top_k=k, group=dist.group.WORLD, num_tiles=1)
        return make, x, {}, s
    if layer == "attention":
        from overlap_layers.bench.attention import PRESETS, ROPE_THETA
        from overlap_layers.layers.attention.core import rope_cos_sin
        s = dict(PRESETS[preset])
        B, S, H, d = args.batch or s["batch"][0], s["seq"], s["hidden"], s["head_dim"]
        nq, nkv = s["heads"], s["kv_heads"]
        dense = dict(wq=randn(nq * d, H, fan_in=H), wk=randn(nkv * d, H, fan_in=H), wv=randn(nkv * d, H, fan_in=H),
                     wo=randn(H, nq * d, fan_in=nq * d))
        x = torch.randn(B, S // ws, H, device=dev, dtype=dt)
        cos_sin = tuple(t.to(dt) for t in rope_cos_sin(torch.arange(S, device=dev)[None], d, ROPE_THETA, dt))

        def make(pk):
            return pk.OverlapAttention.from_dense(**dense, num_heads=nq, num_kv_heads=nkv, group=dist.group.WORLD,
                                                  rope_theta=ROPE_THETA, num_tiles=1)
        return make, x, dict(position_embeddings=cos_sin), dict(s, batch=B)
    from overlap_layers.bench.mlp import PRESETS
    s = dict(PRESETS[preset])
    H, F = s["hidden"], s["ffn"]
    dense = dict(w_in=randn(2 * F, H, fan_in=H), w_out=randn(H, F, fan_in=F))
    x = torch.randn(s["batch"], s["seq"] // ws, H, device=dev, dtype=dt)

    def make(pk):
        return pk.OverlapMLP.from_dense(**dense, group=dist.group.WORLD, num_tiles=1)
    return make, x, {}, s


def sync_of(dev: torch.device):
    """``(sync, cuda)``: a function that waits for ``dev``, and whether it is a GPU."""
    cuda = dev.type == "cuda"
    return (torch.cuda.synchronize if cuda else lambda: None), cuda


def preset_of(layer: str, preset, cuda: bool) -> str:
    """The preset to run: ``preset`` or the layer's default on CUDA, ``tiny`` off it."""
    return (preset or ("qwen3-30b-a3b" if layer == "moe" else "llama3-8b")) if cuda else "tiny"


def plan_of(pk, name: str):
    """The TilePlan of package ``pk`` named ``serial``, ``rank_ce``, ``rank_nccl`` or ``kN[sS][cC]``
    (N batch tiles over NCCL on S compute streams, default 2, the GEMMs leaving C SMs free in
    both passes, default none)."""
    TilePlan = pk.layers.TilePlan
    if name == "serial":
        return TilePlan(1)
    tiles = re.fullmatch(r"k(\d+)(?:s(\d+))?(?:c(\d+))?", name)
    if tiles:
        k, s, c = tiles.groups()
        return TilePlan(int(k), num_streams=int(s or 2), carveout=(int(c), int(c)) if c else ())
    return TilePlan(1, decomposition="rank", transport=name.split("_")[1].replace("ce", "copy_engine"))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the old package folder")
    p.add_argument("--layer", choices=("moe", "attention", "mlp"), default="moe")
    p.add_argument("--preset", default=None, help="default: qwen3-30b-a3b (moe), llama3-8b (attention, mlp)")
    p.add_argument("--plans", default="rank_ce,serial",
                   help="comma list of serial, rank_ce, rank_nccl, kN[sS][cC] (N batch tiles over NCCL, S "
                        "compute streams, C SMs left free by the GEMMs)")
    p.add_argument("--passes", default="fwd,fwdbwd")
    p.add_argument("--tokens", type=int, default=None, help="moe: tokens per rank (default: the preset's)")
    p.add_argument("--batch", type=int, default=None, help="attention: sequences (default: the preset's first)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    load_old(os.path.abspath(args.old))
    run_ranks(run, args)


def run(dev: torch.device, args) -> None:
    """The A/B on this rank (under ``run_ranks``, which destroys the group once the layers are
    gone)."""
    old = sys.modules["ol_old"]
    import overlap_layers as new
    sync, cuda = sync_of(dev)
    rank, ws = dist.get_rank(), dist.get_world_size()
    preset = preset_of(args.layer, args.preset, cuda)
    dt = torch.bfloat16 if cuda else torch.float32
    make, x, kwargs, shape = make_case(args.layer, preset, args, dev, dt, rank, ws)
    dy = torch.randn_like(x)
    sides = {name: (pk, make(pk)) for name, pk in (("old", old), ("new", new))}

    res = {}
    for plan in args.plans.split(","):
        for pas in args.passes.split(","):
            for pk, layer in sides.values():
                layer.pin_plan(plan_of(pk, plan))
            xx = x.detach().requires_grad_(pas == "fwdbwd")

            def call(layer):
                if pas == "fwd":
                    with torch.no_grad():
                        layer(xx, **kwargs)
                else:
                    layer(xx, **kwargs).backward(dy)
            times = {"old": [], "new": []}
            host = {"old": [], "new": []}
            for r in range(args.rounds + 1):
                for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    layer = sides[side][1]
                    for _ in range(3):
                        call(layer)
                    sync()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        call(layer)
                    t1 = time.perf_counter()
                    sync()
                    if r:  # round 0 warms up
                        times[side].append((time.perf_counter() - t0) / args.calls * 1e3)
                        host[side].append((t1 - t0) / args.calls * 1e3)
            peak = {}
            for side in ("old", "new"):  # one call's peak above what was allocated before it
                if cuda:
                    sync()
                    before = torch.cuda.memory_allocated(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                    call(sides[side][1])
                    sync()
                    peak[side] = (torch.cuda.max_memory_allocated(dev) - before) / 2 ** 20
            med = torch.tensor([statistics.median(v[s]) for v in (times, host) for s in ("old", "new")],
                               dtype=torch.float64, device=dev)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            o, n, ho, hn = med.tolist()
            res[f"{plan}/{pas}"] = dict(old_ms=o, new_ms=n, change=n / o - 1, old_host_ms=ho, new_host_ms=hn,
                                        rank0_old=times["old"], rank0_new=times["new"], rank0_host_old=host["old"],
                                        rank0_host_new=host["new"], rank0_peak_mib=peak)
            if rank == 0:
                print(f"{args.layer} {preset} {plan:9s} {pas:7s} old {o:8.3f} ms (host {ho:7.3f})  new {n:8.3f} ms "
                      f"(host {hn:7.3f})  {100 * (n / o - 1):+6.1f}%  "
                      + "  ".join(f"peak {s} {m:.0f} MiB" for s, m in peak.items()), flush=True)
    if rank == 0 and args.out:
        meta = dict(layer=args.layer, preset=preset, shape=shape, world_size=ws, rounds=args.rounds, calls=args.calls,
                    torch=torch.__version__, device=torch.cuda.get_device_name(dev) if cuda else "cpu")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=res), f, indent=1)


if __name__ == "__main__":
    main()
