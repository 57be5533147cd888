"""A measured timeline of a real execution, in the simulator's format, so that
predicted and measured timelines compare op by op.

Reference: ``OpRecorder(device).timeline()`` after ``execute(..., recorder=rec)`` is a
:class:`~overlap_layers.sim.Timeline` like :func:`~overlap_layers.sim.simulate` returns for the
same schedule: the same rows (``compute{i}``, ``comm``), one event per non-deferred launch with
the same ``(name, tile, stream)``, so ``to_chrome_trace()`` and
:func:`overlap_layers.plot.plot_timeline` treat predicted and measured runs alike.
"""
from __future__ import annotations

import json
from typing import List, Mapping, Optional, Union

import torch

from ..runtime.timing import stamp, stamps_ms
from ..sim.simulator import Event, Timeline, TileTag, chrome_trace, timeline_from_events


class OpRecorder:
    """Records when each op of an execution ran on ``device``; :meth:`timeline` returns it.

    Contract (what :func:`~overlap_layers.runtime.executor.execute` does with a recorder):

    * ``token = begin(name, tile, stream_name, stream)``: op ``name`` of ``tile`` (an int, or the
      tuple of members for a bucket of several tiles) starts here, on the row ``stream_name``
      (``"compute{i}"`` for compute stream i, ``"compute0"`` on CPU, ``"comm"`` for
      collectives). On CUDA a timing event is recorded on ``stream`` (``None``: the device's
      current stream), so the time is when that stream reaches this point, not when the host
      got here; on CPU the host clock (``time.perf_counter``) is read.
    * ``end(token, stream)``: the op ends here (same clocks). ``stream`` may differ from the
      one it began on: a collective begins where it is issued and ends on the stream of its
      first wait. Every token must end exactly once before :meth:`timeline`.
    * ``mark(name, tile, stream_name, stream)``: a zero-length op (a ``wait``), as the
      simulator records waits.

    What the measured intervals mean:

    * a compute op: on CUDA, from when its stream reaches it to when its last kernel ends; on
      CPU, the host time of its callable (the CPU path computes on the host).
    * a collective (or bucket): from its issue to the moment the first wait on its result has
      returned (CUDA: when the waiting stream passed the wait, including the unpacking of a
      bucket's member). That is an upper bound of the network time: a collective that finished
      while the waiting tile was still computing shows as running until the wait. The part of it
      not under any compute row, ``exposed_comm_ms``, is the communication the run really
      waited for. Collectives may overlap on the ``comm`` row (several are in flight at once);
      the row's busy time is the length of their union.
    * a wait: zero length, at the instant the wait returned.

    ``timeline()`` synchronizes the device (CUDA), then returns the events relative to the first
    start (the one reference event recorded at construction only anchors the clock), with
    ``makespan_ms``, ``stream_busy_ms`` and ``exposed_comm_ms`` defined as for the simulator
    (:func:`~overlap_layers.sim.simulator.timeline_from_events`). ``peak_bytes`` is 0: the
    simulator's peak counts the program's buffers plus the cost model's ``base_bytes``, and a
    device-wide ``max_memory_allocated`` would need ``reset_peak_memory_stats`` (a process-wide
    side effect) and still count other allocations; measure memory around the call instead.

    A recorder may be passed to several :func:`execute` calls (forward then backward): their ops
    land on one timeline. Recording adds one event (CUDA) or one clock read (CPU) per op boundary.
    """

    def __init__(self, device: Union[str, torch.device]) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._ops: List[list] = []  # [name, tile, stream_name, start, end or None]
        self._ref = self._stamp(None)

    def _stamp(self, stream):
        return stamp(self.device, stream)

    def begin(self, name: str, tile: TileTag, stream_name: str, stream=None) -> int:
        self._ops.append([name, tile, stream_name, self._stamp(stream), None])
        return len(self._ops) - 1

    def end(self, token: int, stream=None) -> None:
        op = self._ops[token]
        assert op[4] is None, f"{op[0]}[{op[1]}] ended twice"
        op[4] = self._stamp(stream)

    def mark(self, name: str, tile: TileTag, stream_name: str, stream=None) -> None:
        stamp = self._stamp(stream)
        self._ops.append([name, tile, stream_name, stamp, stamp])

    def timeline(self) -> Timeline:
        """The recorded ops as a :class:`~overlap_layers.sim.Timeline` (see the class docstring)."""
        still_open = [f"{op[0]}[{op[1]}]" for op in self._ops if op[4] is None]
        if still_open:
            raise ValueError(f"OpRecorder.timeline(): ops {still_open} began but never ended; "
                             f"call end(token) for each before asking for the timeline")
        if self._cuda:
            torch.cuda.synchronize(self.device)
        ms = [(self._ms(op[3]), self._ms(op[4])) for op in self._ops]
        t0 = min((a for a, _ in ms), default=0.0)
        return timeline_from_events([Event(op[0], op[1], op[2], a - t0, b - t0)
                                     for op, (a, b) in zip(self._ops, ms)])

    def _ms(self, at) -> float:
        return stamps_ms(self._ref, at)

    def __len__(self) -> int:
        return len(self._ops)


def write_chrome_trace(path, timelines: Mapping[str, Timeline]) -> None:
    """Write ``timelines`` (e.g. forward and backward) as one Chrome/Perfetto trace JSON file."""
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines), f)


class TraceJob:
    """One layer call recorded for ``layer.export_trace(path, measured=True)``: the forward's ops in
    ``fwd``, the backward's in ``bwd`` once it runs; :meth:`write` (re)writes ``path`` (or each of
    several paths: a fused block's call answers both of its sublayers' requests)."""

    def __init__(self, path, device) -> None:
        self.paths = tuple(path) if isinstance(path, (list, tuple)) else (path,)
        self.device = device
        self.fwd = OpRecorder(device)
        self.bwd: Optional[OpRecorder] = None

    def start_backward(self) -> OpRecorder:
        self.bwd = OpRecorder(self.device)
        return self.bwd

    def write(self) -> None:
        timelines = {"forward": self.fwd.timeline()}
        if self.bwd is not None:
            timelines["backward"] = self.bwd.timeline()
        for path in self.paths:
            write_chrome_trace(path, timelines)
