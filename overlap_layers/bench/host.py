"""The host-overhead benchmark (``python -m overlap_layers.bench.host``): host microseconds per
call of each layer against the plain torch module it replaces (``bench/references.py``), on
shapes so small that the device's work never holds the host up.

What it must measure: for each layer kind (``--layers``: mlp, attention, moe) and pass (fwd:
``with torch.no_grad(): m(x)``; fwdbwd: ``m(x).sum().backward()``, x requiring grad), the host
time per call of the library layer (its default config, ``--num-tiles``: "auto") and of the plain
reference built from the same shapes, over the whole world as one tensor- (expert-) parallel
group. Each module first runs ``--warmup`` calls; the layer then runs on while ``layer.verifying``
(its first-call verification) holds on any rank, up to ``--max-warmup`` calls (a record whose
layer had not settled says so: ``settled`` false). Then ``--repeats`` repeats of ``--iters`` calls
each, the reference's and the layer's repeats alternating (plain, layer, plain, layer, ...) so a
drift of the machine hits both. A repeat's host time is the wall time from its first call to the
return of its last, without waiting for the device (the ranks leave a barrier together first; on
CUDA the device is synchronised before and after the repeat only); its synced time also waits for
the device to finish (on the CPU the two are the same). At world size > 1 each repeat counts as
its slowest rank's (an all-reduce MAX of the per-rank times). Reported per call: the median over
the repeats, their fastest and slowest, and the ratio layer / plain of the medians. Both modules
run with the same ``torch.set_num_threads`` (``--threads``: 1 on CPU). Python's garbage collector
stays on (its pauses are host time too) after a full collection before each pass.

Runs: without torchrun it starts ``--nprocs`` gloo ranks on the CPU (``overlap_layers.launch``);
under torchrun NCCL with one GPU per rank, e.g.::

    torchrun --nproc-per-node 2 -m overlap_layers.bench.host --layers mlp,moe

It prints a table last and writes JSON (``bench/results/schema.json``, kind ``host``: one record
per layer, pass and mode ``plain`` / ``layer``) to ``--out`` or
``bench/results/host_<layers>_tp<N>_<link>_<device>x<count>_<date>_<time>.json``. ``--profile``
prints, for each layer and pass, the 25 functions of most own time (cProfile's tottime) over
``--iters`` calls of the layer on rank 0.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import pstats
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

from ..launch import run_ranks
from ..layers.attention.layer import OverlapAttention
from ..layers.mlp.layer import OverlapMLP
from ..layers.moe.layer import OverlapMoE
from . import results
from .cli import list_option
from .references import PlainAttention, PlainMLP, PlainMoE

LAYERS = ("mlp", "attention", "moe")
PASSES = ("fwd", "fwdbwd")
MODES = ("plain", "layer")
PROFILE_TOP = 25  # functions --profile prints per layer and pass


@dataclass(frozen=True)
class Shapes:
    """Every layer's shape; batch and seq are the global sequence (per rank for the MoE)."""
    batch: int = 2
    seq: int = 16
    mlp_hidden: int = 64
    mlp_ffn: int = 256
    attn_hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    moe_hidden: int = 64
    moe_ffn: int = 32
    experts: int = 8
    top_k: int = 2
    sequence_parallel: bool = True

    def fields(self, layer: str) -> dict:
        """The record fields of ``layer``'s shape (``tokens``: per TP group, per rank for moe)."""
        out = dict(preset="tiny" if self == Shapes(sequence_parallel=self.sequence_parallel) else "custom",
                   batch=self.batch, seq=self.seq, tokens=self.batch * self.seq)
        if layer == "mlp":
            return dict(out, hidden=self.mlp_hidden, ffn=self.mlp_ffn, sequence_parallel=self.sequence_parallel)
        if layer == "attention":
            return dict(out, hidden=self.attn_hidden, heads=self.heads, kv_heads=self.kv_heads,
                        sequence_parallel=self.sequence_parallel)
        return dict(out, hidden=self.moe_hidden, ffn=self.moe_ffn, experts=self.experts, top_k=self.top_k,
                    sequence_parallel=None)


@dataclass
class Pair:
    """One layer kind's library layer, its plain reference, and the input of both."""
    layer: torch.nn.Module
    plain: torch.nn.Module
    x: torch.Tensor


