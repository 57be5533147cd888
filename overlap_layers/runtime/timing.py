"""Timing one region of device work without stalling the host.

Reference: :meth:`Stopwatch.elapsed_ms` equals the time between :meth:`start` and :meth:`stop`
as the device sees it: on CUDA two timing events recorded on the current stream (so the region
is what the stream ran, not what the host launched), on CPU the host clock (the CPU path's
collectives block the host, so host time is device time). Reading the result synchronises only
with the stop event, and only when it is read.

With ``prequeue_ms`` (CUDA), :meth:`start` first puts a sleep kernel of that length on the
stream, so the host queues the region while the device waits: the region then runs as it would
replayed from a CUDA graph, without the gaps of a host that launches slower than the device
runs (the sleep itself is outside the region). ``align`` (a callable, :func:`rank_barrier`) then
makes the stream wait until every rank's stream has come that far, so that a region with
collectives starts at the same moment on every rank's device ([Note: aligned trials]).

:func:`total_ms` is what the regions cost a steady eager loop: the larger of their device time and
the host's wall time from :meth:`start` to :meth:`stop` (a host that launches slower than the
device runs sets the pace of back-to-back calls; the device time alone, measured while a previous
call's work is still queued, would hide that). With ``prequeue_ms`` it is the device time: the
region is timed as a replay runs, and the host's time is the sleep's.

[Note: aligned trials]
Each rank's sleep starts when its own host gets there, so a prequeued region starts on each
device at its host's time plus the sleep; a rank whose host came later starts later, and its
peers' regions wait for it at their first collective or signal, which their time then counts:
the lateness of a host, not the plan. So the layers' trials end their prequeue with a barrier of
the group's devices (a one-element all-reduce on the current stream), after the sleep and before
the start mark: every region starts when the last rank's does. A region that waited 40 ms for a
late host reads under 5 ms with it (``tests/cuda_worker.py``, ``check_aligned_trials``), and
every contender's best trial reads a few percent lower (measured: see docs/measurements.md,
Planner). A slow trial from work inside the trial window itself (a Triton compile or module load:
[Note: one heads launch] in ``kernels/heads.py``) is not a late start, and alignment does not
remove it ([Note: first-call verification] in ``planning/plan_cache.py``).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


_SLEEP_CYCLES_PER_MS = 2_000_000  # 2 GHz, at or above the SM clock of current GPUs: sleeps at least as asked


class Stopwatch:
    def __init__(self, device: torch.device, prequeue_ms: float = 0.0,
                 align: Optional[Callable[[], None]] = None) -> None:
        self.device, self._cuda = device, device.type == "cuda"
        self.prequeue_ms = prequeue_ms
        self.align = align  # run after the prequeue's sleep (CUDA): [Note: aligned trials]
        self._start = self._stop = None
        self._host_start = self._host_stop = 0.0  # the host clock at start and stop

    def start(self) -> None:
        if self._cuda and self.prequeue_ms > 0:
            torch.cuda._sleep(int(self.prequeue_ms * _SLEEP_CYCLES_PER_MS))
            if self.align is not None:
                self.align()
        self._host_start = time.perf_counter()
        self._start = self._mark()

    def stop(self) -> None:
        if self._start is not None:
            self._stop = self._mark()
            self._host_stop = time.perf_counter()

    def _mark(self):
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def sibling(self) -> "Stopwatch":
        """A new stopwatch on the same device with the same prequeue and alignment (a trial's
        backward pass, timed as its forward)."""
        return Stopwatch(self.device, self.prequeue_ms, self.align)

    @property
    def done(self) -> bool:
        return self._stop is not None

    def elapsed_ms(self) -> float:
        """The region's time, or ``inf`` if it never stopped (the region raised)."""
        if self._stop is None:
            return math.inf
        if self._cuda:
            self._stop.synchronize()
            return float(self._start.elapsed_time(self._stop))
        return (self._stop - self._start) * 1e3

    def host_ms(self) -> float:
        """The host's wall time from start to stop (``inf`` if it never stopped)."""
        return (self._host_stop - self._host_start) * 1e3 if self._stop is not None else math.inf


