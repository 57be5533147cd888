"""The benchmark's shared machinery: timing across ranks, peak memory of one call, and the loop
over modes that turns one layer's bench object into records.

Each time is the median over repeats of the max over ranks of the mean of ``iters`` calls, taken
once the device runs warm ([Note: warm device]); limit = max(compute, comm).

[Note: warm device]
A GPU that idled for a moment (between two modes: building the next one, planning, collecting
garbage) runs its first tens of milliseconds of load at a higher clock than it sustains: on a 4x
H200 machine the compute-only reference of the llama3-8b MLP (TP 4, 8192 tokens, fwd+bwd) reads
about 12% faster in its first repeat than from its fourth on, and the first repeat of most modes
reads 1-6% low. With a few warm-up calls and repeats, a mode's median could sit on that slope,
each mode at a different place on it, so the ratio of two modes would move with the order they ran
in. So each mode first runs untimed repeats for ``warm_ms`` of device time (the CLI's
``--warm-ms``: 1000 on CUDA, 0 on CPU; at most :data:`MAX_WARM_REPEATS` of them, for a callable
that takes no time), and its timed repeats read the sustained state that a training run sees.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..planning.layer_spec import TiledLayer
from ..runtime.symmetric import held_workspace_bytes


@contextlib.contextmanager
def full_collections(min_ms: float = 1.0):
    """Yields a list that gets the duration (ms) of every full collection of Python's cyclic
    garbage collector (generation 2) of at least ``min_ms`` while the block runs. A collection
    pauses this rank's host, and the other ranks wait for it at the next collective: one that
    falls in a verification trial times that trial wrong ([Note: first-call verification])."""
    got, start = [], []

    def callback(phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            start[:] = [time.perf_counter()]
        elif start:
            ms = (time.perf_counter() - start[0]) * 1e3
            if ms >= min_ms:
                got.append(round(ms, 1))
    gc.callbacks.append(callback)
    try:
        yield got
    finally:
        gc.callbacks.remove(callback)


def gathered_collections(setup: List[float], timed: List[float], group) -> Dict[str, List[List[float]]]:
    """Every rank's full collections (:func:`full_collections`) of one mode, setup and timed,
    as lists by rank: a stall on any rank holds up every rank, so one rank's would not tell.
    Called by every rank at the same point of the grid (an all-gather)."""
    got = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, (setup, timed), group=group)
    return {"setup": [s for s, _ in got], "timed": [t for _, t in got]}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pass_fn(forward: Callable, backward: bool, grads: Sequence[torch.Tensor],
            leaves: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A callable running one pass: ``forward()`` (a tensor or a tuple of them) under no_grad, or,
    with ``backward``, forward then backward of its outputs with ``grads``, clearing the
    ``leaves``' gradients after."""
    def run():
        if backward:
            out = forward()
            torch.autograd.backward(list(out) if isinstance(out, (tuple, list)) else [out], list(grads))
            for t in leaves:
                t.grad = None
        else:
            with torch.no_grad():
                forward()
    return run


MAX_WARM_REPEATS = 10_000  # untimed repeats of a mode at most ([Note: warm device])


