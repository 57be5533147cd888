"""Host time of an eager layer call, per function: inclusive microseconds per call of each wrapped
function, timed with ``time.perf_counter_ns`` (no profiler).

The torch profiler slows every op's host side 2-5x (``trace_breakdown.py --host`` reads such
traces), and cProfile does not see where a C call blocks. Here each function named in ``--wrap``
(and a default set along the layers' call paths) is replaced by a timing wrapper (about 3 us
each on the H200 machine's host: 33 of them added 0.1 ms to a 1.3 ms call), and the layer runs
``--calls`` back-to-back calls after warm-up; rank 0 prints the time per call until the loop
returns (host) and until the device is done (wall), for every rank, then the wrapped functions
by inclusive time. Run it once plain (``--wrap none``) to see whether the wrappers moved the
call's host time.

Where a rank waits for another (the agreement's host gather, ``HostMailbox.gather``), the time is
the other rank's lag, not work; a device-bound loop that fills the launch queue shows its wait in
whatever launch blocks.

    torchrun --nproc-per-node 2 bench/probes/host_phases.py --layer attention --preset llama3-8b --plan rank_ce

Functions are ``module:attribute.path``, e.g. ``overlap_layers.runtime.copy_engine_exchange:CopyEngineExchange.push``
or ``torch:mm``; a function imported by name into another module must be named where it is called.
Shapes are those of ``bench/probes/inproc_ab.py`` (off CUDA: 2 gloo ranks, tiny presets).
"""
import argparse
import functools
import importlib
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # inproc_ab's shapes
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/probes/../..
sys.path.insert(0, ROOT)  # the repo's package
from inproc_ab import make_case, plan_of, preset_of, sync_of  # noqa: E402

from overlap_layers.launch import run_ranks  # noqa: E402

COMMON = ("overlap_layers.planning.planner:LayerPlanner.agree",
          "overlap_layers.planning.planner:LayerPlanner.call",
          "overlap_layers.runtime.mailbox:HostMailbox.gather", "overlap_layers.runtime.executor:execute",
          "overlap_layers.runtime.collectives:all_gather", "overlap_layers.runtime.collectives:reduce_scatter",
          "overlap_layers.runtime.copy_engine_exchange:CopyEngineExchange.__init__",
          "overlap_layers.runtime.copy_engine_exchange:CopyEngineExchange.push",
          "overlap_layers.runtime.copy_engine_exchange:CopyEngineExchange.finish", "torch:mm", "torch:cat")
PER_LAYER = {
    "attention": ("overlap_layers.layers.attention.layer:OverlapAttention.forward",
                  "overlap_layers.layers.attention.layer:OverlapAttention._run",
                  "overlap_layers.layers.attention.rank_chunks:RankChunkAttention._forward",
                  "overlap_layers.layers.attention.tiles:TiledAttention.forward",
                  "overlap_layers.layers.attention.call:AttentionCall.chunk_heads",
                  "overlap_layers.layers.attention.call:AttentionCall.core_chunk",
                  "overlap_layers.layers.attention.call:AttentionCall.core",
                  "overlap_layers.layers.attention.query_chunks:_piece",
                  "overlap_layers.layers.attention.query_chunks:merge_fused",
                  "overlap_layers.layers.attention.core:move_heads"),
    "mlp": ("overlap_layers.layers.mlp.layer:OverlapMLP.forward", "overlap_layers.layers.mlp.layer:OverlapMLP._run"),
    "moe": ("overlap_layers.layers.moe.layer:OverlapMoE.forward", "overlap_layers.layers.moe.layer:OverlapMoE._run",
            "overlap_layers.layers.moe.layer:OverlapMoE._route_keys", "overlap_layers.layers.moe.routing:route",
            "overlap_layers.layers.moe.eager:all_gather_rows", "overlap_layers.runtime.streams:HostReader.start",
            "overlap_layers.layers.moe.eager:piece_offsets", "overlap_layers.layers.moe.eager:launch_first",
            "overlap_layers.layers.moe.ranks:forward", "overlap_layers.layers.moe.ranks:experts_forward",
            "overlap_layers.runtime.rank_all_to_all:CopyEngineAllToAll.start"),
}


def wrap(path: str, acc: dict) -> None:
    """Replace the function at ``path`` (``module:attribute.path``) by one that adds its inclusive
    nanoseconds and calls to ``acc[path]``."""
    mod, _, attr = path.partition(":")
    owner = importlib.import_module(mod)
    *parents, name = attr.split(".")
    for p in parents:
        owner = getattr(owner, p)
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    fn = raw.__func__ if kind is not None else raw

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            e = acc.setdefault(path, [0, 0])
            e[0] += time.perf_counter_ns() - t
            e[1] += 1
    setattr(owner, name, kind(timed) if kind is not None else timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", choices=("moe", "attention", "mlp"), default="attention")
    p.add_argument("--preset", default=None, help="as bench/probes/inproc_ab.py")
    p.add_argument("--plan", default="rank_ce", help="serial, rank_ce, rank_nccl or kN")
    p.add_argument("--backward", action="store_true", help="forward and backward (default: forward, no_grad)")
    p.add_argument("--wrap", default="", help="comma list of more functions; 'none': wrap nothing")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    run_ranks(run, p.parse_args())


def run(dev: torch.device, args) -> None:
    """The timed calls on this rank (under ``run_ranks``)."""
    sync, cuda = sync_of(dev)
    rank, ws = dist.get_rank(), dist.get_world_size()
    preset = preset_of(args.layer, args.preset, cuda)
    make, x, kwargs, _ = make_case(args.layer, preset, args, dev, torch.bfloat16 if cuda else torch.float32, rank, ws)
    import overlap_layers
    layer = make(overlap_layers)
    plan = args.plan
    layer.pin_plan(plan_of(overlap_layers, plan))
    acc: dict = {}
    if args.wrap != "none":
        for path in COMMON + PER_LAYER[args.layer] + tuple(w for w in args.wrap.split(",") if w):
            wrap(path, acc)
    xx = x.detach().requires_grad_(args.backward)
    dy = torch.randn_like(x)

    def call():
        if args.backward:
            layer(xx, **kwargs).backward(dy)
        else:
            with torch.no_grad():
                layer(xx, **kwargs)
    for _ in range(5):
        call()
    sync()
    dist.barrier()
    acc.clear()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    mine = torch.tensor([(t1 - t0) / args.calls * 1e3, (t2 - t0) / args.calls * 1e3], dtype=torch.float64,
                        device=dev)
    every = torch.empty(ws * 2, dtype=torch.float64, device=dev)
    # the newer name where torch has it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(every, mine)
    every = every.view(ws, 2).tolist()
    if rank == 0:
        print(f"{args.layer} {preset} {plan} {'fwd+bwd' if args.backward else 'fwd'}: ms per call (host, wall) by rank: "
              + "  ".join(f"({h:.3f}, {w:.3f})" for h, w in every))
        for path, (ns, n) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
            print(f"  {ns / args.calls / 1e3:9.1f} us  x {n / args.calls:5.1f}  {path}")


if __name__ == "__main__":
    main()