def build(kind: str, s: Shapes, group, device, dtype, num_tiles) -> Pair:
    """The layer and the reference of ``kind`` (the same seed on every rank: equal replicated
    weights), and an input of the layer's layout (the MoE's: each rank's own tokens)."""
    ws = dist.get_world_size(group)
    kw = dict(group=group, dtype=dtype, device=device)
    torch.manual_seed(0)
    if kind == "mlp":
        layer = OverlapMLP(s.mlp_hidden, s.mlp_ffn, sequence_parallel=s.sequence_parallel, activation="swiglu",
                           num_tiles=num_tiles, **kw)
        plain = PlainMLP(s.mlp_hidden, s.mlp_ffn, sequence_parallel=s.sequence_parallel, **kw)
        hidden = s.mlp_hidden
    elif kind == "attention":
        layer = OverlapAttention(s.attn_hidden, s.heads, s.kv_heads, sequence_parallel=s.sequence_parallel,
                                 rope_theta=10000.0, causal=True, num_tiles=num_tiles, **kw)
        plain = PlainAttention(s.attn_hidden, s.heads, s.kv_heads, sequence_parallel=s.sequence_parallel,
                               rope_theta=10000.0, **kw)
        hidden = s.attn_hidden
    else:
        layer = OverlapMoE(s.moe_hidden, s.moe_ffn, s.experts, s.top_k, num_tiles=num_tiles, **kw)
        plain = PlainMoE(s.moe_hidden, s.moe_ffn, s.experts, s.top_k, **kw)
        torch.manual_seed(1 + dist.get_rank(group))
        return Pair(layer, plain, torch.randn(s.batch, s.seq, s.moe_hidden, device=device, dtype=dtype))
    if s.seq % ws:
        raise ValueError(f"seq={s.seq} must be divisible by the group size {ws}")
    seq = s.seq // ws if s.sequence_parallel else s.seq
    return Pair(layer, plain, torch.randn(s.batch, seq, hidden, device=device, dtype=dtype))


def pass_call(module: torch.nn.Module, x: torch.Tensor, backward: bool) -> Callable[[], None]:
    """One call of a pass (module docstring)."""
    if backward:
        xg = x.detach().requires_grad_()

        def run():
            module(xg).sum().backward()
        return run

    def run():
        with torch.no_grad():
            module(x)
    return run


