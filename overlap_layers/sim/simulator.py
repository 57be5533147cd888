"""Discrete-event replay of a :class:`~overlap_layers.schedule.Schedule` on a model of the streams.

The model (docs/architecture.md, Planner and Executor and streams), in the terms of the CUDA executor:

* **Streams.** Compute of tile t (its compute ops and its waits) runs on stream ``compute{t % S}``
  with ``S = Costs.num_streams``; every collective runs on one ``comm`` stream. Each stream runs
  its ops one at a time, in launch order. Compute streams run in parallel without slowing each
  other (the GPU is assumed to have room for all of them); the only slowdown is interference.
* **Host.** The host issues the schedule's launches in order, ``Costs.launch_ms`` each, and never
  blocks (waits are stream-side, as on CUDA): the k-th issued launch (k = 1, 2, ...) cannot start
  before ``k * launch_ms``. A deferred bucket member (``Launch.bucket == ()``) is free.
* **Compute op.** Starts when its stream is free (every earlier op on the stream has ended), its
  host launch has happened and, for an op with a ``chain``, the chain's previous op (in launch
  order, on any stream) has ended. It has ``compute_ms`` of work, done at rate 1, or at rate
  ``1 / Costs.interference`` while the comm stream is busy (every collective is taken to be
  SM-based; use ``interference=1`` for a copy-engine backend).
* **Comm op.** Issued from its tile's stream: it starts when the comm stream is free (collectives
  run FIFO in launch order), its host launch has happened and every op launched before it on the
  issuing tile's stream has ended. A bucket is issued at its non-deferred launch, and also waits
  for every op launched on each member's stream before that member's deferred launch. Its
  duration is ``alpha + sum over members of (comm_ms(member) - alpha + bucket_copy_ms(member))``
  with ``alpha`` the collective kind's latency (``comm_alpha_ms``) and the copy term only for a
  bucket of two or more (packing members into one buffer and out of it): merging saves one
  latency per extra member and pays the copies. Communication is never slowed by compute.
* **Wait.** A zero-length op on the tile's stream that ends when its collective has ended; it
  blocks its stream until then (like ``stream.wait_event``).
* **Memory.** An op allocates ``Costs.bytes`` (per tile; a collective allocates each member's
  bytes) when it starts. The buffer is freed at the end of the first op at or after the
  producer in the program whose name is ``Costs.frees[producer]`` (of the same tile); at the end
  of the producer itself when the name is absent from ``frees``; never when it maps to ``None``
  (saved for backward). At one instant, buffers that end are freed before new ones are allocated;
  a zero-length buffer still counts at its instant. ``peak_bytes`` adds ``Costs.base_bytes``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from ..config import check_positive_int
from ..schedule import Op, Schedule

CostTable = Union[Mapping[str, float], Callable[[int, Op], float]]
ByteTable = Union[Mapping[str, int], Callable[[int, Op], int]]
TileTag = Union[int, Tuple[int, ...]]

_EPS_MS = 1e-9  # ops whose finish times differ by less than this end together


@dataclass(frozen=True)
class Costs:
    """The cost model. A table is a mapping from op name or a callable ``(tile, op) -> value``.

    ``compute_ms``/``comm_ms``: duration of one tile's op (for a collective: one member alone,
    including its latency ``comm_alpha_ms``, a float or a mapping from ``op.collective`` to
    float); ``bucket_copy_ms``: packing cost of one member of a bucket of two or more (default 0).
    ``bytes``: memory an op allocates (default 0);
    ``frees``: op name -> name of the op after whose end the buffer is freed, or ``None`` to keep
    it to the end. The module docstring gives the full model.
    """

    compute_ms: CostTable
    comm_ms: CostTable
    comm_alpha_ms: Union[float, Mapping[str, float]] = 0.0
    interference: float = 1.0
    num_streams: int = 1
    launch_ms: float = 0.0
    bytes: ByteTable = field(default_factory=dict)
    frees: Mapping[str, Optional[str]] = field(default_factory=dict)
    base_bytes: int = 0
    bucket_copy_ms: CostTable = field(default_factory=dict)

    def alpha_ms(self, collective: str) -> float:
        a = self.comm_alpha_ms
        return a.get(collective, 0.0) if isinstance(a, Mapping) else a

    def __post_init__(self) -> None:
        check_positive_int(self.num_streams, "num_streams")
        if not self.interference >= 1.0:
            raise ValueError(f"interference={self.interference!r}; must be >= 1 (1 = no slowdown)")
        alphas = self.comm_alpha_ms.values() if isinstance(self.comm_alpha_ms, Mapping) else [self.comm_alpha_ms]
        if not all(a >= 0.0 for a in alphas):
            raise ValueError(f"comm_alpha_ms={self.comm_alpha_ms!r}; must be >= 0")
        if not self.launch_ms >= 0.0:
            raise ValueError(f"launch_ms={self.launch_ms!r}; must be >= 0")


class Event(NamedTuple):
    """One simulated op. ``tile`` is the tuple of members for a bucket of several tiles."""

    name: str
    tile: TileTag
    stream: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class Timeline:
    """The result of :func:`simulate`, or of a measured run (``runtime.trace.OpRecorder``).

    ``exposed_comm_ms`` is the time the comm stream is busy while no compute stream is;
    ``stream_busy_ms`` the time each stream spends running ops (waiting is not busy); see
    :func:`timeline_from_events`.
    """

    makespan_ms: float
    exposed_comm_ms: float
    peak_bytes: int
    stream_busy_ms: Dict[str, float]
    events: List[Event]

    def to_chrome_trace(self) -> dict:
        """Chrome/Perfetto JSON: one complete ("X") event per op, one thread per stream, in us."""
        tids = {s: i for i, s in enumerate(self.stream_busy_ms)}
        trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": s}}
                 for s, i in tids.items()]
        for e in self.events:
            tag = ",".join(map(str, e.tile)) if isinstance(e.tile, tuple) else str(e.tile)
            trace.append({"name": f"{e.name}[{tag}]", "ph": "X", "pid": 0, "tid": tids[e.stream],
                          "ts": e.start_ms * 1e3, "dur": (e.end_ms - e.start_ms) * 1e3,
                          "cat": "comm" if e.stream == "comm" else "compute"})
        return {"traceEvents": trace, "displayTimeUnit": "ms"}


def chrome_trace(timelines: Mapping[str, Timeline]) -> dict:
    """Several timelines (e.g. ``{"forward": ..., "backward": ...}``) as one Chrome/Perfetto trace:
    timeline i is process i, named by its key, with the threads of :meth:`Timeline.to_chrome_trace`."""
    events = []
    for pid, (name, tl) in enumerate(timelines.items()):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        for e in tl.to_chrome_trace()["traceEvents"]:
            events.append({**e, "pid": pid})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


@dataclass
class _Task:
    """One non-deferred launch as the streams see it."""

    name: str
    tile: TileTag
    stream: str
    work_ms: float
    host_ms: float
    deps: Tuple[int, ...]
    slowed: bool  # a compute op, slowed by interference
    produces: Tuple[Tuple[int, int], ...]  # (tile, op index) of the buffers it allocates
    remaining_ms: float = 0.0
    start_ms: Optional[float] = None
    end_ms: Optional[float] = None


def simulate(schedule: Schedule, costs: Costs) -> Timeline:
    """Replay ``schedule`` under ``costs`` (see the module docstring for the model)."""
    tasks = _build_tasks(schedule, costs)
    _run(tasks, costs.interference)
    streams = [f"compute{s}" for s in range(min(costs.num_streams, schedule.num_tiles))] + ["comm"]
    return timeline_from_events(
        [Event(t.name, t.tile, t.stream, t.start_ms, t.end_ms) for t in tasks], streams,
        peak_bytes=costs.base_bytes + _peak_bytes(schedule, costs, tasks))


def timeline_from_events(events: Sequence[Event], streams: Optional[Sequence[str]] = None, *,
                         peak_bytes: int = 0) -> Timeline:
    """A :class:`Timeline` of ``events`` (times in ms, the first starting at or after 0).

    ``makespan_ms`` is the last end; ``stream_busy_ms[s]`` the length of the union of stream
    ``s``'s events (their sum when they do not overlap, as in :func:`simulate`); ``exposed_comm_ms``
    the length of the union of the ``"comm"`` events outside the union of every other stream's
    events. ``streams`` orders the rows (default: ``compute0, compute1, ...`` by number, other
    streams by name, ``comm`` last; ``comm`` is always present).
    """
    if streams is None:
        streams = sorted({e.stream for e in events} - {"comm"}, key=_stream_order) + ["comm"]
    unknown = {e.stream for e in events} - set(streams)
    assert not unknown, f"events on streams {sorted(unknown)} not in {list(streams)}"
    busy = {s: _length(_union([(e.start_ms, e.end_ms) for e in events if e.stream == s]))
            for s in streams}
    compute = [(e.start_ms, e.end_ms) for e in events if e.stream != "comm"]
    comm = _union([(e.start_ms, e.end_ms) for e in events if e.stream == "comm"])
    return Timeline(makespan_ms=max((e.end_ms for e in events), default=0.0),
                    exposed_comm_ms=_uncovered(comm, compute), peak_bytes=peak_bytes,
                    stream_busy_ms=busy, events=list(events))


def _stream_order(name: str):
    """``compute2`` before ``compute10``; names that are not ``compute<n>`` after, by name."""
    num = name[len("compute"):]
    return (0, int(num), "") if name.startswith("compute") and num.isdigit() else (1, 0, name)


def _lookup(table, tile: int, op: Op, what: str, default=None):
    if callable(table):
        return table(tile, op)
    if op.name in table:
        return table[op.name]
    if default is not None:
        return default
    raise ValueError(f"Costs.{what} has no entry for op {op.name!r}; add one or pass a callable")


def _build_tasks(schedule: Schedule, costs: Costs) -> List[_Task]:
    """Turn launches into tasks with their host times and cross-stream dependencies."""
    program, tasks = schedule.program, []
    tail: Dict[str, int] = {}  # stream -> its last task so far
    member_ready: Dict[Tuple[str, int], Optional[int]] = {}  # deferred member -> its stream tail
    comm_task: Dict[Tuple[str, int], int] = {}  # (handle, tile) -> the task of its collective
    chain_last: Dict[str, int] = {}
    for ln in schedule.launches:
        op, t = program.ops[ln.op], ln.tile
        stream = f"compute{t % costs.num_streams}"
        if op.kind == "comm" and ln.bucket == ():
            member_ready[(op.handle, t)] = tail.get(stream)
            continue
        host_ms = (len(tasks) + 1) * costs.launch_ms
        if op.kind == "comm":
            deps = [tail.get(stream)]
            deps += [member_ready.pop((op.handle, m)) for m in ln.bucket if m != t]
            alpha = costs.alpha_ms(op.collective)
            work = alpha + sum(_lookup(costs.comm_ms, m, op, "comm_ms") - alpha for m in ln.bucket)
            if len(ln.bucket) > 1:
                work += sum(_lookup(costs.bucket_copy_ms, m, op, "bucket_copy_ms", 0.0) for m in ln.bucket)
            tag = ln.bucket if len(ln.bucket) > 1 else t
            comm_task.update(((op.handle, m), len(tasks)) for m in ln.bucket)
            task = _Task(op.name, tag, "comm", work, host_ms, _known(deps), False,
                         tuple((m, ln.op) for m in ln.bucket))
        elif op.kind == "wait":
            task = _Task(op.name, t, stream, 0.0, host_ms, (comm_task[(op.handle, t)],), False,
                         ((t, ln.op),))
        else:
            deps = [chain_last.get(op.chain)] if op.chain is not None else []
            task = _Task(op.name, t, stream, _lookup(costs.compute_ms, t, op, "compute_ms"),
                         host_ms, _known(deps), True, ((t, ln.op),))
            if op.chain is not None:
                chain_last[op.chain] = len(tasks)
        if task.stream != "comm":
            tail[stream] = len(tasks)
        task.remaining_ms = task.work_ms
        tasks.append(task)
    return tasks


def _known(deps: Sequence[Optional[int]]) -> Tuple[int, ...]:
    return tuple(d for d in deps if d is not None)


def _run(tasks: List[_Task], interference: float) -> None:
    """Advance time event by event, filling in every task's start and end."""
    queues: Dict[str, deque] = {}
    for i, task in enumerate(tasks):
        queues.setdefault(task.stream, deque()).append(i)
    running: Dict[str, int] = {}
    now = 0.0
    while True:
        started = True
        while started:  # start what can start; zero-length ops may unblock others at once
            started = False
            for stream, queue in queues.items():
                if stream in running or not queue:
                    continue
                task = tasks[queue[0]]
                if task.host_ms <= now and all(tasks[d].end_ms is not None for d in task.deps):
                    task.start_ms = now
                    if task.work_ms > 0:
                        running[stream] = queue[0]
                    else:
                        task.end_ms = now
                    queue.popleft()
                    started = True
        heads = [tasks[q[0]].host_ms for s, q in queues.items() if q and s not in running]
        later = min((h for h in heads if h > now), default=math.inf)
        if not running:
            if not any(queues.values()):
                return
            assert later < math.inf, "simulator deadlock: every queue head waits on a dependency"
            now = later
            continue
        rate = 1.0 / interference if "comm" in running else 1.0
        rates = {s: rate if tasks[i].slowed else 1.0 for s, i in running.items()}
        finish = {s: now + tasks[i].remaining_ms / rates[s] for s, i in running.items()}
        step_to = min(min(finish.values()), later)
        for stream, i in list(running.items()):
            if finish[stream] <= step_to + _EPS_MS:
                tasks[i].remaining_ms, tasks[i].end_ms = 0.0, step_to
                del running[stream]
            else:
                tasks[i].remaining_ms -= (step_to - now) * rates[stream]
        now = step_to


