"""Costs of the MLP's tile programs, and the candidate plans the planner compares.

Per tile with M gathered rows (ws * local rows with sequence parallelism, else local rows),
H hidden, I local fc1 width, F local ffn width, e bytes per element:

=========  ===================================  ====================================
op         time                                 memory allocated (freed after)
=========  ===================================  ====================================
ag / ag_x  collective over M*H*e                xg, M*H*e (fc1 / wgrad1; kept if saved)
fc1        GEMM (M, I, H)                       pre, M*I*e (act; kept for backward)
act        memory M*(I+F)*e                     h, M*F*e (fc2)
fc2        GEMM (M, H, F)                       partial out, M*H*e (wait_rs)
rs / ar    collective over M*H*e
ag_dy      collective over M*H*e                dy gathered, M*H*e (wgrad2)
dgrad2     memory M*(I+F)*e + GEMM (M, F, H)    h and dh, 2*M*F*e (wgrad2)
act_bwd    memory M*(2I+F)*e                    dpre, M*I*e (wgrad1)
dgrad1     GEMM (M, H, I)                       dx gathered, M*H*e (wait_rs_dx)
wgrad2     GEMM (H, F, M);  wgrad1 GEMM (I, H, M)
=========  ===================================  ====================================

"memory b" is ``b`` bytes at the calibrated bandwidth unless the activation (or its backward) was
measured for M rows (key :meth:`MLPCostModel.act_key`). A collective's latency is its kind's
alpha; a member of a bucket of two or more also pays a copy of its M*H*e bytes in and out.

Candidates (:func:`mlp_candidates`): every effective K of ``TILE_CHOICES`` x keep-or-re-gather x,
each unbucketed and with the bucketing found by :func:`search_buckets`: per collective handle a
partition of the K tiles into runs of adjacent tiles (all ``2**(K-1)`` of them for K <= 5, a
restricted family for K >= 6, see :func:`bucket_partitions`), chosen by coordinate descent with
the simulator as the oracle (plus a second descent seeded by adjacent pairs when that seed is
better), separately for the forward and the backward program.
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ..schedule import TileProgram, round_robin
from ..sim import Candidate, Costs, HardwareModel, Timeline, simulate
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
    makes planning too slow (a llama3-70b-like TP4 training plan took 1.6 s with it, 0.19 s
    without, on the 2-core CPU machine), so only these are tried: an optional singleton first tile, an
    optional singleton last tile, and the tiles between them cut into runs of one equal size
    (k=8 gives 9: unbucketed, ``((0,), (1, 2, 3), (4, 5, 6), (7,))``,
    ``((0, 1), (2, 3), (4, 5), (6, 7))``, ``((0, 1, 2, 3, 4, 5, 6, 7),)``, ...).

    Every partition covers all tiles (groups of one are unbucketed members, as ``round_robin``
    requires). The all-singletons partition (unbucketed) comes first; the rest follow in a fixed
    order (fewer merged tiles first, then fewer merges, then by group sizes), so the result
    never depends on hashing.
    """
    if k < 1:
        raise ValueError(f"k={k!r}; must be a positive int")
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
    """Adjacent pairs, the last tile alone when ``k`` is odd (the planner's former only option)."""
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
    bucketing several handles at once into adjacent pairs (the former planner's options). So the
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


class MLPCostModel:
    """Maps the MLP's ops to times and bytes for one input shape."""

    def __init__(self, *, rows: int, world_size: int, hidden: int, n_in: int, f_local: int, elt: int,
                 sequence_parallel: bool, model: HardwareModel, activation: str = "swiglu"):
        self.rows, self.ws, self.H, self.I, self.F, self.e = rows, world_size, hidden, n_in, f_local, elt
        self.sp, self.model, self.activation = sequence_parallel, model, activation

    def act_key(self, name: str, m: int) -> str:
        """The measured-op key of the activation (``"act"``) or its backward (``"act_bwd"``)
        over ``m`` rows: ``"act:swiglu:MxI"``."""
        return f"{name}:{self.activation}:{m}x{self.I}"

    def act_ops(self, tile_choices=TILE_CHOICES) -> Dict[str, Tuple[str, int]]:
        """Key -> (name, rows) of every activation op the candidates run (for measuring)."""
        rows = {self.gathered(b - a) for k in tile_choices for a, b in tile_bounds(self.rows, k)}
        return {self.act_key(name, m): (name, m) for m in rows for name in ("act", "act_bwd")}

    def gathered(self, local_rows: int) -> int:
        return local_rows * (self.ws if self.sp else 1)

    def gemms(self, m: int) -> List[Tuple[int, int, int]]:
        H, I, F = self.H, self.I, self.F
        return [(m, I, H), (m, H, F), (m, F, H), (m, H, I), (H, F, m), (I, H, m)]

    def op_ms(self, m: int, name: str) -> float:
        md, H, I, F, e = self.model, self.H, self.I, self.F, self.e
        table: Dict[str, Callable[[], float]] = {
            "fc1": lambda: md.gemm_ms(m, I, H),
            "act": lambda: md.op_ms(self.act_key("act", m), m * (I + F) * e),
            "fc2": lambda: md.gemm_ms(m, H, F),
            "dgrad2": lambda: md.op_ms(self.act_key("act", m), m * (I + F) * e) + md.gemm_ms(m, F, H),
            "act_bwd": lambda: md.op_ms(self.act_key("act_bwd", m), m * (2 * I + F) * e),
            "dgrad1": lambda: md.gemm_ms(m, H, I),
            "wgrad2": lambda: md.gemm_ms(H, F, m),
            "wgrad1": lambda: md.gemm_ms(I, H, m),
        }
        return table[name]()

    def sizes(self) -> Dict[str, int]:
        """Op name -> elements per gathered row of the buffer it allocates (module table)."""
        H, I, F = self.H, self.I, self.F
        return {"ag": H, "ag_x": H, "fc1": I, "act": F, "fc2": H if self.sp else 0, "ag_dy": H,
                "dgrad2": 2 * F, "act_bwd": I, "dgrad1": H if self.sp else 0}

    def frees(self, *, save: bool, keep_xg: bool, backward: bool) -> Dict[str, Optional[str]]:
        """Op name -> the op after which its buffer dies (None: kept for backward)."""
        return {"ag": None if keep_xg else "fc1", "fc1": None if save and not backward else "act",
                "act": "fc2", "fc2": "wait_rs", "ag_dy": "wgrad2", "ag_x": "wgrad1", "dgrad2": "wgrad2",
                "act_bwd": "wgrad1", "dgrad1": "wait_rs_dx"}

    def saved_bytes(self, m: int, keep_xg: bool) -> int:
        """Bytes one tile of ``m`` gathered rows keeps for backward."""
        return (m * self.I + (m * self.H if keep_xg else 0)) * self.e

    def grad_bytes(self) -> int:
        return (self.I * self.H + self.F * self.H) * self.e

    def op_bytes(self, m: int, name: str) -> int:
        """Bytes the op ``name`` allocates for a tile of ``m`` gathered rows."""
        return m * self.sizes().get(name, 0) * self.e

    def comm_bytes(self, m: int, name: str) -> int:
        """Bytes a collective of a tile of ``m`` gathered rows moves (its gathered size)."""
        return m * self.H * self.e

    def local_bytes(self) -> int:
        """The layer's local input (alive through the call)."""
        return self.gathered(self.rows) // (self.ws if self.sp else 1) * self.H * self.e

    def costs(self, program: TileProgram, bounds, *, num_streams: int, save: bool, keep_xg: bool,
              backward: bool) -> Costs:
        """The simulator's costs for ``program`` over tiles ``bounds`` (in tile units)."""
        ms = [self.gathered(b - a) for a, b in bounds]

        def compute(tile, op):
            return self.op_ms(ms[tile], op.name)

        def comm(tile, op):
            return self.model.comm_ms(op.collective, self.comm_bytes(ms[tile], op.name))

        def nbytes(tile, op):
            return self.op_bytes(ms[tile], op.name)

        names = {op.name for op in program.ops}
        frees = {p: c for p, c in self.frees(save=save, keep_xg=keep_xg, backward=backward).items()
                 if p in names and (c is None or c in names)}
        local = self.local_bytes()
        if backward:  # saved activations, dx and the weight-gradient accumulators
            base = sum(self.saved_bytes(m, keep_xg) for m in ms) + local + self.grad_bytes()
        else:
            base = local

        def pack(tile, op):  # a bucket member copied into (or out of) the bucket's buffer
            return self.model.mem_ms(2 * self.comm_bytes(ms[tile], op.name))

        return Costs(compute_ms=compute, comm_ms=comm,
                     comm_alpha_ms={kind: alpha for kind, (alpha, _) in self.model.comm.items()},
                     interference=self.model.interference, num_streams=num_streams,
                     launch_ms=self.model.launch_ms, bytes=nbytes, frees=frees, base_bytes=base,
                     bucket_copy_ms=pack)

    def timelines(self, programs, k: int, regather: bool, buckets_fwd: tuple, buckets_bwd: tuple,
                  training: bool) -> Dict[str, Timeline]:
        """The simulated forward (and, when ``training``, backward) timeline of one plan, as the
        planner scored it (one compute stream)."""
        bounds = tile_bounds(self.rows, k)
        fwd_prog, bwd_prog = programs(k, training, regather)
        keep_xg = training and self.sp and not regather
        out = {"forward": simulate(round_robin(fwd_prog, k, buckets=dict(buckets_fwd)),
                                   self.costs(fwd_prog, bounds, num_streams=1, save=training, keep_xg=keep_xg,
                                              backward=False))}
        if training:
            out["backward"] = simulate(round_robin(bwd_prog, k, buckets=dict(buckets_bwd)),
                                       self.costs(bwd_prog, bounds, num_streams=1, save=True, keep_xg=keep_xg,
                                                  backward=True))
        return out

    def gemm_shapes(self, tile_choices=TILE_CHOICES) -> Set[Tuple[int, int, int]]:
        shapes = set()
        for k in tile_choices:
            for a, b in tile_bounds(self.rows, k):
                shapes.update(self.gemms(self.gathered(b - a)))
        return shapes


def mlp_candidates(cm: MLPCostModel, programs: Callable[[int, bool, bool], Tuple[TileProgram, TileProgram]], *,
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
