"""Tile programs: what one tile of a layer does, as a short list of ops.

A layer describes the forward (or backward) of *one* tile as a :class:`TileProgram` of three
kinds of op (docs/architecture.md, Tile programs and schedules):

* ``compute``: a callable on the tile's environment (a dict of tensors), with an optional cost
  key (e.g. a GEMM shape) for the simulator and an optional ``chain``: ops of the same chain
  run in launch order across tiles even when the tiles sit on different streams (gradient
  accumulators are the use).
* ``comm``: start a collective on ``env[src]`` (result lands in ``env[out]`` when given);
  returns a handle named ``handle``.
* ``wait``: the handle's result is needed from here on; it is stored as ``env[dst]``.

This module is pure Python: no torch.distributed, no streams. The K tiles run the same program
on their slice of the batch; :mod:`overlap_layers.schedule.roundrobin` orders them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, MutableMapping, Optional, Tuple

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class Op:
    """One op of a tile program. Build with :func:`compute`, :func:`comm` or :func:`wait`."""

    kind: str
    name: str
    fn: Optional[Callable[[dict], Any]] = field(default=None, compare=False, repr=False)
    collective: Optional[str] = None
    handle: Optional[str] = None
    src: Optional[str] = None
    dst: Optional[str] = None
    out: Optional[str] = None
    cost_key: Optional[Tuple] = None
    chain: Optional[str] = None


def compute(name: str, fn: Callable[[dict], Any], *, cost_key: Optional[Tuple] = None,
            chain: Optional[str] = None) -> Op:
    """A compute op: ``fn(env)`` reads and writes the tile's environment."""
    return Op("compute", name, fn=fn, cost_key=cost_key, chain=chain)


def comm(name: str, collective: str, *, src: str, out: Optional[str] = None,
         cost_key: Optional[Tuple] = None) -> Op:
    """Start ``collective`` on ``env[src]``; the handle is named after the op."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective={collective!r}; valid: {COLLECTIVES}")
    return Op("comm", name, collective=collective, handle=name, src=src, out=out,
              cost_key=cost_key)


def wait(handle: str, *, dst: str) -> Op:
    """Block the tile until ``handle`` completes; its result becomes ``env[dst]``."""
    return Op("wait", f"wait_{handle}", handle=handle, dst=dst)


@dataclass(frozen=True)
class TileProgram:
    """The ops of one tile, in order; ``name`` prefixes profiler ranges (``overlap::<name>::``).
    ``cut`` names compute ops that open a segment of their own (:func:`segments`): work that may
    wait for the next tile's, such as a backward's weight gradients."""

    name: str
    ops: Tuple[Op, ...]
    cut: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        started, waited = {}, set()
        for i, op in enumerate(self.ops):
            if op.kind == "comm":
                assert op.handle not in started, f"handle {op.handle} started twice"
                started[op.handle] = i
            elif op.kind == "wait":
                assert op.handle in started, f"wait on {op.handle} before its comm"
                assert op.handle not in waited, f"handle {op.handle} waited twice"
                waited.add(op.handle)
            else:
                assert op.kind == "compute", op.kind
        missing = set(started) - waited
        assert not missing, f"handles never waited: {sorted(missing)}"

    def comm_ops(self) -> Tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind == "comm")

    def index_of_comm(self, handle: str) -> int:
        for i, op in enumerate(self.ops):
            if op.kind == "comm" and op.handle == handle:
                return i
        raise KeyError(handle)


def segments(program: TileProgram, join: Collection[str] = ()) -> Tuple[Tuple[int, ...], ...]:
    """Cut the program into segments: a new segment starts at every ``wait`` (except a wait on a
    handle in ``join``, which stays in the segment of the ops before it) and at every compute op
    named in ``program.cut``.

    Waits are the only places a tile can stall, so a segment is a run of ops that can be
    launched without blocking, preceded by the wait that made it ready. Returns op indices.
    """
    segs, cur = [], []
    for i, op in enumerate(program.ops):
        opens = op.kind == "wait" and op.handle not in join or op.kind == "compute" and op.name in program.cut
        if cur and opens:
            segs.append(tuple(cur))
            cur = []
        cur.append(i)
    if cur:
        segs.append(tuple(cur))
    return tuple(segs)


def scoped(program: TileProgram, prefix: str) -> Tuple[Op, ...]:
    """``program``'s ops with every environment key and handle prefixed by ``prefix``: compute
    ops see the tile's environment through :class:`Scope` (key ``k`` is ``prefix + k``), so two
    programs' ops can run in one program on one environment per tile. Chains keep their names:
    copies of one program share its accumulators, whose order the chain keeps across streams."""
    def one(op: Op) -> Op:
        if op.kind == "compute":
            return Op("compute", prefix + op.name, fn=lambda env, fn=op.fn: fn(Scope(env, prefix)),
                      cost_key=op.cost_key, chain=op.chain)
        name = (lambda k: prefix + k if k else k)
        return Op(op.kind, prefix + op.name, collective=op.collective, handle=name(op.handle), src=name(op.src),
                  dst=name(op.dst), out=name(op.out), cost_key=op.cost_key)
    return tuple(one(op) for op in program.ops)


class Scope(MutableMapping):
    """The keys of ``env`` that start with ``prefix``, without it (see :func:`scoped`)."""

    def __init__(self, env: dict, prefix: str) -> None:
        self._env, self._prefix = env, prefix

    def __getitem__(self, key: str) -> Any:
        return self._env[self._prefix + key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._env[self._prefix + key] = value

    def __delitem__(self, key: str) -> None:
        del self._env[self._prefix + key]

    def __iter__(self) -> Iterator[str]:
        n = len(self._prefix)
        return (k[n:] for k in list(self._env) if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)
