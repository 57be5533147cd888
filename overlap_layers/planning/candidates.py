"""The candidate plans every layer's planner compares, simulated on the layer's cost model.

Candidates (:func:`plan_candidates`): every effective K of ``TILE_CHOICES`` x keep-or-re-gather x,
each unbucketed and with the bucketing found by :func:`search_buckets`: per collective handle a
partition of the K tiles into runs of adjacent tiles (all ``2**(K-1)`` of them for K <= 5, a
restricted family for K >= 6, see :func:`bucket_partitions`), chosen by coordinate descent with
the simulator as the oracle (plus a second descent seeded by adjacent pairs when that seed is
better), separately for the forward and the backward program.

A cost model provides ``rows`` (tile units), ``sp`` (sequence parallel: a re-gather option),
``costs(program, bounds, ...)`` (the simulator's :class:`~overlap_layers.sim.Costs`) and
``timelines``; see :class:`~overlap_layers.layers.common.cost.MLPCostModel`, which the other layers'
models specialise.
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import check_positive_int
from ..schedule import TileProgram, round_robin
from ..sim import Candidate, Costs, Timeline, simulate
from .tiling import effective_num_tiles, tile_bounds

TILE_CHOICES = (1, 2, 3, 4, 6, 8)


#: From this many tiles on, the bucket search uses the restricted partition space (see
#: :func:`bucket_partitions`); below it, every contiguous partition is tried.
FULL_SEARCH_MAX_TILES = 5
#: Coordinate-descent passes over the collectives (a pass that changes nothing ends it early).
MAX_PASSES = 3
_TIE_MS = 1e-9  # makespans closer than this are a tie (the simulator's own resolution)

Partition = Tuple[Tuple[int, ...], ...]


def _from_cuts(k: int, cuts: Tuple[int, ...]) -> Partition:
    """The partition of ``range(k)`` cut before each tile in ``cuts`` (ascending, in 1..k-1)."""
    edges = (0, *cuts, k)
    return tuple(tuple(range(a, b)) for a, b in zip(edges, edges[1:]))


def _merged_tiles(part: Partition) -> int:
    """Tiles that share their collective with another tile (0 for the all-singletons partition)."""
    return sum(len(g) for g in part if len(g) > 1)


def bucket_partitions(k: int) -> Tuple[Partition, ...]:
    """The bucketings the search tries for one collective of a ``k``-tile program.

    For ``k <= FULL_SEARCH_MAX_TILES``: every partition of tiles ``0..k-1`` into runs of adjacent
    tiles (``2**(k-1)`` of them). For larger ``k`` (6 and 8 among ``TILE_CHOICES``) the full space
    makes planning too slow (a llama3-70b-like TP4 training plan takes about eight times as long
    to plan with it), so only these are tried: an optional singleton first tile, an
    optional singleton last tile, and the tiles between them cut into runs of one equal size
    (k=8 gives 9: unbucketed, ``((0,), (1, 2, 3), (4, 5, 6), (7,))``,
    ``((0, 1), (2, 3), (4, 5), (6, 7))``, ``((0, 1, 2, 3, 4, 5, 6, 7),)``, ...).

    Every partition covers all tiles (groups of one are unbucketed members, as ``round_robin``
    requires). The all-singletons partition (unbucketed) comes first; the rest follow in a fixed
    order (fewer merged tiles first, then fewer merges, then by group sizes), so the result
    never depends on hashing.
    """
    check_positive_int(k, "k")
    if k <= FULL_SEARCH_MAX_TILES:
        parts = {_from_cuts(k, cuts) for n in range(k) for cuts in itertools.combinations(range(1, k), n)}
    else:
        parts = set()
        for first, last in itertools.product((0, 1), repeat=2):
            n = k - first - last
            for size in range(1, n + 1):
                if n % size == 0:
                    cuts = {first + i * size for i in range(n // size)} | {k - last}
                    parts.add(_from_cuts(k, tuple(sorted(cuts - {0, k}))))
    return tuple(sorted(parts, key=lambda p: (_merged_tiles(p), k - len(p), [len(g) for g in p])))


def _pairs(k: int) -> Partition:
    """Adjacent pairs, the last tile alone when ``k`` is odd (the fallback seed's bucketing)."""
    return tuple(tuple(range(i, min(i + 2, k))) for i in range(0, k, 2))


def search_buckets(program: TileProgram, k: int, costs: Costs, *,
                   partitions: Optional[Callable[[int], Sequence[Partition]]] = None,
                   max_passes: int = MAX_PASSES) -> Tuple[tuple, Timeline, Timeline]:
    """Choose a bucketing per collective of ``program`` at ``k`` tiles by coordinate descent.

    Reference: start from every collective unbucketed. A *pass* visits the program's collective
    handles in program order; for each it simulates (``simulate(round_robin(...), costs)``) every
    partition of ``partitions(k)`` (default :func:`bucket_partitions`) with the other handles held
    at their current partitions, and keeps the best: smallest makespan, ties (within 1e-9 ms) to
    fewer merged tiles over all handles, else to the current partition. Passes repeat until one
    changes nothing, at most ``max_passes``.

    Fallback seed: coordinate descent from unbucketed can end in a local minimum worse than
    bucketing several handles at once into adjacent pairs. So the
    ``2**h`` combinations of "unbucketed or adjacent pairs" per handle are simulated too, and if
    the best of them beats the descent's result, a second descent starts from it; the better of
    the two results wins (ties to the first). The result is therefore never slower than
    unbucketed nor than any of those combinations.

    Handles of ``all_to_all`` collectives are never bucketed (the runtime cannot). Deterministic:
    same inputs, same result, on every rank (handles in program order, partitions in the order of
    ``partitions(k)``; nothing depends on hashing).

    Returns ``(buckets, best, unbucketed)``: ``buckets`` is a tuple of ``(handle, partition)``
    pairs sorted by handle, holding only bucketed handles (``()`` when nothing helps), and the
    timelines of that bucketing and of the unbucketed schedule. When the passes converged, no
    single handle's partition change improves the result; it is still only a local minimum: the
    exhaustive minimum over all combinations can be lower (tests/test_planner.py shows one case).
    """
    handles: List[str] = []
    for op in program.comm_ops():
        if op.collective != "all_to_all" and op.handle not in handles:
            handles.append(op.handle)
    single = tuple((t,) for t in range(k))
    seen: Dict[tuple, Timeline] = {}

    def run(assign: Mapping[str, Partition]) -> Tuple[tuple, Timeline]:
        key = tuple(sorted((h, p) for h, p in assign.items() if p != single))
        if key not in seen:
            seen[key] = simulate(round_robin(program, k, buckets=dict(key)), costs)
        return key, seen[key]

    def merged(assign: Mapping[str, Partition]) -> int:
        return sum(_merged_tiles(p) for p in assign.values())

    def better(tl: Timeline, assign, than: Timeline, than_assign) -> bool:
        return (tl.makespan_ms < than.makespan_ms - _TIE_MS or
                (tl.makespan_ms <= than.makespan_ms + _TIE_MS and merged(assign) < merged(than_assign)))

    parts = tuple((partitions or bucket_partitions)(k)) if k > 1 else ()

    def descend(current: Dict[str, Partition]):
        key, best = run(current)
        for _ in range(max_passes if parts else 0):
            changed = False
            for h in handles:
                for p in parts:
                    if p == current[h]:
                        continue
                    trial = dict(current)
                    trial[h] = p
                    tkey, tl = run(trial)
                    if better(tl, trial, best, current):
                        current, key, best, changed = trial, tkey, tl, True
            if not changed:
                break
        return current, key, best

    start = {h: single for h in handles}
    unbucketed = run(start)[1]
    current, key, best = descend(start)
    if parts:
        seeds = [{h: (_pairs(k) if on else single) for h, on in zip(handles, mask)}
                 for mask in itertools.product((False, True), repeat=len(handles))]
        seed = min(seeds, key=lambda a: (run(a)[1].makespan_ms, merged(a)))
        if better(run(seed)[1], seed, best, current):
            other, okey, obest = descend(seed)
            if better(obest, other, best, current):
                key, best = okey, obest
    return key, best, unbucketed


def plan_candidates(cm, programs: Callable[[int, bool, bool], Tuple[TileProgram, TileProgram]], *,
                   training: bool, tile_choices=TILE_CHOICES) -> List[Candidate]:
    """Simulate the candidate plans: per K x (save or re-gather x), unbucketed and best bucketed.

    ``programs(k, save, regather)`` returns the forward and backward tile programs. For each
    effective K (and, when training with sequence parallelism, each of keep-x / re-gather-x) the
    forward and the backward program get their own :func:`search_buckets` (coordinate descent over
    :func:`bucket_partitions` per collective, the simulator as the oracle, see there). Two candidates come out:
    the unbucketed plan and, when the search found something better in either direction, the plan
    with both searched bucketings (``buckets_fwd`` / ``buckets_bwd``). Both are kept because the
    bucketed one may need more memory: :func:`~overlap_layers.sim.choose` filters by peak bytes.
    A candidate's time and exposed communication are forward + backward, its peak the larger of
    the two."""
    out: List[Candidate] = []
    seen = set()
    for k_req in tile_choices:
        k = effective_num_tiles(cm.rows, k_req)
        if k in seen:
            continue
        seen.add(k)
        bounds = tile_bounds(cm.rows, k)
        streams = 1  # the GPU is one compute resource: extra streams fill gaps, add no throughput
        for regather in ((False, True) if training and cm.sp else (False,)):
            fwd_prog, bwd_prog = programs(k, training, regather)
            keep_xg = training and cm.sp and not regather
            fwd_costs = cm.costs(fwd_prog, bounds, num_streams=streams, save=training, keep_xg=keep_xg, backward=False)
            parts = [search_buckets(fwd_prog, k, fwd_costs)]
            if training:
                bwd_costs = cm.costs(bwd_prog, bounds, num_streams=streams, save=True, keep_xg=keep_xg, backward=True)
                parts.append(search_buckets(bwd_prog, k, bwd_costs))
            plain = [(u, ()) for _, _, u in parts]
            plans = [plain]
            if any(b for b, _, _ in parts):
                plans.append([(t, b) for b, t, _ in parts])
            for plan in plans:
                bf = plan[0][1]
                bb = plan[1][1] if training else ()
                out.append(Candidate(k, regather, bf, bb, sum(t.makespan_ms for t, _ in plan),
                                     sum(t.exposed_comm_ms for t, _ in plan), max(t.peak_bytes for t, _ in plan)))
    return out