def _union(intervals: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The union of ``intervals`` as sorted disjoint intervals (empty ones dropped)."""
    merged: List[List[float]] = []
    for a, b in sorted(c for c in intervals if c[1] > c[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(disjoint: Sequence[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in disjoint)


def _uncovered(intervals: Sequence[Tuple[float, float]],
               cover: Sequence[Tuple[float, float]]) -> float:
    """Total length of ``intervals`` (disjoint) outside the union of ``cover``."""
    merged = _union(cover)
    total = 0.0
    for a, b in intervals:
        total += (b - a) - sum(max(0.0, min(b, d) - max(a, c)) for c, d in merged)
    return total


def _peak_bytes(schedule: Schedule, costs: Costs, tasks: List[_Task]) -> int:
    """The largest live sum of buffers over the timeline (without ``base_bytes``)."""
    ops = schedule.program.ops
    names = {op.name for op in ops}
    for producer, consumer in costs.frees.items():
        if producer not in names or (consumer is not None and consumer not in names):
            raise ValueError(f"Costs.frees has {producer!r}: {consumer!r}; both must name ops of "
                             f"program {schedule.program.name!r}: {sorted(names)}")
    task_of = {p: i for i, task in enumerate(tasks) for p in task.produces}
    changes = []  # (time, order, delta): frees of older buffers, then allocations, then the rest
    for task in tasks:
        for tile, index in task.produces:
            size = _lookup(costs.bytes, tile, ops[index], "bytes", default=0)
            if not size:
                continue
            changes.append((task.start_ms, 1, size))
            consumer = costs.frees.get(ops[index].name, ops[index].name)
            if consumer is None:
                continue
            at = next((j for j in range(index, len(ops)) if ops[j].name == consumer), None)
            if at is None:
                raise ValueError(f"Costs.frees[{ops[index].name!r}]={consumer!r} comes before "
                                 f"{ops[index].name!r} in program {schedule.program.name!r}")
            end = tasks[task_of[(tile, at)]].end_ms
            changes.append((end, 0 if end > task.start_ms else 2, -size))
    live = peak = 0
    for _, _, delta in sorted(changes):
        live += delta
        peak = max(peak, live)
    return peak
