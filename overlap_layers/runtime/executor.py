"""Run a :class:`~overlap_layers.schedule.Schedule` on real tensors.

One code path for CUDA and CPU (docs/architecture.md, Executor and streams):

* compute of tile t runs on compute stream ``t mod S`` (CUDA) or on the calling thread (CPU);
* collectives are started from the tile's stream (c10d then orders them after that stream's
  work) and return a :class:`~overlap_layers.runtime.collectives.Handle`;
* a wait makes the tile's stream wait for the collective (CUDA) or blocks the host (gloo);
* a bucket is issued from its last member's stream, after an event recorded on each other
  member's stream at the point where that member reached its comm op;
* ops sharing a ``chain`` (accumulators) are ordered across streams with events;
* the streams start after, and the caller's stream continues after, all tile work (fork/join),
  so tensors owned by the caller's stream are safe to free once the call returns;
* with a :class:`~overlap_layers.planning.trace.OpRecorder`, every launch is also timed on the
  simulator's rows: compute ops and waits on ``compute{t mod S}``, each collective (or bucket)
  on ``comm`` from its issue to its first wait.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Protocol, Sequence

import torch

from ..schedule import Schedule
from . import collectives


class Recorder(Protocol):
    """What :func:`execute` calls on a recorder (:class:`~overlap_layers.planning.trace.OpRecorder`,
    whose docstring gives the contract)."""

    def begin(self, name: str, tile, stream_name: str, stream=None) -> int: ...

    def end(self, token: int, stream=None) -> None: ...

    def mark(self, name: str, tile, stream_name: str, stream=None) -> None: ...


def profiler_range(name: str):
    """The profiler range ``name`` while a profiler runs, else nothing (a range costs a few
    microseconds of host time even when nobody records it; :func:`execute` asks once per call and
    names its ops' ranges only while profiling)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


# one launch loop: the op kinds share its state (events, handles, chains), and a call per op would cost host time
def execute(schedule: Schedule, envs: Sequence[dict], group, *,
            streams: Optional[List["torch.cuda.Stream"]] = None, label: Optional[str] = None,
            trace: Optional[list] = None, recorder: Optional[Recorder] = None) -> None:
    """Launch every op of ``schedule`` over the per-tile environments ``envs``.

    ``trace``, when given, receives ``(tile, op_name, kind)`` in launch order (deferred bucket
    members excluded) so tests can check the order the runtime really used. ``recorder``, when
    given, records when each op ran; ``recorder.timeline()`` then has the events that
    ``simulate(schedule, ...)`` predicts, measured (see
    :class:`~overlap_layers.planning.trace.OpRecorder` for what they mean).
    """
    program = schedule.program
    label = label or program.name
    assert len(envs) == schedule.num_tiles
    main = torch.cuda.current_stream() if streams else None
    if streams:
        for s in streams:
            s.wait_stream(main)
    # [Note: executor streams]: each op runs on its tile's stream, made current only when it
    # differs from the last op's, and the caller's stream is made current again at the end. A
    # stream context per op costs about 20 us of host time on a slow host (it reads the current
    # stream and sets it twice), about 1 ms per call of a K=8 MLP forward. An op's function
    # may switch streams itself only inside a context that restores them.
    profiling = torch.autograd._profiler_enabled()
    current = main
    handles: Dict[tuple, tuple] = {}
    ready_events: Dict[tuple, object] = {}
    chain_last: Dict[str, tuple] = {}
    comm_open: Dict[tuple, tuple] = {}  # (handle, member) -> (recorder token, members) until waited

    def stream_of(t: int):
        return streams[t % len(streams)] if streams else None

    def row_of(t: int) -> str:  # the simulator's name of tile t's stream
        return f"compute{t % len(streams)}" if streams else "compute0"

    try:
        for ln in schedule.launches:
            op, t = program.ops[ln.op], ln.tile
            stream = stream_of(t)
            if op.kind == "comm" and ln.bucket == ():
                if stream is not None:  # this member's input is ready here
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    ready_events[(op.handle, t)] = (stream, ev)
                continue
            members = ln.bucket if op.kind == "comm" else (t,)
            if stream is not None and stream is not current:
                torch.cuda.set_stream(stream)
                current = stream
            name = f"overlap::{label}::{op.name}[{','.join(map(str, members))}]" if profiling else ""
            with torch.profiler.record_function(name) if profiling else contextlib.nullcontext():
                if op.kind == "compute":
                    if stream is not None and op.chain in chain_last:
                        prev_stream, ev = chain_last[op.chain]
                        if prev_stream is not stream:
                            stream.wait_event(ev)
                    tok = recorder.begin(op.name, t, row_of(t), stream) if recorder is not None else None
                    op.fn(envs[t])
                    if tok is not None:
                        recorder.end(tok, stream)
                    if stream is not None and op.chain is not None:
                        ev = torch.cuda.Event()
                        ev.record(stream)
                        chain_last[op.chain] = (stream, ev)
                elif op.kind == "comm":
                    for m in members:
                        if m != t and (op.handle, m) in ready_events:
                            other, ev = ready_events.pop((op.handle, m))
                            if other is not stream:
                                stream.wait_event(ev)
                    if recorder is not None:
                        tok = recorder.begin(op.name, members if len(members) > 1 else t, "comm", stream)
                        comm_open.update(((op.handle, m), (tok, members)) for m in members)
                    srcs = [envs[m].pop(op.src) for m in members]
                    outs = [envs[m].get(op.out) if op.out else None for m in members]
                    issued = collectives.issue(op.collective, srcs, outs, group)
                    del srcs
                    for j, m in enumerate(members):
                        handles[(op.handle, m)] = (issued, j)
                    del issued
                else:
                    # No local reference to the handle may outlive this op: it holds the collective's
                    # buffers, which must die when the tile's program drops the result.
                    waited, j = handles.pop((op.handle, t))
                    envs[t][op.dst] = waited.result(j)
                    del waited
                    if recorder is not None:
                        tok, bucket = comm_open.pop((op.handle, t), (None, ()))
                        if tok is not None:  # the first wait on a collective ends it
                            recorder.end(tok, stream)
                            for m in bucket:
                                comm_open.pop((op.handle, m), None)
                        recorder.mark(op.name, t, row_of(t), stream)
            if trace is not None:
                trace.append((",".join(map(str, members)) if op.kind == "comm" else t, op.name, op.kind))
    finally:
        if current is not main:  # the caller's stream again, also when an op raised
            torch.cuda.set_stream(main)
    assert not handles, f"handles never waited: {sorted(handles)}"
    if streams:
        for s in streams:
            main.wait_stream(s)
