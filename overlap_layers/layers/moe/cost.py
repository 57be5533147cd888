"""Costs of the MoE layer's tile programs (the MLP's cost model with the MoE's ops).

The plan is made before routing, from numbers every rank shares: the largest token count of the
group (bucketed) and balanced routing, so each rank sends and receives A = m*k assignment rows
for a tile of m tokens, spread evenly over its El local experts (r = A/El rows each). H hidden,
I expert fc1 width (2*ffn for swiglu), F = ffn, e bytes per element:

===========  ===========================================  ==============================
op           time                                         memory allocated (freed after)
===========  ===========================================  ==============================
dispatch     all-to-all of A*H*e                          received rows, A*H*e (experts)
experts      GGEMM (A, I, H) + GGEMM (A, H, F) (grouped)  act and out, A*(I+F+H)*e (combine)
             or El x (GEMM (r, I, H) + GEMM (r, H, F))
             + memory A*(I+F)*e + two row gathers 4*A*H*e
combine      all-to-all of A*H*e                          combined rows, A*H*e (kept: the output)
dispatch_bwd all-to-all of A*H*e                          A*H*e (experts_bwd)
experts_bwd  2 GEMMs dgrad + 2 wgrad (grouped: the dgrads   A*(I+F+H)*e (combine_bwd)
             as one GGEMM each, the wgrads as one with
             El*H / El*I output rows and r deep; else
             El x 4 GEMMs) + act' + two row gathers
combine_bwd  all-to-all of A*H*e
===========  ===========================================  ==============================

GGEMM (m, n, k): a grouped GEMM of m rows spread evenly over the El local experts, ``[m, k] @
w[e] [k, n]``, as the layer measured it at its first call, else priced by
:meth:`MoECostModel.grouped_ms` ([Note: grouped GEMMs cost more than dense ones]).

Routing, the permutation and the weighted combine run once per call whatever K is, so they are
left out (they do not change the choice).

[Note: grouped GEMMs cost more than dense ones]
A grouped GEMM of m rows over El experts costs more than the dense GEMM of the same ``(m, n,
k)``: it reads every expert's weights, and each group ends in a partial row tile. For qwen3-30b-a3b
at EP 4 (``torch._grouped_mm``, 32 local experts) the grouped GEMM takes up to 1.7x the dense one
with even counts, and random counts, as routing gives, add more. Priced as the dense GEMM, a tile
or rank piece of the experts would look cheaper than it is, the more so the smaller it is.

So the layer times each grouped GEMM the candidates need at its first call
(:meth:`MoECostModel.grouped_ops`, on its own weights), with its rows routed at random over the
experts (``moe.routed_ends``): the parts' partial tiles are part of their cost. Unmeasured (off
CUDA, or without ``config.measure``), one costs the dense GEMM plus a read of the other El-1
experts' weights at the model's memory bandwidth (2500 GB/s nominal), mostly on the safe side of
the measured times, where splitting must win clearly.

Smaller row tiles do not help here: a Triton grouped GEMM with 64-row tiles, and
``torch._grouped_mm``'s own 64x128 tiles (which it takes on Hopper only where the input's rows per
group, its row count over the groups, not the offsets, or N is at most 128:
``aten/src/ATen/native/cuda/GroupMM.cu``; spreading each group over slots of a strided view of the
weights gets them), run slower than its 128x256 tiles on every part. Measured: see
docs/measurements.md (MoE, grouped GEMM tiles and pricing).

The rank-chunk plan (``layers/moe/ranks.py``) is costed by the MLP's recurrence ([Note: rank-chunk
cost] in ``layers/common/cost.py``) with the MoE's pieces: a chunk is one source's ``A/ws`` rows, a piece
runs the experts on its rows with no regrouping gathers (each source's rows arrive grouped by
expert; own results stay where they are made); backward runs the own rows whole,
then the peers', which push dx before their weight gradients (the tail). Weight gradients follow
[Note: MoE weight-gradient accumulation] (``layers/moe/ranks.py``): a GEMM per expert that accumulates,
or one grouped GEMM per piece, every piece after the first adding into the accumulators in
its epilogue (one more read of their bytes: [Note: expert weight gradients in the GEMM]).
Nothing is copied into the symmetric buffer (the dispatch gathers straight into it, once per
call) and nothing is summed: ``finish`` (a zero-length
event) only waits for the last push. A source's rows over send/recv cost one step of the
all-to-all (:meth:`MoECostModel.transfer_ms`). Its buffers: over the copy engine the symmetric send rows
(``A*H*e``, persistent), over send/recv the returned rows.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

from ...config import Transport
from ...planning.candidates import TILE_CHOICES
from ...sim import HardwareModel
from ..common.cost import MLPCostModel
from .ranks import LOOP_WGRAD_EXPERTS

GROUPED_WEIGHTS = "ttcc"  # the grouped GEMMs' weights: transposed views (forward), contiguous (dgrad)


class MoECostModel(MLPCostModel):
    """``rows`` = tokens per rank (the group's largest, bucketed)."""

    has_rank_chunks = True

    def __init__(self, *, tokens: int, world_size: int, hidden: int, n_in: int, ffn: int, experts: int, top_k: int,
                 elt: int, model: HardwareModel, activation: str = "swiglu", grouped: bool = False):
        super().__init__(rows=tokens, world_size=world_size, hidden=hidden, n_in=n_in, f_local=ffn, elt=elt,
                         sequence_parallel=False, model=model, activation=activation)
        self.k, self.El, self.grouped = top_k, max(experts // world_size, 1), grouped

    def gathered(self, tokens: int) -> int:
        return tokens * self.k  # assignment rows sent (and, balanced, received)

    def _rows_per_expert(self, a: int) -> int:
        return max(a // self.El, 1)

    def gemms(self, a: int) -> List[Tuple[int, int, int]]:
        """Forward (2), dgrad (2), wgrad (2) GEMM shapes (m, n, k) of ``a`` assignment rows."""
        r, H, I, F, El = self._rows_per_expert(a), self.H, self.I, self.F, self.El
        if self.grouped:
            return [(a, I, H), (a, H, F), (a, F, H), (a, H, I), (El * H, F, r), (El * I, H, r)]
        return [(r, I, H), (r, H, F), (r, F, H), (r, H, I), (H, F, r), (I, H, r)]

    def act_ops(self, tile_choices=()) -> Dict[str, Tuple[str, int]]:
        return {}  # the activation is costed by bandwidth here

    def grouped_key(self, m: int, n: int, k: int, i: int) -> str:
        """The ``op_measured`` key of GGEMM ``(m, n, k)``, the ``i``-th of :meth:`gemms` (0 gate/up,
        1 down, 2 and 3 their data gradients)."""
        return f"grouped_mm:{m},{n},{k},{self.El},{GROUPED_WEIGHTS[i]}"

    def grouped_ops(self, tile_choices=TILE_CHOICES) -> Dict[str, Tuple[int, int, int, int]]:
        """Grouped: the forward's and the data gradient's GGEMMs of every tile and piece the
        candidates cost, ``key: (m, n, k, i)`` (:meth:`grouped_key`)."""
        if not self.grouped:
            return {}
        return {self.grouped_key(*g, i): (*g, i) for a in self.row_counts(tile_choices)
                for i, g in enumerate(self.gemms(a)[:4])}

    def gemm_shapes(self, tile_choices=TILE_CHOICES) -> Set[Tuple[int, int, int]]:
        """The dense GEMMs the model prices (grouped: the weight gradients' alone; the rest are
        :meth:`grouped_ops`)."""
        first = 4 if self.grouped else 0
        return {s for a in self.row_counts(tile_choices) for s in self.gemms(a)[first:]}

    def grouped_ms(self, m: int, n: int, k: int, i: int) -> float:
        """GGEMM ``(m, n, k)``, the ``i``-th of :meth:`gemms`: measured, else the dense GEMM plus a
        read of the other El-1 experts' weights ([Note: grouped GEMMs cost more than dense ones])."""
        md = self.model
        got = md.op_measured.get(self.grouped_key(m, n, k, i))
        if got is not None:
            return got
        return md.gemm_ms(m, n, k) + (self.El - 1) * n * k * self.e / (md.mem_gbps * 1e6)

    def _pair_ms(self, a: int, first: int) -> float:
        """The two GEMMs ``gemms(a)[first:first + 2]``: grouped, two GGEMMs; else El of each."""
        md, g = self.model, self.gemms(a)
        if self.grouped:
            return sum(self.grouped_ms(*g[i], i) for i in (first, first + 1))
        return self.El * (md.gemm_ms(*g[first]) + md.gemm_ms(*g[first + 1]))

    def op_ms(self, a: int, name: str) -> float:
        gathers = self.model.mem_ms(4 * a * self.H * self.e)  # grouping the received rows by expert and back
        if name == "experts":
            return self._forward_ms(a) + gathers
        if name == "experts_bwd":
            return self._dgrad_ms(a) + self._wgrad_ms(a) + gathers
        raise KeyError(name)

    def _forward_ms(self, a: int) -> float:
        return self._pair_ms(a, 0) + self.model.mem_ms(a * (self.I + self.F) * self.e)

    def _dgrad_ms(self, a: int) -> float:
        return self._pair_ms(a, 2) + self.model.mem_ms(a * (2 * self.I + self.F) * self.e)

    def _wgrad_ms(self, a: int) -> float:
        md, g = self.model, self.gemms(a)
        return (1 if self.grouped else self.El) * (md.gemm_ms(*g[4]) + md.gemm_ms(*g[5]))

    def _piece_wgrad_ms(self, a: int, first: bool) -> float:
        """A rank piece's weight gradients ([Note: MoE weight-gradient accumulation])."""
        md = self.model
        if not self.grouped or self.El <= LOOP_WGRAD_EXPERTS:
            r, H, I, F = self._rows_per_expert(a), self.H, self.I, self.F
            return self.El * (md.gemm_ms(H, F, r) + md.gemm_ms(I, H, r))
        return self._wgrad_ms(a) + (0.0 if first else md.mem_ms(self.grad_bytes()))

    # ----------------------------------------------------------------- rank chunks (module docstring)
    def chunk_rows(self) -> int:
        """Rows from one source under balanced routing."""
        return max(self.rows * self.k // self.ws, 1)

    def transfer_ms(self, transport: str, nbytes: int) -> float:
        """One source's rows over send/recv are one step of the all-to-all (the kind NCCL runs as
        send/recv); over the copy engine, the MLP's peer copy."""
        if transport == Transport.COPY_ENGINE:
            return super().transfer_ms(transport, nbytes)
        return self.model.comm_ms("all_to_all", self.ws * nbytes) / (self.ws - 1)

    def piece_rows(self) -> Tuple[int, ...]:
        T = self.chunk_rows()
        return tuple(sorted({T, T // 2, T - T // 2} - {0})) if self.ws > 1 else ()

    def rank_pieces(self, backward: bool, tiles: int = 1,
                    transport: Transport = Transport.COPY_ENGINE
                    ) -> List[Tuple[str, str, float, int, int, int, float, float]]:
        """The pieces of ``layers/moe/ranks.py`` in launch order (the MLP's tuple layout; not
        depending on ``transport``)."""
        T = self.chunk_rows()
        half = T // 2
        if backward:
            tail = self._piece_wgrad_ms(T, first=False)
            own = ("bwd", "own", self._dgrad_ms(T) + self._piece_wgrad_ms(T, first=True), 0, 0, 0, 0.0, 1.0)
            return [own] + [("bwd", str(j), self._dgrad_ms(T) + tail, j, j, 0, tail, 1.0) for j in range(1, self.ws)]
        out = [("fwd", "own[:h]", self._forward_ms(half), 0, 0, 0, 0.0, 1.0)] if half else []
        out += [("fwd", str(j), self._forward_ms(T), j, j, 0, 0.0, 1.0) for j in range(1, self.ws)]
        return out + [("fwd", "own[h:]" if half else "own", self._forward_ms(T - half), 0, 0, 0, 0.0, 1.0)]

    def to_symmetric_ms(self, sources: int) -> float:
        return 0.0  # the dispatch gathers straight into the buffer

    def final_op(self) -> Tuple[str, float]:
        """Results come back in place: ``finish`` only waits for the last push (its gather back to
        token order runs once per call in every plan, so it is left out like the permutations)."""
        return "finish", 0.0

    def early_sum_rows(self, backward: bool, transport: str) -> int:
        return 0

    def rank_slot_bytes(self, transport: str, sources: int) -> int:
        return self.rows * self.k * self.H * self.e

    def rank_chunk_peak(self, serial_peak: int, slot_bytes: int) -> int:
        return serial_peak + slot_bytes

    def sizes(self) -> Dict[str, int]:
        H, I, F = self.H, self.I, self.F
        return {"dispatch": H, "experts": I + F + H, "combine": H, "dispatch_bwd": H, "experts_bwd": I + F + H,
                "combine_bwd": H}

    def frees(self, *, save: bool, keep_xg: bool, backward: bool) -> Dict[str, Optional[str]]:
        return {"dispatch": "experts", "experts": "combine", "combine": None, "dispatch_bwd": "experts_bwd",
                "experts_bwd": "combine_bwd", "combine_bwd": None}

    def saved_bytes(self, a: int, keep_xg: bool) -> int:
        return a * (self.H + self.I) * self.e  # the experts' graph: its input rows and activations

    def local_bytes(self) -> int:
        return self.rows * self.H * self.e

    def grad_bytes(self) -> int:
        return self.El * (self.I * self.H + self.F * self.H) * self.e
