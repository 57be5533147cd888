"""The CUDA streams and events of the layers' calls: the tiles' compute streams (:class:`StreamPool`),
an exchange's pull and push streams ordered by events (:class:`PartStreams`), events a captured
graph records (:func:`peak_event`) and small host reads behind an event (:class:`HostReader`).

Tiles' streams: created lazily per layer, reused across calls.

``torch.cuda.Stream()`` draws from c10's per-device stream pool, so streams are cheap; each layer
keeps the ones it drew so tile t always runs on the same stream (forward and backward), which
keeps saved tensors on the stream that allocated them.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import torch


class StreamPool:
    def __init__(self) -> None:
        self._streams: Dict[int, List["torch.cuda.Stream"]] = {}

    def get(self, device: torch.device, count: int) -> Optional[List["torch.cuda.Stream"]]:
        """``count`` compute streams on ``device``; None on a non-CUDA device."""
        if device.type != "cuda":
            return None
        idx = device.index if device.index is not None else torch.cuda.current_device()
        have = self._streams.setdefault(idx, [])
        while len(have) < count:
            have.append(torch.cuda.Stream(device=idx))
        return have[:count]


class PartStreams:
    """An exchange's pull and push streams (its ``streams``: index 0 pulls, 1 pushes) beside the
    caller's (``main``; none off CUDA) and the events by which they order a pass's parts (the MoE
    device path's: [Note: MoE graph calls] in ``layers/moe/device.py``): per peer part index, its
    rows pulled (``arrived``), its slot read (``read``), its results pushed (``pushed``). The
    main stream takes part ``i``'s rows after the push of part ``i - held`` (whose results' memory
    it may take). Off CUDA every method does nothing but run its work."""

    def __init__(self, exchange, cuda: bool, held: int) -> None:
        self.streams = getattr(exchange, "streams", None) if cuda else None
        self.main = torch.cuda.current_stream() if self.streams else None
        self.held = held
        self.arrived, self.read, self.pushed = {}, {}, {}

    @property
    def push_stream(self):
        """The push stream, or None off CUDA."""
        return self.streams[1] if self.streams else None

    def on(self, index: int):
        return torch.cuda.stream(self.streams[index]) if self.streams else contextlib.nullcontext()

    def mark(self, events: dict, i: int) -> None:
        """An event on the current stream."""
        if self.streams:
            events[i] = torch.cuda.Event()
            events[i].record()

    def fork(self) -> None:
        if self.streams:
            self.streams[0].wait_stream(self.main)

    def before_part(self, i: int) -> None:
        """The main stream waits for part i's rows and for the push whose results' memory it may take."""
        if self.streams:
            self.main.wait_event(self.arrived[i])
            if i >= self.held:
                self.main.wait_event(self.pushed[i - self.held])

    def pull_after_read(self, i: int) -> None:
        """The pull stream waits until slot ``i``'s last rows were read (its ``read`` event)."""
        if self.streams:
            self.streams[0].wait_event(self.read[i])

    def push_after_main(self) -> None:
        """The push stream waits for what the main stream launched so far."""
        if self.streams:
            self.streams[1].wait_stream(self.main)

    def main_after(self, events: dict, i: int) -> None:
        """The main stream waits for ``events[i]``."""
        if self.streams:
            self.main.wait_event(events[i])

    def push(self, exchange, source: int, results: torch.Tensor, part, i: int) -> None:
        """The part's region pushed on the push stream, after what the main stream launched."""
        self.push_after_main()
        with self.on(1):
            exchange.push(source, results, part)
            self.mark(self.pushed, i)

    def join(self) -> None:
        if self.streams:
            self.main.wait_stream(self.streams[0])
            self.main.wait_stream(self.streams[1])


def peak_event() -> Optional[torch.cuda.Event]:
    """[Note: MoE slot rows] (``layers/moe/device_path.py``): an event that a captured graph records at
    each replay (``external``), so that the host can wait for the graph's first part only; None
    where torch makes no such events (the caller then waits for the whole call)."""
    try:
        return torch.cuda.Event(external=True)
    except TypeError:
        return None


class HostReader:
    """Reads small tensors on the host ([Note: MoE host syncs] in ``layers/moe/eager.py``):
    :meth:`start` launches the copy and returns a function that waits for it and gives the flat
    list. On CUDA the copy goes into a pinned buffer kept per size and reused call after call (each
    call reads its buffer before the next call's copy is launched), followed by an event on the
    current stream: the host waits for that event only, not for the work launched after the copy."""

    def __init__(self) -> None:
        self._buffers = {}

    def start(self, t: torch.Tensor) -> Callable[[], List[int]]:
        if t.device.type != "cuda":
            return t.reshape(-1).tolist
        key = (t.numel(), t.dtype)
        host = self._buffers.get(key)
        if host is None:
            if len(self._buffers) >= 8:  # a few sizes (tile counts) at a time
                self._buffers.clear()
            host = self._buffers[key] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        host.copy_(t.reshape(-1), non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def read() -> List[int]:
            done.synchronize()
            return host.tolist()
        return read
