"""Same-process A/B of two versions of the library on one OverlapMoE shape.

Eager MoE calls are host-bound on some machines, and the host's speed differs from one process
launch to the next (on 4xH200 one code measured 2.7 and 4.4 ms per call in two runs of
``bench/gpu_ab.sh``), which hides changes of 5-10%. Here both versions run in the same processes,
interleaved round by round (old, new, then new, old, ...), each round a timed loop of ``--calls``
back-to-back calls of a layer with the same weights and inputs; the first round warms up. Prints,
per plan and pass, the median over rounds of each side (max over ranks) and rank 0's peak memory
of one call of each, and writes the per-round times as JSON.

The old version is a copy of the package (``git archive OLD overlap_layers | tar x -C .ab_old``),
imported under another name. From the repo root, on the GPU machine:

    torchrun --nproc-per-node 4 bench/moe_inproc_ab.py .ab_old/overlap_layers --preset qwen3-30b-a3b \\
        --out OUT/moe_inproc_ab.json

Off CUDA it runs over gloo on the CPU (a dry run of the script itself).
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's package, as "new"


def load_old(path: str):
    """The package at ``path`` imported as ``ol_old`` (its imports are relative)."""
    spec = importlib.util.spec_from_file_location("ol_old", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ol_old"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the old package folder")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--plans", default="rank_ce,serial", help="comma list of serial, rank_ce, rank_nccl")
    p.add_argument("--passes", default="fwd,fwdbwd")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the preset's)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    old = load_old(os.path.abspath(args.old))
    import overlap_layers as new
    from overlap_layers.bench.moe import PRESETS

    cuda = torch.cuda.is_available()
    if cuda:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
        sync = torch.cuda.synchronize
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
        sync = lambda: None  # noqa: E731
    rank = dist.get_rank()
    preset = args.preset if cuda else "tiny"
    s = dict(PRESETS[preset])
    if args.tokens and cuda:
        s["tokens"] = args.tokens
    H, F, E, k = s["hidden"], s["ffn"], s["experts"], s["top_k"]
    dt = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    dense = dict(router_weight=torch.randn(E, H, device=dev, dtype=dt) * H ** -0.5,
                 w_in=torch.randn(E, 2 * F, H, device=dev, dtype=dt) * H ** -0.5,
                 w_out=torch.randn(E, H, F, device=dev, dtype=dt) * F ** -0.5)
    torch.manual_seed(1 + rank)
    x = torch.randn(1, s["tokens"], H, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    sides = {name: (pk, pk.OverlapMoE.from_dense(**dense, top_k=k, group=dist.group.WORLD, num_tiles=1))
             for name, pk in (("old", old), ("new", new))}

    def plan_of(pk, name):
        TilePlan = pk.layers.planned.TilePlan
        if name == "serial":
            return TilePlan(1)
        return TilePlan(1, decomposition="rank", transport=name.split("_")[1].replace("ce", "copy_engine"))

    res = {}
    for plan in args.plans.split(","):
        for pas in args.passes.split(","):
            for pk, layer in sides.values():
                layer.pin_plan(plan_of(pk, plan))
            xx = x.detach().requires_grad_(pas == "fwdbwd")

            def call(layer):
                if pas == "fwd":
                    with torch.no_grad():
                        layer(xx)
                else:
                    layer(xx).backward(dy)
            times = {"old": [], "new": []}
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
                    sync()
                    if r:  # round 0 warms up
                        times[side].append((time.perf_counter() - t0) / args.calls * 1e3)
            peak = {}
            for side in ("old", "new"):  # one call's peak above what was allocated before it
                if cuda:
                    sync()
                    before = torch.cuda.memory_allocated(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                    call(sides[side][1])
                    sync()
                    peak[side] = (torch.cuda.max_memory_allocated(dev) - before) / 2 ** 20
            med = torch.tensor([statistics.median(times["old"]), statistics.median(times["new"])], dtype=torch.float64,
                               device=dev)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            o, n = med.tolist()
            res[f"{plan}/{pas}"] = dict(old_ms=o, new_ms=n, change=n / o - 1, rank0_old=times["old"],
                                        rank0_new=times["new"], rank0_peak_mib=peak)
            if rank == 0:
                print(f"{preset} {plan:9s} {pas:7s} old {o:8.3f} ms  new {n:8.3f} ms  {100 * (n / o - 1):+6.1f}%  "
                      + "  ".join(f"peak {s} {m:.0f} MiB" for s, m in peak.items()), flush=True)
    if rank == 0 and args.out:
        meta = dict(preset=preset, tokens=s["tokens"], world_size=dist.get_world_size(), rounds=args.rounds, calls=args.calls,
                    torch=torch.__version__, device=torch.cuda.get_device_name(dev) if cuda else "cpu")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=res), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
