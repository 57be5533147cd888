"""The per-layer benchmark's command line (``python -m overlap_layers.bench``).

Without torchrun it spawns ``--nprocs`` (default 2) gloo ranks on the CPU and runs tiny shapes
(well under a minute). Under torchrun on GPUs it uses NCCL and bf16, e.g.::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    torchrun --nproc-per-node 4 -m overlap_layers.bench --preset llama3-8b --tp 2 4
    ... -m overlap_layers.bench --layer mlp,attention --preset llama3-8b llama3-70b

    ... -m overlap_layers.bench --layer moe --preset mixtral-8x7b qwen3-30b-a3b [--skew]

``--layer`` takes a comma list (mlp, attention, ulysses, moe, block: attention + MLP of the
preset, ``bench/block.py``). Preset names are shared; each layer
takes its shapes from its own table (``bench.mlp.PRESETS``: tokens = batch*seq per TP group;
``bench.attention.PRESETS`` for attention, ulysses and the block: heads, KV heads, global seq 8192 and
batches 2 and 4 for llama3-*; ``bench.moe.PRESETS`` for moe: experts, top-k, 8192 tokens per rank
(batch 1), over an expert-parallel group of ``--tp`` ranks). ``--skew`` routes most tokens to one
expert (moe). ``--graphs`` (CUDA) times every mode as CUDA-graph replays, captured after
warm-up, with the layers' ``config.cuda_graphs`` set (not moe: it reads its split sizes on the host).

Prints a table (ms, ratio to limit, ratio to serial, peak memory) on rank 0 and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch
import torch.distributed as dist

from ..launch import run_ranks
from . import attention as attn_bench
from . import block as block_bench
from . import moe as moe_bench
from .mlp import MODES, PRESETS, Shape, bench_shape
from .runner import Profile
from .stacks import StackSampler

LAYERS = ("mlp", "attention", "ulysses", "moe", "block")


def _presets(layer: str) -> dict:
    """The shape table of ``layer``."""
    return {"mlp": PRESETS, "moe": moe_bench.PRESETS}.get(layer, attn_bench.PRESETS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m overlap_layers.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="mlp", help=f"comma list of {LAYERS} (default mlp)")
    p.add_argument("--preset", nargs="+", default=None, choices=sorted(set().union(*map(_presets, LAYERS))),
                   help="shape presets (default: tiny on CPU; llama3-8b on GPU, mixtral-8x7b for moe)")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="mlp: tokens per TP group (batch*seq); moe: tokens per rank; default: the preset's")
    p.add_argument("--batch", nargs="+", type=int, default=None,
                   help="attention, ulysses: batch sizes, each run (default: the preset's, 2 4 for llama3-*)")
    p.add_argument("--seq", type=int, default=None,
                   help="attention, ulysses: global sequence length (default: the preset's)")
    p.add_argument("--tp", nargs="+", type=int, default=None,
                   help="tensor-parallel sizes to run (sub-groups of the world); default: the world size")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument("--passes", default="fwd,fwdbwd", help="comma list of fwd, fwdbwd")
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism (all-reduce layers; not moe)")
    p.add_argument("--activation", default="swiglu", choices=["swiglu", "gelu", "relu"],
                   help="mlp and moe expert activation")
    p.add_argument("--skew", action="store_true",
                   help="moe: skewed routing (most tokens to expert 0) instead of balanced-ish random routing")
    p.add_argument("--transport", default="auto", choices=["auto", "nccl", "copy_engine"],
                   help="the layers' config.transport (nccl: never the copy engine)")
    p.add_argument("--graphs", action="store_true",
                   help="CUDA: time every mode as CUDA-graph replays (layers built with config.cuda_graphs=True); "
                        "not moe")
    p.add_argument("--graph-calls", action="store_true",
                   help="CUDA: the layers' config.graph_calls (their calls replay CUDA graphs they capture "
                        "themselves, forward and backward; moe: calls without aux loss, with their sizes on the "
                        "device)")
    p.add_argument("--sm-carveout", type=int, default=None, metavar="SMS",
                   help="the layers' config.sm_carveout (default: an eighth of the SMs where planned; 0: never)")
    p.add_argument("--naive-k", type=int, nargs="+", default=[2], help="fixed K values for the naive mode")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"])
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warm-ms", type=float, default=None, metavar="MS",
                   help="untimed device time each mode runs before its repeats (default 1000 on CUDA, 0 on CPU)")
    p.add_argument("--nprocs", type=int, default=2, help="CPU ranks to spawn when not under torchrun")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile --profile-calls calls of every mode (rank 0): DIR/<shape>_<pass>_<mode>.json "
                        "(Chrome trace) and .txt (ops by device time)")
    p.add_argument("--profile-calls", type=int, default=3, metavar="N",
                   help="with --profile: calls per trace (default 3; 10 or more show the steady state)")
    p.add_argument("--profile-all-ranks", action="store_true",
                   help="with --profile: every rank writes its trace (rank r > 0: <name>_rank<r>.json)")
    p.add_argument("--sample-stacks", default=None, metavar="DIR",
                   help="sample every thread's Python stack every 20 ms on every rank; each writes "
                        "DIR/stacks_rank<r>.txt: where one stack held 0.15 s or more (bench/stacks.py)")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/results/<layers>_<device>_<time>.json, e.g. mlp_cpu_...)")
    args = p.parse_args(argv)
    if args.profile_calls < 1:
        p.error(f"--profile-calls {args.profile_calls}: must be >= 1")
    args.layers = list(dict.fromkeys(x for x in args.layer.split(",") if x))
    bad = [x for x in args.layers if x not in LAYERS]
    if bad or not args.layers:
        p.error(f"--layer {args.layer!r}: valid layers are {', '.join(LAYERS)} (comma list)")
    for layer in args.layers:
        if layer == "moe" and args.graphs:
            p.error("--graphs: moe cannot be captured into a CUDA graph (it reads its all-to-all sizes on the host)")
        if layer == "ulysses" and args.no_sp:
            p.error("--no-sp: ulysses is always sequence parallel")
        table = _presets(layer)
        missing = [x for x in args.preset or [] if x not in table]
        if missing:
            p.error(f"--preset {' '.join(missing)}: no {layer} shapes (its presets: {', '.join(sorted(table))})")
    return args


def _main(device: torch.device, args) -> None:
    if not args.sample_stacks:
        return _grid(device, args)
    sampler = StackSampler()  # where the hosts stall (bench/stacks.py)
    try:
        with sampler:
            _grid(device, args)
    finally:
        os.makedirs(args.sample_stacks, exist_ok=True)
        with open(os.path.join(args.sample_stacks, f"stacks_rank{dist.get_rank()}.txt"), "w") as f:
            f.write(sampler.report())


def _grid(device: torch.device, args) -> None:
    cuda = device.type == "cuda"
    if args.graphs and not cuda:
        raise SystemExit("--graphs: CUDA graphs need CUDA devices (run under torchrun on GPUs)")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    iters = args.iters if args.iters is not None else (10 if cuda else 3)
    repeats = args.repeats if args.repeats is not None else (5 if cuda else 3)
    warm_ms = args.warm_ms if args.warm_ms is not None else (1000.0 if cuda else 0.0)  # [Note: warm device]
    modes = [m for m in args.modes.split(",") if m]
    passes = [p for p in args.passes.split(",") if p]
    bad = [m for m in modes if m not in MODES] + [p for p in passes if p not in ("fwd", "fwdbwd")]
    if bad:
        raise SystemExit(f"unknown modes/passes {bad}; modes: {MODES}, passes: fwd, fwdbwd")

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    records = []
    out = args.out or os.path.join("bench", "results", f"{'-'.join(args.layers)}_{'cuda' if cuda else 'cpu'}_"
                                   f"{datetime.datetime.now():%Y%m%d_%H%M%S}.json")
    for tp in args.tp or [world]:
        if world % tp:
            raise SystemExit(f"--tp {tp} does not divide the world size {world}")
        # Every rank creates every sub-group (new_group is collective over the world).
        groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
        group = groups[rank // tp]
        for layer, preset, shape in _shapes(args, args.preset, cuda):
            run = {"mlp": bench_shape, "moe": moe_bench.bench_shape, "block": block_bench.bench_shape}.get(
                layer, attn_bench.bench_shape)
            recs = run(shape, group, device, dtype, modes, passes, args.naive_k, warmup, iters, repeats, log,
                       Profile(args.profile, args.profile_calls, args.profile_all_ranks) if args.profile else None,
                       warm_ms)
            if rank == 0:  # group 0 speaks for the run; every group ran the same grid
                records.extend(recs)
                _write(args, cuda, world, records, out)
            if cuda:
                torch.cuda.empty_cache()
    if rank == 0:
        print(format_table(records))
        print(f"wrote {out}")
    dist.barrier()


def _shapes(args, presets, cuda: bool = False):
    """(layer, preset, shape) of every shape to run, layer by layer; ``presets`` None: each
    layer's default (tiny on CPU; llama3-8b, mixtral-8x7b for moe, on GPU)."""
    for layer in args.layers:
        for preset in presets or ["tiny" if not cuda else "mixtral-8x7b" if layer == "moe" else "llama3-8b"]:
            if layer == "moe":
                yield from ((layer, preset, s) for s in moe_bench.shapes(preset, args.tokens, args.skew,
                                                                          args.activation, args.transport,
                                                                          args.sm_carveout, args.graph_calls))
            elif layer == "mlp":
                base = PRESETS[preset]
                for tokens in args.tokens or [base["batch"] * base["seq"]]:
                    batch = base["batch"] if tokens % base["batch"] == 0 else 1
                    yield layer, preset, Shape(preset, base["hidden"], base["ffn"], batch, tokens // batch,
                                               sequence_parallel=not args.no_sp, activation=args.activation,
                                               transport=args.transport, cuda_graphs=args.graphs,
                                               graph_calls=args.graph_calls, sm_carveout=args.sm_carveout)
            else:
                base = attn_bench.PRESETS[preset]
                for batch in args.batch or base["batch"]:
                    yield layer, preset, attn_bench.AttentionShape(
                        preset, base["hidden"], base["heads"], base["kv_heads"], base["head_dim"], batch,
                        args.seq or base["seq"], sequence_parallel=not args.no_sp, layer=layer,
                        transport=args.transport, cuda_graphs=args.graphs, graph_calls=args.graph_calls,
                        sm_carveout=args.sm_carveout)


