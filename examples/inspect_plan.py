"""What did the planner choose, and why? Print a layer's plan and draw its predicted and measured
timelines.

For each layer asked for (``--layer mlp``, ``--layer mlp,attention``) this builds it over the
whole world with ``num_tiles="auto"`` (``--num-tiles`` fixes K instead), calls it (forward and
backward) a few times, until first-call verification has settled (at most ``--calls``), prints
``layer.explain()`` on rank 0 and writes into the output directory (``--out``, default a new
temporary directory):

    <layer>_predicted.json / .png   layer.export_trace(path): the planner's timeline for the last
                                    call's plan and shape (forward and backward)
    <layer>_measured.json / .png    layer.export_trace(path, measured=True), then one more call:
                                    the ops as they ran on rank 0 (every other rank r writes
                                    <layer>_measured_rank<r>.json)

The JSON files open in Perfetto (ui.perfetto.dev) or chrome://tracing. Rank 0 prints every path.

Run it from a checkout or an install:

    python examples/inspect_plan.py                             # CPU: starts 2 gloo ranks, tiny shapes
    python examples/inspect_plan.py --layer mlp,attention --out /tmp/inspect --num-tiles 2
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
      torchrun --nproc-per-node 4 examples/inspect_plan.py --layer mlp,attention   # GPUs: NCCL, bf16

Extras: ``pip install "overlap_layers[plot]"`` (matplotlib) for the PNGs, drawn by
``overlap_layers.plot_timeline``. Without matplotlib the example still runs and writes the JSON
traces; it says in one line that it skips the drawing.

On CPU the planner works from nominal numbers and usually keeps K=1 for tiny shapes; on GPUs it
calibrates first (cached under ~/.cache/overlap_layers).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import torch
import torch.distributed as dist

if importlib.util.find_spec("overlap_layers") is None:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = ("mlp", "attention")
CPU_SHAPE = dict(hidden=64, ffn=256, heads=4, kv_heads=2, batch=2, seq=64)
GPU_SHAPE = dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, batch=2, seq=4096)  # Llama 3 8B


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="mlp", help=f"comma list of {', '.join(LAYERS)} (default mlp)")
    p.add_argument("--out", default=None, help="output directory (default: a new temporary directory)")
    p.add_argument("--num-tiles", default="auto", help='K, or "auto" (default: the planner decides)')
    p.add_argument("--calls", type=int, default=24,
                   help="at most this many calls before the traces (stops earlier once verification settled)")
    for name in CPU_SHAPE:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {CPU_SHAPE[name]} on CPU, {GPU_SHAPE[name]} on GPU"
                            + (" (global sequence; each rank holds seq/world)" if name == "seq" else ""))
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism (all-reduce layers)")
    p.add_argument("--nprocs", type=int, default=2, help="CPU ranks to spawn when not under torchrun")
    args = p.parse_args(argv)
    args.layers = list(dict.fromkeys(x for x in args.layer.split(",") if x))
    if not args.layers or any(x not in LAYERS for x in args.layers):
        p.error(f"--layer {args.layer!r}: valid layers are {', '.join(LAYERS)} (comma list)")
    if args.num_tiles != "auto":
        try:
            args.num_tiles = int(args.num_tiles)
        except ValueError:
            p.error(f"--num-tiles {args.num_tiles!r}: a positive int or 'auto'")
    return args


def _build(kind: str, shape: dict, args, device, dtype):
    from overlap_layers import OverlapAttention, OverlapMLP

    group, sp = dist.group.WORLD, not args.no_sp
    if kind == "mlp":
        return OverlapMLP(shape["hidden"], shape["ffn"], group=group, sequence_parallel=sp,
                          num_tiles=args.num_tiles, dtype=dtype, device=device)
    return OverlapAttention(shape["hidden"], shape["heads"], shape["kv_heads"], group=group, sequence_parallel=sp,
                            num_tiles=args.num_tiles, dtype=dtype, device=device)


def _call(layer, x):
    y = layer(x)
    y.float().square().mean().backward()


def _main(device: torch.device, args, out_dir) -> None:
    from overlap_layers import plot_timeline

    draw = importlib.util.find_spec("matplotlib") is not None  # the PNGs only; the traces need nothing
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = {k: getattr(args, k) if getattr(args, k) is not None else (GPU_SHAPE if cuda else CPU_SHAPE)[k]
             for k in CPU_SHAPE}
    if not args.no_sp and shape["seq"] % world:
        raise SystemExit(f"--seq {shape['seq']} must be divisible by the world size {world}")
    if out_dir is None:  # under torchrun: rank 0 makes the directory, every rank learns its name
        box = [tempfile.mkdtemp(prefix="overlap_inspect_") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        out_dir = box[0]
    os.makedirs(out_dir, exist_ok=True)
    seq_local = shape["seq"] // world if not args.no_sp else shape["seq"]
    written = []
    if not draw and rank == 0:
        print('matplotlib is not installed: writing the JSON traces without their PNGs '
              '(pip install "overlap_layers[plot]")', flush=True)
    for kind in args.layers:
        torch.manual_seed(0)  # the same weights on every rank
        layer = _build(kind, shape, args, device, dtype)
        torch.manual_seed(1 + rank)  # each rank its own tokens
        x = torch.randn(shape["batch"], seq_local, shape["hidden"], device=device, dtype=dtype, requires_grad=True)
        for i in range(max(args.calls, 1)):
            _call(layer, x)
            if i >= 2 and not layer.verifying:  # the same on every rank: a function of the call history
                break
        if rank == 0:
            print(f"=== {kind}: {type(layer).__name__}, x {tuple(x.shape)} per rank, {dtype}, {world} ranks, "
                  f"{i + 1} calls ===\n{layer.explain()}\n", flush=True)
        predicted = os.path.join(out_dir, f"{kind}_predicted.json")
        measured = os.path.join(out_dir, f"{kind}_measured.json" if rank == 0 else f"{kind}_measured_rank{rank}.json")
        if rank == 0:
            layer.export_trace(predicted)  # rank-local: no collectives
        layer.export_trace(measured, measured=True)  # recorded by the next call, on every rank alike
        _call(layer, x)
        if rank == 0:
            for trace in (predicted, measured):
                written.append(trace)
                if draw:
                    png = trace[:-len(".json")] + ".png"
                    plot_timeline(trace, png)
                    written.append(png)
    dist.barrier()
    if rank == 0:
        print("wrote:\n" + "\n".join(f"  {p}" for p in written), flush=True)
        print(f"(other ranks' measured traces: {out_dir}/*_measured_rank*.json)" if world > 1 else "", flush=True)


def main(argv=None) -> None:
    from overlap_layers.launch import run_ranks

    args = parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    out_dir = args.out or (None if under_torchrun else tempfile.mkdtemp(prefix="overlap_inspect_"))
    run_ranks(_main, args, out_dir, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