def _any_rank(flag: bool, group, device) -> bool:
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def settle(fn: Callable[[], None], layer, warmup: int, cap: int, group, device) -> Tuple[int, bool]:
    """``warmup`` calls, then more while ``layer.verifying`` on any rank, ``cap`` calls at most;
    (calls run, whether the layer settled). A module without ``verifying`` runs ``warmup``."""
    calls = 0
    for _ in range(warmup):
        fn()
        calls += 1
    if not hasattr(layer, "verifying"):
        return calls, True
    while calls < cap and _any_rank(layer.verifying, group, device):
        fn()
        calls += 1
    return calls, not _any_rank(layer.verifying, group, device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_repeat(fn: Callable[[], None], iters: int, group, device) -> Tuple[float, float]:
    """(host us, synced us) per call of one repeat of ``iters`` calls, each its slowest rank's."""
    dist.barrier(group=group)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - t0
    _sync(device)
    synced = time.perf_counter() - t0
    t = torch.tensor([host, synced], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t[0].item() / iters * 1e6, t[1].item() / iters * 1e6


def profile_text(fn: Callable[[], None], calls: int, on: bool) -> str:
    """``calls`` calls of ``fn`` (on every rank), under cProfile where ``on``: its
    :data:`PROFILE_TOP` functions by own time ('' where not ``on``)."""
    prof = cProfile.Profile() if on else None
    if prof is not None:
        prof.enable()
    for _ in range(calls):
        fn()
    if prof is None:
        return ""
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(PROFILE_TOP)
    return out.getvalue()


@dataclass(frozen=True)
class Timing:
    """How :func:`measure` runs the calls: the counts of the module docstring, and ``profile``."""
    warmup: int
    max_warmup: int
    iters: int
    repeats: int
    profile: bool = False


def _summary(host: List[float], synced: List[float]) -> dict:
    """A mode's record fields from its repeats' per-call times (us)."""
    us = statistics.median(host)
    return dict(ms=us / 1e3, spread=dict(min_ms=min(host) / 1e3, max_ms=max(host) / 1e3, n=len(host)),
                host_us=us, repeat_us=host, synced_us=statistics.median(synced), synced_repeat_us=synced)


def measure(kind: str, pair: Pair, backward: bool, t: Timing, group, device) -> Tuple[dict, dict]:
    """The (plain, layer) record fields of one layer kind and pass (module docstring)."""
    gc.collect()
    fns = {"plain": pass_call(pair.plain, pair.x, backward), "layer": pass_call(pair.layer, pair.x, backward)}
    warm = {mode: settle(fns[mode], getattr(pair, mode), t.warmup, t.max_warmup, group, device) for mode in MODES}
    samples = {mode: ([], []) for mode in MODES}
    for _ in range(t.repeats):
        for mode in MODES:  # plain, layer, plain, layer, ...: a drift hits both
            host, synced = time_repeat(fns[mode], t.iters, group, device)
            samples[mode][0].append(host)
            samples[mode][1].append(synced)
    out = {mode: dict(_summary(*samples[mode]), warmup_calls=warm[mode][0]) for mode in MODES}
    plan = pair.layer.plan
    out["layer"].update(settled=warm["layer"][1], plan=plan.label if plan is not None else None,
                        ratio_plain=out["layer"]["host_us"] / out["plain"]["host_us"])
    impl = getattr(pair.plain, "expert_impl", None)
    if impl is not None:
        out["plain"]["expert_impl"] = impl.value
    if t.profile:
        text = profile_text(fns["layer"], t.iters, dist.get_rank() == 0)
        if text:
            print(f"--- cProfile: {kind} {'fwdbwd' if backward else 'fwd'}, layer, {t.iters} calls, rank 0, "
                  f"top {PROFILE_TOP} by tottime ---\n{text}", flush=True)
    return out["plain"], out["layer"]


# ------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m overlap_layers.bench.host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Shapes()

    def add_list(flag, item=str, choices=None, **kw):
        p.add_argument(flag, nargs="+", action=list_option(item, choices), **kw)

    def add_int(flag, default, what):
        p.add_argument(flag, type=int, default=default, metavar="N", help=f"{what} (default: {default})")

    add_list("--layers", choices=LAYERS, default=list(LAYERS), metavar="LAYER",
             help=f"layer kinds, space- or comma-separated, of {', '.join(LAYERS)} (default: all)")
    add_list("--passes", choices=PASSES, default=list(PASSES), metavar="PASS",
             help="fwd: forward under no_grad; fwdbwd: forward and backward (default: both)")
    p.add_argument("--num-tiles", default="auto", metavar="K",
                   help="the layers' num_tiles: auto, or a fixed K (default: auto)")
    add_int("--batch", d.batch, "batch")
    add_int("--seq", d.seq, "sequence length: global for mlp and attention, per rank for moe")
    add_int("--mlp-hidden", d.mlp_hidden, "mlp hidden size")
    add_int("--mlp-ffn", d.mlp_ffn, "mlp ffn size (SwiGLU)")
    add_int("--attn-hidden", d.attn_hidden, "attention hidden size")
    add_int("--heads", d.heads, "attention query heads")
    add_int("--kv-heads", d.kv_heads, "attention KV heads")
    add_int("--moe-hidden", d.moe_hidden, "moe hidden size")
    add_int("--moe-ffn", d.moe_ffn, "moe expert ffn size (SwiGLU)")
    add_int("--experts", d.experts, "moe experts")
    add_int("--top-k", d.top_k, "moe experts per token")
    p.add_argument("--no-sp", action="store_true",
                   help="mlp and attention without sequence parallelism (replicated input, all-reduced output)")
    add_int("--warmup", 20, "untimed calls of each module before its repeats")
    add_int("--max-warmup", 500, "untimed calls of a layer at most, while its first-call verification runs")
    add_int("--iters", 200, "calls per timed repeat")
    add_int("--repeats", 5, "timed repeats of each module, alternating plain and layer")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch.set_num_threads on every rank (default: 1 on CPU, torch's own on CUDA)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype (default: float32 on CPU, bfloat16 on CUDA)")
    add_int("--nprocs", 2, "CPU ranks to start when not under torchrun")
    p.add_argument("--profile", action="store_true",
                   help=f"print the top {PROFILE_TOP} functions by cProfile tottime of --iters layer calls on rank 0, "
                        f"per layer and pass")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="the JSON file (default: bench/results/host_<layers>_tp<N>_<link>_<device>x<count>_<date>"
                        "_<time>.json)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    if args.num_tiles != "auto":
        try:
            args.num_tiles = int(args.num_tiles)
        except ValueError:
            p.error(f"--num-tiles {args.num_tiles!r}: auto or a positive integer")
    positive = ("num_tiles", "batch", "seq", "mlp_hidden", "mlp_ffn", "attn_hidden", "heads", "kv_heads",
                "moe_hidden", "moe_ffn", "experts", "top_k", "iters", "repeats", "nprocs", "threads")
    for name in positive:
        value = getattr(args, name)
        if isinstance(value, int) and value < 1:
            p.error(f"--{name.replace('_', '-')} {value}: must be >= 1")
    if args.warmup < 0 or args.max_warmup < args.warmup:
        p.error("--warmup must be >= 0 and --max-warmup >= --warmup")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    args.layers = list(dict.fromkeys(args.layers))
    args.passes = list(dict.fromkeys(args.passes))
    return args


def shapes_of(args) -> Shapes:
    return Shapes(batch=args.batch, seq=args.seq, mlp_hidden=args.mlp_hidden, mlp_ffn=args.mlp_ffn,
                  attn_hidden=args.attn_hidden, heads=args.heads, kv_heads=args.kv_heads, moe_hidden=args.moe_hidden,
                  moe_ffn=args.moe_ffn, experts=args.experts, top_k=args.top_k, sequence_parallel=not args.no_sp)


def _main(device: torch.device, args) -> None:
    cuda = device.type == "cuda"
    threads = args.threads if args.threads is not None else (None if cuda else 1)
    if threads is not None:
        torch.set_num_threads(threads)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    shapes = shapes_of(args)
    timing = Timing(args.warmup, args.max_warmup, args.iters, args.repeats, args.profile)
    started = datetime.datetime.now().astimezone()
    meta = results.meta("host", "nccl" if cuda else "gloo", world, cuda,
                        results.command_line(args.argv, "overlap_layers.bench.host"),
                        date=started.astimezone(datetime.timezone.utc).isoformat(timespec="seconds"),
                        dtype=str(dtype).replace("torch.", ""), warmup=args.warmup, max_warmup=args.max_warmup,
                        iters=args.iters, repeats=args.repeats, threads=torch.get_num_threads(),
                        num_tiles=args.num_tiles, shapes=asdict(shapes))
    out = args.out or os.path.join("bench", "results", "host_" + results.default_name(args.layers, [world], meta,
                                                                                      started))
    records = []
    for kind in args.layers:
        pair = build(kind, shapes, group, device, dtype, args.num_tiles)
        for pass_ in args.passes:
            plain, layer = measure(kind, pair, pass_ == "fwdbwd", timing, group, device)
            base = dict(layer=kind, **shapes.fields(kind), world_size=world, dtype=meta["dtype"],
                        num_tiles=args.num_tiles, **{"pass": pass_})
            records += [dict(base, mode="plain", **plain), dict(base, mode="layer", **layer)]
        del pair
    if rank == 0:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
        print(f"wrote {out}")
        print(format_table(records, meta))
    dist.barrier()


def _range(r: dict) -> str:
    s = r["spread"]
    return f"{s['min_ms'] * 1e3:.0f}-{s['max_ms'] * 1e3:.0f}"


def format_table(records: List[dict], meta: dict) -> str:
    """One row per layer and pass: the plain and layer medians (us per call), their ratio, and
    the range of each one's repeats; on CUDA also the synced medians."""
    cuda = meta.get("device") != "cpu"
    head = ["layer", "pass", "plain us", "layer us", "ratio", "spread plain | layer"] + \
        (["plain synced us", "layer synced us"] if cuda else [])
    rows = []
    for plain, layer in zip(records[::2], records[1::2]):
        row = [plain["layer"], plain["pass"], f"{plain['host_us']:.1f}", f"{layer['host_us']:.1f}",
               f"{layer['ratio_plain']:.2f}", f"{_range(plain)} | {_range(layer)}"]
        if cuda:
            row += [f"{plain['synced_us']:.1f}", f"{layer['synced_us']:.1f}"]
        if not layer["settled"]:
            row[-1] += "  (layer still verifying)"
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([f"host time per call, {results.describe(meta)}; {meta['dtype']}; {meta['threads']} thread(s) "
                      f"per rank; median of {meta['repeats']} repeats of {meta['iters']} calls, the slowest rank's; "
                      f"num_tiles {meta['num_tiles']}",
                      line(head), "-" * len(line(head)), *map(line, rows),
                      "ratio = layer us / plain us; spread: fastest-slowest repeat, us"])


def main(argv=None) -> None:
    args = parse_args(argv)
    run_ranks(_main, args, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
