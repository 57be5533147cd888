"""The per-layer benchmark (``python -m overlap_layers.bench``): every mode of every shape asked
for, timed on every rank of each parallel group; one table on stdout, one JSON file.

Without torchrun it starts ``--nprocs`` (2) gloo ranks on the CPU and runs tiny shapes in a few
seconds. Under torchrun on GPUs it uses NCCL and bf16, e.g.::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    torchrun --nproc-per-node 4 -m overlap_layers.bench --preset llama3-8b --tp 2 4
    ... -m overlap_layers.bench --layer mlp attention --preset llama3-8b llama3-70b
    ... -m overlap_layers.bench --layer moe --preset mixtral-8x7b qwen3-30b-a3b [--skew]

Every list option takes its values space- or comma-separated (``--tp 2 4`` = ``--tp 2,4``).

Layers: mlp, attention, ulysses, moe, and block (attention + MLP of the preset, norms and residual
adds). Preset names are shared; each layer takes its shapes from its own table
(``bench.mlp.PRESETS``: tokens = batch*seq per TP group; ``bench.attention.PRESETS`` for attention,
ulysses and the block: heads, KV heads, global seq 8192, batches 2 and 4 for llama3-*;
``bench.moe.PRESETS`` for moe: experts, top-k, 8192 tokens per rank, batch 1, over an
expert-parallel group of ``--tp`` ranks).

Modes: serial (the layer at K=1: the plain parallel layer), naive (a fixed K, ``--naive-k``),
auto (the planner's choice), rank / rank_ce (rows split by source rank, over the process group /
the copy engine; rank_ce on CUDA only), asynctp (PyTorch's AsyncTP; MLP on CUDA only), compute
(the math alone, no communication) and comm (the collectives alone); limit = max(compute, comm).
A mode a layer or device lacks is left out.

Each time is the median over ``--repeats`` repeats of the slowest rank's mean over ``--iters``
calls, after ``--warmup`` calls and ``--warm-ms`` of untimed repeats. The JSON follows
``bench/results/schema.json`` (meta: the run and machine; one record per shape, pass and mode).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import textwrap
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..launch import run_ranks
from . import attention as attn_bench
from . import block as block_bench
from . import moe as moe_bench
from . import results
from .mlp import MODES, PRESETS, Shape, bench_shape
from .runner import Profile, Progress, measure_peak_tflops
from .stacks import StackSampler

LAYERS = ("mlp", "attention", "ulysses", "moe", "block")
PASSES = ("fwd", "fwdbwd")


def _presets(layer: str) -> dict:
    """The shape table of ``layer``."""
    return {"mlp": PRESETS, "moe": moe_bench.PRESETS}.get(layer, attn_bench.PRESETS)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and appends ``(default: ...)`` to every option that has a
    fixed default and does not say it already (lists shown comma-separated; no ``None``, no
    ``False``: those options say what they default to, or are flags)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def list_option(item: Callable = str, choices: Optional[Sequence] = None):
    """An argparse action for a list option that accepts its values space- or comma-separated
    (``--tp 2 4``, ``--tp 2,4``, ``--tp 2,4 8``), each converted by ``item`` and checked against
    ``choices``; use with ``nargs="+"``."""

    class ListAction(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            got = []
            for part in (x.strip() for v in values for x in str(v).split(",")):
                if not part:
                    continue
                try:
                    value = item(part)
                except ValueError:
                    parser.error(f"{option_string} {part!r}: not a valid {getattr(item, '__name__', 'value')}")
                if choices is not None and value not in choices:
                    parser.error(f"{option_string} {part!r}: choose from {', '.join(map(str, choices))}")
                got.append(value)
            if not got:
                parser.error(f"{option_string}: no values")
            setattr(namespace, self.dest, got)

    return ListAction


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (:func:`parse_args` checks what it cannot)."""
    p = argparse.ArgumentParser(prog="python -m overlap_layers.bench", description=__doc__, formatter_class=_Formatter)
    presets = sorted(set().union(*map(_presets, LAYERS)))

    def add_list(flag, item=str, choices=None, **kw):
        metavar = kw.pop("metavar", flag.lstrip("-").replace("-", "_").upper())
        p.add_argument(flag, nargs="+", action=list_option(item, choices), metavar=metavar, **kw)

    add_list("--layer", choices=LAYERS, default=["mlp"], help=f"layers to run, of {', '.join(LAYERS)}")
    add_list("--preset", choices=presets, default=None,
             help=f"shape presets, of {', '.join(presets)} (default: tiny on CPU; on GPU llama3-8b, and "
                  f"mixtral-8x7b for moe)")
    add_list("--tokens", int, default=None,
             help="mlp: tokens per TP group (batch*seq); moe: tokens per rank (default: the preset's)")
    add_list("--batch", int, default=None,
             help="attention, ulysses, block: batch sizes, each run (default: the preset's, 2 and 4 for llama3-*)")
    p.add_argument("--seq", type=int, default=None,
                   help="attention, ulysses, block: global sequence length (default: the preset's)")
    add_list("--tp", int, default=None, metavar="N",
             help="parallel group sizes to run (sub-groups of the world; moe: expert-parallel) "
                  "(default: the world size)")
    add_list("--modes", choices=MODES, default=list(MODES), metavar="MODE",
             help="modes to time (a mode the layer or device lacks is left out)")
    add_list("--passes", choices=PASSES, default=list(PASSES), metavar="PASS",
             help="fwd: forward only (no grad); fwdbwd: forward and backward")
    add_list("--naive-k", int, default=[2], metavar="K", help="the fixed K (batch tiles) of each naive run")
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism (all-reduce layers; not moe)")
    p.add_argument("--activation", default="swiglu", choices=["swiglu", "gelu", "relu"],
                   help="mlp and moe expert activation")
    p.add_argument("--skew", action="store_true",
                   help="moe: skewed routing (most tokens to expert 0) instead of balanced-ish random routing")
    p.add_argument("--transport", default="auto", choices=["auto", "nccl", "copy_engine"],
                   help="the layers' config.transport (nccl: never the copy engine; the copy engine needs CUDA)")
    p.add_argument("--graphs", action="store_true",
                   help="CUDA: time every mode as CUDA-graph replays, captured after warm-up, with the layers' "
                        "config.cuda_graphs=True; not moe (it reads its split sizes on the host)")
    p.add_argument("--graph-calls", action="store_true",
                   help="CUDA: the layers' config.graph_calls (their calls replay CUDA graphs they capture "
                        "themselves, forward and backward; moe: calls without aux loss, with their sizes on the "
                        "device). The reference modes (asynctp, compute, comm) still run eagerly, so their "
                        "ratios are not like for like: use --graphs for a grid of replays in every mode, or "
                        "neither for an eager one (moe)")
    p.add_argument("--sm-carveout", type=int, default=None, metavar="SMS",
                   help="the layers' config.sm_carveout (default: an eighth of the SMs where planned; 0: never)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="parameter and activation dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--warmup", type=int, default=None, metavar="CALLS",
                   help="untimed calls of each mode before its repeats (default: 5 on CUDA, 2 on CPU)")
    p.add_argument("--iters", type=int, default=None, metavar="CALLS",
                   help="calls per timed repeat; a repeat's time is the slowest rank's mean over them "
                        "(default: 10 on CUDA, 3 on CPU)")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help="timed repeats per mode; ms is their median, spread their range "
                        "(default: 5 on CUDA, 3 on CPU)")
    p.add_argument("--warm-ms", type=float, default=None, metavar="MS",
                   help="untimed device time each mode runs before its repeats (default: 1000 on CUDA, 0 on CPU)")
    p.add_argument("--nprocs", type=int, default=2, metavar="N", help="CPU ranks to start when not under torchrun")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile --profile-calls calls of every mode (rank 0): DIR/<shape>_<pass>_<mode>.json "
                        "(Chrome trace) and .txt (ops by device time) (default: no profiling)")
    p.add_argument("--profile-calls", type=int, default=3, metavar="N",
                   help="with --profile: calls per trace (10 or more show the steady state)")
    p.add_argument("--profile-all-ranks", action="store_true",
                   help="with --profile: every rank writes its trace (rank r > 0: <name>_rank<r>.json)")
    p.add_argument("--sample-stacks", default=None, metavar="DIR",
                   help="sample every thread's Python stack every 20 ms on every rank; each writes "
                        "DIR/stacks_rank<r>.txt: where one stack held 0.15 s or more (overlap_layers/bench/stacks.py) "
                        "(default: no sampling)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="the JSON file (default: bench/results/<layers>_tp<N>_<link>_<device>x<count>_<date>_<time>"
                        ".json, e.g. mlp_tp2_gloo_cpux2_2026-11-28_140312.json)")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    for flag, value in (("--profile-calls", args.profile_calls), ("--iters", args.iters),
                        ("--repeats", args.repeats), ("--nprocs", args.nprocs)):
        if value is not None and value < 1:
            p.error(f"{flag} {value}: must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be >= 0")
    if any(k < 1 for k in args.naive_k) or any(t < 1 for t in args.tp or []):
        p.error("--naive-k and --tp values must be >= 1")
    args.layers = list(dict.fromkeys(args.layer))
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
    sampler = StackSampler()  # where the hosts stall (overlap_layers/bench/stacks.py)
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
    tps = args.tp or [world]
    for tp in tps:
        if world % tp:
            raise SystemExit(f"--tp {tp} does not divide the world size {world}")
    started = datetime.datetime.now().astimezone()
    peak = measure_peak_tflops(device) if "reference" in args.modes or "auto" in args.modes else None
    meta = results.meta("layer", "nccl" if cuda else "gloo", world, cuda, results.command_line(args.argv),
                        date=started.astimezone(datetime.timezone.utc).isoformat(timespec="seconds"),
                        dtype=str(dtype).replace("torch.", ""), warmup=warmup, iters=iters, repeats=repeats,
                        warm_ms=warm_ms, peak_tflops=peak)
    out = args.out or os.path.join("bench", "results", results.default_name(args.layers, tps, meta, started))
    shapes = list(_shapes(args, args.preset, cuda))
    progress = Progress(len(tps) * len(shapes) * len(args.passes), enabled=rank == 0)
    records = []
    try:
        for tp in tps:
            # Every rank creates every sub-group (new_group is collective over the world).
            groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
            group = groups[rank // tp]
            for layer, preset, shape in shapes:
                run = {"mlp": bench_shape, "moe": moe_bench.bench_shape, "block": block_bench.bench_shape}.get(
                    layer, attn_bench.bench_shape)
                recs = run(shape, group, device, dtype, args.modes, args.passes, args.naive_k, warmup, iters,
                           repeats, progress,
                           Profile(args.profile, args.profile_calls, args.profile_all_ranks) if args.profile else None,
                           warm_ms, peak)
                if rank == 0:  # group 0 speaks for the run; every group ran the same grid
                    records.extend(recs)
                    _write(meta, records, out)
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        progress.close()
    if rank == 0:
        print(format_table(records, meta))
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


def _write(meta: dict, records, out: str) -> None:
    """(Re)writes the JSON after every shape, so a run cut short keeps what it measured."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)


def _num(fmt: str, scale: float = 1.0):
    def cell(value):
        return "-" if value is None else format(value / scale, fmt)
    return cell


def _plan(r: dict) -> str:
    """The plan a record's layer ran: K (batch tiles), ``rank`` / ``r-ce`` (rank chunks over NCCL /
    the copy engine, ``r-ce2``: in 2 batch tiles), the block's two plans, or blank (references)."""
    k = "" if r.get("k") is None else str(r["k"])
    if r.get("decomposition") == "rank":
        k = {"copy_engine": "r-ce", "nccl": "rank"}.get(r.get("transport"), "rank") + \
            (k if k.isdigit() and k != "1" else "")
    return k


def _spread(r: dict) -> str:
    s = r.get("spread") or {}
    if r.get("ms") is None or s.get("min_ms") is None or not s.get("n"):
        return "-"
    return f"{(s['max_ms'] - s['min_ms']) / r['ms']:.0%}"


# (header, value of a record, right-aligned, meaning); a column empty in every row is left out
COLUMNS = (
    ("layer", lambda r: r.get("layer", "mlp") + ("-skew" if r.get("skewed") else ""), False,
     "layer benchmarked (-skew: --skew routing)"),
    ("preset", lambda r: r["preset"], False, "shape preset"),
    ("TP", lambda r: str(r["world_size"]), True, "ranks in the parallel group (TP / SP / EP size)"),
    ("B", lambda r: "-" if r.get("batch") is None else str(r["batch"]), True, "batch"),
    ("tokens", lambda r: "-" if r.get("tokens") is None else str(r["tokens"]), True,
     "tokens: batch * global sequence (moe: per rank)"),
    ("pass", lambda r: r["pass"], False, "fwd: forward; fwdbwd: forward and backward"),
    ("mode", lambda r: r["mode"], False,
     "serial: K=1 (the plain parallel layer); naive: a fixed K; auto: the planner's choice; rank / rank_ce: "
     "rows split by source rank, over the process group / the copy engine; asynctp: PyTorch's AsyncTP; "
     "reference: a plain torch module written apart from the library (bench/references.py), what a user "
     "would otherwise run; compute / comm: the library's own math / collectives alone (its bounds)"),
    ("plan", _plan, True, "plan run: K batch tiles, rank / r-ce rank chunks (attention + MLP plans for block)"),
    ("ms", lambda r: _num(".3f")(r.get("ms")), True,
     "median over the repeats of the slowest rank's mean time per call"),
    ("spread", _spread, True, "(slowest - fastest repeat) / ms"),
    ("pred ms", lambda r: _num(".3f")(r.get("predicted_ms")), True, "the planner's predicted time"),
    ("host ms", lambda r: _num(".3f")(r.get("host_ms")), True, "host time per call (below ms: the host runs ahead)"),
    ("/limit", lambda r: _num(".2f")(r.get("ratio_limit")), True,
     "ms / max(compute, comm) (1.00: communication fully hidden)"),
    ("/serial", lambda r: _num(".2f")(r.get("ratio_serial")), True, "ms / serial's ms (below 1: faster than K=1)"),
    ("/ref", lambda r: _num(".2f")(r.get("ratio_reference")), True,
     "ms / reference's ms (below 1: faster than the plain torch module)"),
    ("TFLOP/s", lambda r: _num(".0f")(r.get("tflops")), True, "the pass's FLOPs per rank / ms"),
    ("eff", lambda r: "-" if r.get("efficiency") is None else f"{r['efficiency']:.0%}", True,
     "TFLOP/s / the bf16 GEMM peak measured in the same run (meta.peak_tflops)"),
    ("peak MiB", lambda r: _num(".0f", 2**20)(r.get("peak_bytes")), True,
     "peak memory of one call above what was allocated before it"),
    ("pred MiB", lambda r: _num(".0f", 2**20)(r.get("predicted_peak_bytes")), True, "the planner's predicted peak"),
)
ALWAYS = ("layer", "preset", "TP", "pass", "mode", "ms", "/limit", "/serial")


def format_table(records, meta: Optional[dict] = None) -> str:
    """The run as one table: a line on where it ran, a row per record, then what each column
    means."""
    cells = [[str(value(r)) for _, value, _, _ in COLUMNS] for r in records]
    shown = [i for i, (name, *_rest) in enumerate(COLUMNS)
             if name in ALWAYS or any(row[i] not in ("-", "") for row in cells)]
    widths = {i: max([len(COLUMNS[i][0])] + [len(row[i]) for row in cells]) for i in shown}

    def line(values):
        return "  ".join(v.rjust(widths[i]) if COLUMNS[i][2] else v.ljust(widths[i])
                         for i, v in zip(shown, values)).rstrip()

    out = []
    if meta:
        out.append(f"{results.describe(meta)}; {meta.get('dtype', '?')}; each mode: {meta.get('warmup', '?')} "
                   f"warm-up calls, then the median of {meta.get('repeats', '?')} repeats of "
                   f"{meta.get('iters', '?')} calls")
    head = line([COLUMNS[i][0] for i in shown])
    out += [head, "-" * len(head)]
    for r, row in zip(records, cells):
        out.append(line([row[i] for i in shown]) + (f"  (error: {r['error'][:80]})" if r.get("error") else ""))
    if not records:
        out.append("(no records: the modes asked for need what this run lacks, e.g. CUDA or 2+ ranks)")
    out += ["", "Columns:"]
    width = max(len(COLUMNS[i][0]) for i in shown)
    for i in shown:
        out += textwrap.wrap(COLUMNS[i][3], 100, initial_indent=f"  {COLUMNS[i][0]:<{width}}  ",
                             subsequent_indent=" " * (width + 4))
    if any(r.get("cuda_graphs") for r in records):
        out.append("Times are CUDA-graph replays (--graphs).")
    if any(r.get("graph_calls") for r in records):
        out.append("The layers replay CUDA graphs of their own calls (--graph-calls); asynctp, compute and comm "
                   "run eagerly, so ratios to them are not like for like.")
    return "\n".join(out)


def main(argv=None) -> None:
    args = parse_args(argv)
    run_ranks(_main, args, nprocs=args.nprocs)