def time_fn(fn: Callable[[], None], device, group, warmup: int, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of (max over ranks of the mean time of ``iters`` calls), in ms."""
    return statistics.median(time_samples(fn, device, group, warmup, iters, repeats))


def time_samples(fn: Callable[[], None], device, group, warmup: int, iters: int, repeats: int,
                 warm_ms: float = 0.0) -> List[float]:
    """Each repeat's max over ranks of the mean time of ``iters`` calls, in ms (:func:`time_fn`'s
    samples: a spread between them tells a passing stall from a steady state). ``warmup`` calls
    first, then untimed repeats until they add up to ``warm_ms`` ([Note: warm device])."""
    for _ in range(warmup):
        fn()
    _sync(device)
    spent, n = 0.0, 0
    while spent < warm_ms and n < MAX_WARM_REPEATS:  # every rank adds the same (max over ranks) times
        spent += _sample(fn, device, group, iters) * iters
        n += 1
    return [_sample(fn, device, group, iters) for _ in range(repeats)]


def _sample(fn: Callable[[], None], device, group, iters: int) -> float:
    """The max over ranks of the mean time of ``iters`` calls of ``fn``, in ms."""
    dist.barrier(group=group)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / iters
    t = torch.tensor([ms], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def measure_peak_tflops(device: torch.device) -> Optional[float]:
    """This GPU's bf16 GEMM rate, TFLOP/s: an 8192^3 product, mean of 10 after 3 warm-ups; None on CPU."""
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    rate = 2 * n ** 3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12
    t = torch.tensor([rate], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    del a, b
    return float(t.item())


def peak_bytes_of_one_call(fn: Callable[[], None], device) -> int:
    """Peak CUDA memory allocated by one call of ``fn`` (after warm-up), above what was allocated
    before it: one call, so blocks of the previous iteration still held for other streams do not
    count."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def host_ms_per_call(fn: Callable[[], None], device, calls: int = 10) -> float:
    """Host time of one call of ``fn`` (ms, mean of ``calls`` back to back from an idle GPU): the
    time until the last call returns, before waiting for the GPU. A pass whose host time is
    below its GPU time lets the host run ahead (launches, Python and the agreement hidden); one
    whose host time reaches its GPU time is host-bound (or waits for the GPU inside)."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(device)
    return elapsed / calls


def _candidate_predictions(plan) -> Dict[object, tuple]:
    """K (batch tiles) or ``"rank"`` / ``"rank_ce"`` (rank chunks over NCCL / the copy engine, on
    all rows: K=1, as the rank modes pin them) -> (predicted ms, predicted peak bytes) of the plain
    candidates (no regather, no buckets) of a planner's plan; empty when the plan has no
    candidates."""
    out = {}
    for c in getattr(plan, "candidates", ()) or ():
        if not getattr(c, "regather", False) and not getattr(c, "buckets_fwd", ()) \
                and not getattr(c, "buckets_bwd", ()):
            key = c.num_tiles
            if getattr(c, "decomposition", "batch") == "rank":
                if c.num_tiles > 1:
                    continue
                key = "rank_ce" if c.transport == "copy_engine" else "rank"
            out[key] = (c.predicted_ms, getattr(c, "peak_bytes", None))
    return out


class Progress:
    """A progress bar of a run on stderr: one step per pass of a shape, the mode being timed as
    its text. Drawn by tqdm where it is installed (an optional dependency: without it, nothing is
    shown), only where ``enabled`` (the CLI: global rank 0), and only once the run has taken
    ``delay_s`` (a short run prints just its table)."""

    def __init__(self, total: int, enabled: bool = True, delay_s: float = 3.0, unit: str = "pass"):
        self._bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, unit=unit, file=sys.stderr, delay=delay_s, leave=False,
                         dynamic_ncols=True, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")

    def mode(self, text: str) -> None:
        """Shows what runs now."""
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=False)

    def advance(self, n: int = 1) -> None:
        """``n`` units done (passes of a shape; steps of the whole-model benchmark)."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclass(frozen=True)
class Profile:
    """What :func:`run_modes` profiles for each timed mode: ``calls`` calls back to back (after
    the timed loop, so a larger count shows the steady state) into ``folder``, on global rank 0 or,
    with ``all_ranks``, on every rank (the ranks' skew shows in their signal waits)."""
    folder: str
    calls: int = 3
    all_ranks: bool = False


def verification_info(plan) -> Optional[List[dict]]:
    """A plan's first-call verification as JSON (``plan.verification``, see
    :func:`~overlap_layers.planning.plan_cache.verification_record`): per contender its label, the
    time the decision compared, this rank's trials and each trial's slowest rank; None if it was
    not verified."""
    record = getattr(plan, "verification", ()) if plan is not None else ()
    if not record:
        return None
    return [dict(plan=label, ms=ms, trials=[dict(device_ms=d, host_ms=h) for d, h in trials],
                 slowest=[dict(rank=rank, ms=t) for rank, t in slowest])
            for label, ms, trials, slowest in record]


def profile_calls(fn: Callable[[], None], device, path: str, calls: int = 3, all_ranks: bool = False) -> None:
    """Runs ``calls`` calls of ``fn`` on every rank, under ``torch.profiler`` on global rank 0
    (or, with ``all_ranks``, on every rank, rank r > 0 writing ``path_rank{r}``), which writes
    ``path.json`` (a Chrome trace: kernels, streams, the executor's
    ``overlap::<program>::<op>[tile]`` ranges, one ``bench::call`` range per call) and
    ``path.txt`` (the ops by device time)."""
    rank = dist.get_rank()
    on = rank == 0 or all_ranks
    if rank:
        path = f"{path}_rank{rank}"
    acts = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with (torch.profiler.profile(activities=acts) if on else contextlib.nullcontext()) as prof:
        for _ in range(calls):
            with torch.profiler.record_function("bench::call"):
                fn()
        _sync(device)
    if on:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        prof.export_chrome_trace(path + ".json")
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        with open(path + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=30))


