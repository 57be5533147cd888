"""Segmented round-robin order of K tiles, with bucketing of same-kind collectives.

The executor launches segment 0 of every tile, then segment 1 of every tile, and so on
(docs/architecture.md, Tile programs and schedules). One tile's communication thereby lands in the compute of the
next, and every dependency inside a tile is kept because a tile's segments stay in order.

Bucketing: the comm ops with handle ``h`` of a run of adjacent tiles may be merged
into one collective. The merged collective is issued where the bucket's *last* member would
have issued its own (only then are all inputs ready); the other members' launches are kept in the
order as deferred no-ops so the order stays readable. A member whose wait would come before the
bucket is issued cannot occur: a wait always opens a later segment than its comm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

from ..config import check_positive_int
from .program import TileProgram, segments

Buckets = Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class Launch:
    """Launch op ``op`` (an index into the program) of tile ``tile``.

    For a comm op, ``bucket`` lists the tiles whose collectives this launch issues together
    (``(tile,)`` when unbucketed) and is ``()`` for a member deferred to a later launch.
    """

    tile: int
    op: int
    bucket: Optional[Tuple[int, ...]] = None


@dataclass(frozen=True)
class Schedule:
    program: TileProgram
    num_tiles: int
    launches: Tuple[Launch, ...]
    buckets: Tuple[Tuple[str, Buckets], ...]

    def bucket_of(self, handle: str, tile: int) -> Tuple[int, ...]:
        for h, groups in self.buckets:
            if h == handle:
                for g in groups:
                    if tile in g:
                        return g
        return (tile,)

    def describe(self) -> Tuple[str, ...]:
        """The launch order as strings like ``"ag[0]"``, ``"ag[0,1]"`` or ``"-ag[0]"`` (deferred)."""
        out = []
        for ln in self.launches:
            op = self.program.ops[ln.op]
            if op.kind == "comm":
                if ln.bucket == ():
                    out.append(f"-{op.name}[{ln.tile}]")
                else:
                    out.append(f"{op.name}[{','.join(map(str, ln.bucket))}]")
            else:
                out.append(f"{op.name}[{ln.tile}]")
        return tuple(out)


def singleton_buckets(num_tiles: int) -> Buckets:
    return tuple((t,) for t in range(num_tiles))


def validate_buckets(groups: Sequence[Sequence[int]], num_tiles: int, handle: str) -> Buckets:
    """Buckets must partition ``range(num_tiles)`` into runs of adjacent tiles, in order."""
    flat = [t for g in groups for t in g]
    ok = flat == list(range(num_tiles)) and all(
        len(g) > 0 and list(g) == list(range(g[0], g[0] + len(g))) for g in groups)
    if not ok:
        raise ValueError(
            f"buckets[{handle!r}]={tuple(map(tuple, groups))} must split tiles 0..{num_tiles - 1} "
            f"into consecutive runs, e.g. ((0, 1), (2,), (3,))")
    return tuple(tuple(g) for g in groups)


def round_robin(program: TileProgram, num_tiles: int, *,
                buckets: Optional[Mapping[str, Sequence[Sequence[int]]]] = None,
                order: Optional[Sequence[int]] = None, join: Sequence[str] = ()) -> Schedule:
    """Order ``num_tiles`` copies of ``program`` by segmented round-robin.

    ``order`` is the tile order inside every round (default ``0..K-1``); ``buckets`` maps a comm
    handle to a partition of the tiles into adjacent runs; a wait on a handle in ``join`` opens no
    round (:func:`~overlap_layers.schedule.program.segments`): what follows it launches right
    after the tile's own collective, before the next tile's (the fused block's seam between its
    sublayers); a compute op named in ``program.cut`` opens a round of its own (:func:`segments`).
    """
    check_positive_int(num_tiles, "num_tiles")
    order = list(range(num_tiles)) if order is None else list(order)
    if sorted(order) != list(range(num_tiles)):
        raise ValueError(f"order={order}; must be a permutation of 0..{num_tiles - 1}")
    handles = {op.handle for op in program.comm_ops()}
    bmap: Dict[str, Buckets] = {}
    for h, groups in (buckets or {}).items():
        if h not in handles:
            raise ValueError(f"buckets has handle {h!r}; the program's handles are {sorted(handles)}")
        g = validate_buckets(groups, num_tiles, h)
        if any(len(x) > 1 for x in g):
            bmap[h] = g
    if set(join) & set(buckets or {}):
        raise ValueError(f"join={tuple(join)} and buckets={dict(buckets)}: a joined handle cannot be bucketed")
    segs = segments(program, join)
    launches = []
    issued = set()  # (handle, tile) whose collective has been launched
    for seg in segs:
        for t in order:
            for i in seg:
                op = program.ops[i]
                if op.kind == "comm":
                    group = _group_of(bmap.get(op.handle), t)
                    # Members run this segment in the same round, so the last one visited has
                    # every member's input ready: the bucket is issued there.
                    if t == _last_in(order, group):
                        launches.append(Launch(t, i, group))
                        issued.update((op.handle, m) for m in group)
                    else:
                        launches.append(Launch(t, i, ()))
                elif op.kind == "wait":
                    # A wait opens a later segment than its comm (a joined one follows it in the
                    # same segment, unbucketed), and every tile finishes a round before the next
                    # starts, so the bucket is always out by now.
                    assert (op.handle, t) in issued, (op.handle, t)
                    launches.append(Launch(t, i))
                else:
                    launches.append(Launch(t, i))
    return Schedule(program, num_tiles, tuple(launches), tuple(sorted(bmap.items())))


def _group_of(groups: Optional[Buckets], tile: int) -> Tuple[int, ...]:
    if groups:
        for g in groups:
            if tile in g:
                return g
    return (tile,)


def _last_in(order: Sequence[int], group: Sequence[int]) -> int:
    """The member of ``group`` visited last in ``order``."""
    return max(group, key=order.index)
