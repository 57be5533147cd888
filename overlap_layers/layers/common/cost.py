"""Costs of the MLP's tile programs (the base cost model the other layers specialise).

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
dgrad2     GEMM (M, F, H)                       dh, M*F*e (act_bwd)
act_bwd    memory M*(2I+2F)*e                   dpre and h, M*(I+F)*e (wgrad1)
dgrad1     GEMM (M, H, I)                       dx gathered, M*H*e (wait_rs_dx)
wgrad2     GEMM (H, F, M);  wgrad1 GEMM (I, H, M)
=========  ===================================  ====================================

"memory b" is ``b`` bytes at the calibrated bandwidth unless the activation (or its backward, which
also returns the activation for wgrad2) was measured for M rows (key :meth:`MLPCostModel.act_key`). A collective's latency is its kind's
alpha; a member of a bucket of two or more also pays a copy of its M*H*e bytes in and out.

The candidates are compared by :func:`~overlap_layers.planning.candidates.plan_candidates`.

The rank-chunk plans' costs are :class:`~.rank_cost.RankChunkCost`'s ([Note: rank-chunk cost] in
``layers/common/rank_cost.py``), a base of :class:`MLPCostModel`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set, Tuple

from ...planning.candidates import TILE_CHOICES
from ...planning.tiling import tile_bounds
from ...schedule import TileProgram, round_robin
from ...sim import Costs, HardwareModel, Timeline, simulate
from .rank_cost import RankChunkCost


class MLPCostModel(RankChunkCost):
    """Maps the MLP's ops to times and bytes for one input shape (batch tiles here, rank chunks
    in :class:`~.rank_cost.RankChunkCost`)."""

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
        rows |= set(self.piece_rows())
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
            "dgrad2": lambda: md.gemm_ms(m, F, H),
            "act_bwd": lambda: md.op_ms(self.act_key("act_bwd", m), m * (2 * I + 2 * F) * e),
            "dgrad1": lambda: md.gemm_ms(m, H, I),
            "wgrad2": lambda: md.gemm_ms(H, F, m),
            "wgrad1": lambda: md.gemm_ms(I, H, m),
        }
        return table[name]()

    def sizes(self) -> Dict[str, int]:
        """Op name -> elements per gathered row of the buffer it allocates (module table)."""
        H, I, F = self.H, self.I, self.F
        return {"ag": H, "ag_x": H, "fc1": I, "act": F, "fc2": H if self.sp else 0, "ag_dy": H,
                "dgrad2": F, "act_bwd": I + F, "dgrad1": H if self.sp else 0}

    def frees(self, *, save: bool, keep_xg: bool, backward: bool) -> Dict[str, Optional[str]]:
        """Op name -> the op after which its buffer dies (None: kept for backward)."""
        return {"ag": None if keep_xg else "fc1", "fc1": None if save and not backward else "act",
                "act": "fc2", "fc2": "wait_rs", "ag_dy": "wgrad2", "ag_x": "wgrad1", "dgrad2": "act_bwd",
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

        def comm(tile, op):  # at world size 1 no collective runs (plain_tp.py: nothing to exchange)
            return self.model.comm_ms(op.collective, self.comm_bytes(ms[tile], op.name)) if self.ws > 1 else 0.0

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

    def row_counts(self, tile_choices=TILE_CHOICES) -> Set[int]:
        """The gathered rows of every tile and rank piece the candidates cost."""
        tiles = {self.gathered(b - a) for k in tile_choices for a, b in tile_bounds(self.rows, k)}
        return tiles | set(self.piece_rows())

    def gemm_shapes(self, tile_choices=TILE_CHOICES) -> Set[Tuple[int, int, int]]:
        return {s for m in self.row_counts(tile_choices) for s in self.gemms(m)}