def graph_replay(fn: Callable[[], None], device, warmup: int = 3) -> Callable[[], None]:
    """``fn`` captured into a CUDA graph (after ``warmup`` eager calls on a side stream, as
    capture requires); returns the graph's replay. Every rank captures at once (the layers'
    collectives are captured too)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run_modes(b, fields: dict, modes, passes, naive_k, warmup, iters, repeats,
              progress: Optional[Progress] = None, profile: Optional[Profile] = None,
              warm_ms: float = 0.0, peak: Optional[float] = None) -> List[dict]:
    """Time every mode of bench ``b`` for each pass; one record per (pass, mode), the shape's
    ``fields`` first (the record format of :func:`overlap_layers.bench.mlp.bench_shape`): ``ms``
    the median of the repeats, ``spread`` their fastest, slowest and count, ``repeat_ms`` each.
    A mode the layer or device lacks (``rank`` / ``rank_ce`` without the rank-chunk plan,
    ``rank_ce`` off CUDA, ``asynctp`` without a counterpart) has no record; one that fails
    (``asynctp``) has ``ms`` None and ``error``. ``progress``: shows each mode and advances
    per pass. ``profile``: each timed mode is then also profiled (:func:`profile_calls`).
    ``warm_ms``: untimed repeats before each mode's timed ones ([Note: warm device]). With
    ``fields["cuda_graphs"]`` every mode is timed as :func:`graph_replay` (peak memory from an
    eager call of the same plan); with ``fields["graph_calls"]`` (the layers replay their own
    calls) the ``reference`` mode is. ``peak``: the GEMM rate the records' efficiency divides by."""
    graphs = bool(fields.get("cuda_graphs")) and b.device.type == "cuda"
    device, group = b.device, b.group
    records = []
    # auto first: its plan carries the predicted time of every K, attached to the fixed-K rows.
    runs = [m for m in modes if m == "auto"] + [m for m in modes if m not in ("auto", "naive")]
    runs += [f"naive{k}" for k in naive_k] if "naive" in modes else []
    label = f"{fields['layer']} {fields['preset']} TP{b.ws} B{fields['batch']} {fields['tokens']} tokens"
    for pass_ in passes:
        backward = pass_ == "fwdbwd"
        times: Dict[str, Optional[float]] = {}
        extra: Dict[str, dict] = {}
        predicted: Dict[int, tuple] = {}
        for mode in runs:
            if progress is not None:
                progress.mode(f"{label} {pass_} {mode}")
            layer_mode = mode in ("serial", "auto", "rank", "rank_ce") or mode.startswith("naive")
            if mode == "rank_ce" and device.type != "cuda":
                continue  # the copy engine needs CUDA: off it, rank_ce would rerun rank over the same backend
            with full_collections() as setup_gc:  # the layer's planning and verification run here
                fn = _mode_fn(b, mode, layer_mode, backward, extra)
            if fn is None:
                if mode in extra:  # it failed: recorded with its error
                    times[mode] = None
                continue  # no such mode for this layer or device: no record
            eager = fn
            try:
                # the layers replay their own calls with graph_calls: the reference gets graphs too
                if graphs or (mode == "reference" and fields.get("graph_calls") and device.type == "cuda"):
                    fn = graph_replay(eager, device)
                with full_collections() as timed_gc:
                    samples = time_samples(fn, device, group, warmup, iters, repeats, warm_ms)
                times[mode] = statistics.median(samples)
            except Exception as e:  # noqa: BLE001
                if mode not in ("asynctp", "reference"):
                    raise
                times[mode] = None
                extra[mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            info = extra.setdefault(mode, {})
            info["repeat_ms"] = samples
            info["spread"] = dict(min_ms=min(samples), max_ms=max(samples), n=len(samples))
            info["gc_full_ms"] = gathered_collections(setup_gc, timed_gc, group)
            if profile:
                name = f"{fields['layer']}_{fields['preset']}_ws{b.ws}_b{fields['batch']}_t{fields['tokens']}" \
                       f"{'_skew' if fields.get('skewed') else ''}_{pass_}_{mode}"
                profile_calls(fn, device, os.path.join(profile.folder, name), profile.calls, profile.all_ranks)
            if device.type == "cuda":
                info["peak_bytes"] = peak_bytes_of_one_call(eager, device)
                info["host_ms"] = host_ms_per_call(fn, device)
            if layer_mode:
                _plan_info(b, mode, info, predicted, backward)
        records += _pass_records(b, fields, pass_, times, extra, warm_ms, peak)
        if progress is not None:
            progress.advance()
    return records


def _mode_fn(b, mode: str, layer_mode: bool, backward: bool, extra: Dict[str, dict]) -> Optional[Callable]:
    """The callable that runs ``mode`` of bench ``b`` (None: no such mode here, or it failed, its
    error in ``extra[mode]``)."""
    if mode in ("rank", "rank_ce"):
        if not getattr(b, "has_rank_chunks", False):
            return None  # a layer (or shape) without the rank-chunk plan: no record
        return b.rank_fn("copy_engine" if mode == "rank_ce" else "nccl", backward)
    if layer_mode:
        return b.layer_fn(1 if mode == "serial" else "auto" if mode == "auto" else int(mode[5:]), backward)
    if mode == "reference":
        return b.reference_fn(backward)
    if mode == "compute":
        return b.compute_fn(backward)
    if mode == "comm":
        return b.comm_fn(backward)
    try:
        return b.asynctp_fn(backward)
    except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
        extra[mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
        return None


def _plan_info(b, mode: str, info: dict, predicted: Dict[int, tuple], backward: bool) -> None:
    """A layer mode's plan fields in its record ``info``: the plan, graph and workspace memory,
    and the predictions (``auto``'s candidates, kept in ``predicted`` for the fixed-K modes)."""
    device = b.device
    plan = getattr(b.layer, "plan", None)  # None for a composite (the block): no candidates
    info.update(b.plan_info())
    graphs_held = [m.planner.call_graphs for m in b.layer.modules()
                   if isinstance(m, TiledLayer) and m.planner.call_graphs is not None]
    if graphs_held:  # config.graph_calls: the memory the replayed graphs keep, outside the peak
        info["graph_bytes"] = sum(g.last_nbytes for g in graphs_held)
    if info.get("transport") in ("copy_engine", "mixed") and device.type == "cuda":
        # persistent symmetric memory (the group's layers share it), outside the allocator's peak
        info["workspace_bytes"] = held_workspace_bytes(b.group, device)
    held = held_workspace_bytes(b.group, device, "device_counts")
    if held:  # the MoE's device path: a workspace of its own, held once it ran (its race lost or not)
        info["workspace_bytes"] = info.get("workspace_bytes", 0) + held
    if plan is None:
        return
    if mode == "auto":
        info["predicted_ms"] = getattr(plan, "predicted_ms", None)
        info["predicted_peak_bytes"] = getattr(plan, "predicted_peak_bytes", None)
        info["reason"] = getattr(plan, "reason", "")
        info["verification"] = verification_info(plan)
        predicted.update(_candidate_predictions(plan))
        info["candidates"] = [dict(k=c.num_tiles, regather=getattr(c, "regather", False),
                                   decomposition=c.decomposition, transport=c.transport,
                                   ms=c.predicted_ms, peak=getattr(c, "peak_bytes", None))
                              for c in getattr(plan, "candidates", ()) or ()]
        info.update(b.host_overhead_us(backward))
        info["planning_ms"] = b.planning_ms
    elif mode in predicted:
        info["predicted_ms"], info["predicted_peak_bytes"] = predicted[mode]
    elif info["k"] in predicted and info["decomposition"] == "batch":
        info["predicted_ms"], info["predicted_peak_bytes"] = predicted[info["k"]]


def _pass_records(b, fields: dict, pass_: str, times: Dict[str, Optional[float]], extra: Dict[str, dict],
                  warm_ms: float, peak: Optional[float]) -> List[dict]:
    """One pass's records, one per timed mode, with the limit and the ratios to it, to serial and
    to the plain reference, and each mode's achieved rate: the pass's FLOPs per rank
    (``b.flops``) over its time, and that over the GEMM ``peak`` (TFLOP/s, measured in the same
    run; None off CUDA)."""
    limit = max(times["compute"], times["comm"]) \
        if times.get("compute") is not None and times.get("comm") is not None else None
    flops = b.flops(pass_ == "fwdbwd")
    records = []
    for mode, ms in times.items():
        tflops = flops / ms / 1e9 if ms and mode != "comm" else None
        rec = dict(fields, world_size=b.ws, dtype=str(b.dtype).replace("torch.", ""), mode=mode, ms=ms,
                   warm_ms=warm_ms, limit_ms=limit, ratio_limit=(ms / limit) if ms and limit else None,
                   ratio_serial=(ms / times["serial"]) if ms and times.get("serial") else None,
                   ratio_reference=(ms / times["reference"]) if ms and times.get("reference") else None,
                   flops=flops, tflops=tflops, efficiency=tflops / peak if tflops and peak else None,
                   predicted_ms=None)
        if mode.startswith("naive"):
            rec["mode"] = "naive"
        rec["pass"] = pass_
        rec.update(extra.get(mode, {}))
        rec.setdefault("spread", dict(min_ms=None, max_ms=None, n=0))
        records.append(rec)
    return records


