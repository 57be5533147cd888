"""Timing one region of device work without stalling the host.

Reference: :meth:`Stopwatch.elapsed_ms` equals the time between :meth:`start` and :meth:`stop`
as the device sees it: on CUDA two timing events recorded on the current stream (so the region
is what the stream ran, not what the host launched), on CPU the host clock (the CPU path's
collectives block the host, so host time is device time). Reading the result synchronises only
with the stop event, and only when it is read.

With ``prequeue_ms`` (CUDA), :meth:`start` first puts a sleep kernel of that length on the
stream, so the host queues the region while the device waits: the region then runs as it would
replayed from a CUDA graph, without the gaps of a host that launches slower than the device
runs (the sleep itself is outside the region). Without it (CUDA), :meth:`start` first waits for
the device to finish its queued work, so the region starts on an idle device and its time
includes those gaps: what an eager call costs where the host is slower than the device. Left
queued, a previous call's work would hide them: the start event would run only when the device
reached it, by which time the host had launched much of the region (first-call verification
alternates contenders, so a host-bound plan timed after a device-bound one looked fast).
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch


_SLEEP_CYCLES_PER_MS = 2_000_000  # 2 GHz, at or above the SM clock of current GPUs: sleeps at least as asked


class Stopwatch:
    def __init__(self, device: torch.device, prequeue_ms: float = 0.0) -> None:
        self._cuda = device.type == "cuda"
        self.prequeue_ms = prequeue_ms
        self._start = self._stop = None

    def start(self) -> None:
        if self._cuda and self.prequeue_ms > 0:
            torch.cuda._sleep(int(self.prequeue_ms * _SLEEP_CYCLES_PER_MS))
        elif self._cuda:
            torch.cuda.synchronize()
        self._start = self._mark()

    def stop(self) -> None:
        if self._start is not None:
            self._stop = self._mark()

    def _mark(self):
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

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


def total_ms(*watches: Optional[Stopwatch]) -> float:
    """Sum of the stopwatches' times (``inf`` if any is missing or unfinished)."""
    if any(w is None for w in watches):
        return math.inf
    return sum(w.elapsed_ms() for w in watches)