def _write(args, cuda, world, records, out) -> None:
    """(Re)write the JSON after every shape, so a run cut short keeps what it measured."""
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__,
                device=torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
                world_size=world, backend="nccl" if cuda else "gloo", command=" ".join(sys.argv),
                nccl_p2p_disable=os.environ.get("NCCL_P2P_DISABLE"),
                nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)


def format_table(records) -> str:
    head = f"{'layer':9s} {'preset':13s} {'ws':>2s} {'B':>3s} {'tokens':>6s} {'pass':6s} {'mode':8s} {'K':>4s} " \
           f"{'ms':>8s} {'pred':>7s} {'host':>7s} {'/limit':>7s} {'/serial':>7s} {'peak MiB':>9s} {'pred MiB':>9s}"
    lines = [head, "-" * len(head)]
    for r in records:
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        rl = "-" if r["ratio_limit"] is None else f"{r['ratio_limit']:.2f}"
        rs = "-" if r["ratio_serial"] is None else f"{r['ratio_serial']:.2f}"
        pr = "-" if r.get("predicted_ms") is None else f"{r['predicted_ms']:.3f}"
        host = "-" if r.get("host_ms") is None else f"{r['host_ms']:.3f}"
        pk = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.0f}"
        ppk = "-" if r.get("predicted_peak_bytes") is None else f"{r['predicted_peak_bytes'] / 2**20:.0f}"
        layer = r.get("layer", "mlp") + ("-skew" if r.get("skewed") else "")
        k = str(r.get("k", ""))
        if r.get("decomposition") == "rank":  # r-ce, or r-ce2 for rank chunks in 2 batch tiles
            k = {"copy_engine": "r-ce", "nccl": "rank"}.get(r.get("transport"), "rank") + \
                (k if k.isdigit() and k != "1" else "")
        lines.append(f"{layer:9s} {r['preset']:13s} {r['world_size']:>2d} {r.get('batch', '-')!s:>3s} "
                     f"{r['tokens']:>6d} {r['pass']:6s} {r['mode']:8s} "
                     f"{k:>4s} {ms:>8s} {pr:>7s} {host:>7s} {rl:>7s} {rs:>7s} {pk:>9s} {ppk:>9s}"
                     + (f"  ({r['error'][:60]})" if r.get("error") else ""))
    if any(r.get("cuda_graphs") for r in records):
        lines.append("(times are CUDA-graph replays: --graphs)")
    if any(r.get("graph_calls") for r in records):
        lines.append("(the layers replay graphs of their calls: --graph-calls)")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    run_ranks(_main, args, nprocs=args.nprocs)