def rank_barrier(group) -> Optional[Callable[[], None]]:
    """A callable that makes the current CUDA stream wait until every rank of ``group`` has
    called it (a one-element all-reduce), or None where there is nothing to align: a group of
    one, or one without NCCL (CPU and gloo time on the host, where the collectives block).
    Every rank must call it at the same point ([Note: aligned trials]: the layers' trials,
    which every rank takes at the same calls)."""
    if dist.get_world_size(group) == 1 or "nccl" not in str(dist.get_backend(group)):
        return None

    def align() -> None:
        dist.all_reduce(torch.ones(1, device=torch.cuda.current_device()), group=group)
    return align


def total_ms(*watches: Optional[Stopwatch]) -> float:
    """What the passes cost a steady loop (``inf`` if any is missing or unfinished): their device
    times summed, or with no prequeue the larger of that and their host times summed (see the
    module docstring)."""
    if any(w is None for w in watches):
        return math.inf
    device = sum(w.elapsed_ms() for w in watches)
    if any(w.prequeue_ms > 0 for w in watches):
        return device
    return max(device, sum(w.host_ms() for w in watches))


class EventClock:
    """The MoE device path's race's clock ([Note: MoE graph calls: the race] in
    ``layers/moe/device_path.py``): :meth:`start` and :meth:`stop` record events on the current stream
    (no wait), :meth:`read` the milliseconds between them (waits for the second)."""

    @staticmethod
    def start() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def stop(start: torch.cuda.Event) -> tuple:
        return start, EventClock.start()

    @staticmethod
    def read(span: tuple) -> float:
        span[1].synchronize()
        return span[0].elapsed_time(span[1])


PREQUEUE_CYCLES = 2_000_000  # a sleep of about 1 ms (at 2 GHz or less): longer than queuing one sample
IN_A_ROW = 4  # the same on every rank: the op may be a collective (calibration's ops)


def device_ms(fn, reps: int = 5, warmup: int = 2) -> float:
    """Median over ``reps`` samples of ``fn``'s device time (ms, CUDA); a sample is
    :data:`IN_A_ROW` calls in a row queued behind a sleep kernel, its time divided by the calls
    (calibration's measurements: ``planning/calibrate.py``)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(PREQUEUE_CYCLES)
        a.record()
        for _ in range(IN_A_ROW):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / IN_A_ROW)
    return statistics.median(samples)


def beside_ms(fn: Callable[[], object], side: Callable[[], list], device, samples: int = 5) -> list:
    """``samples`` device times (ms, CUDA) of ``fn`` on the current stream while ``side()`` runs
    from a side stream, launched first: from an event before ``side()``'s launch to one after
    ``fn``'s work (``fn``'s own time, not ``side``'s tail); then every work ``side()`` returned
    is waited for and the device synchronized (calibration's GEMM slowdown beside collectives)."""
    stream = torch.cuda.Stream(device=device)
    out = []
    for _ in range(samples):
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream())
        start.record()
        with torch.cuda.stream(stream):
            works = side()
        fn()
        done.record()
        for w in works:
            w.wait()
        torch.cuda.synchronize(device)
        out.append(start.elapsed_time(done))
    return out


def stamp(device: torch.device, stream=None):
    """A point in time on ``device``: on CUDA a timing event recorded on ``stream`` (None: the
    device's current stream), so it is when that stream reaches this point; elsewhere the host
    clock. :func:`stamps_ms` reads the time between two."""
    if device.type != "cuda":
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream if stream is not None else torch.cuda.current_stream(device))
    return ev


def stamps_ms(a, b) -> float:
    """Milliseconds from :func:`stamp` ``a`` to ``b`` (CUDA: both recorded; synchronize first)."""
    if isinstance(a, float):
        return (b - a) * 1e3
    return a.elapsed_time(b)
