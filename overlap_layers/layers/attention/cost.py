"""Costs of the attention layer's tile programs (the MLP's cost model with attention's ops).

Per tile of b sequences: M = g*b*s gathered rows (g = ws with sequence parallelism, else 1;
s the local sequence), S = g*s, H hidden, C = (nq + 2*nkv)*d the local qkv width, A = nq*d the
local attention width, e bytes per element:

==========  ========================================  ====================================
op          time                                      memory allocated (freed after)
==========  ========================================  ====================================
ag / ag_x   collective over M*H*e                     xg, M*H*e (qkv / wgrad_qkv; kept if saved)
qkv         GEMM (M, C, H)                            qkv, M*C*e (core; kept as the graph's leaf)
core        measured ("core:bxS"), else SDPA FLOPs    o and the roped q, k: M*(A+C)*e (proj;
            4*b*nq*S^2*d (halved if causal) + memory  kept for backward when saving)
proj        GEMM (M, H, A)                            partial out, M*H*e (wait_rs)
rs / ar     collective over M*H*e
ag_dy       collective over M*H*e                     dy gathered, M*H*e (wgrad_o)
dgrad_o     GEMM (M, A, H)                            do, M*A*e (core_bwd)
core_bwd    measured ("core_bwd:bxS"), else 2.5x core dqkv, M*C*e (wgrad_qkv)
heads       measured ("heads:bxS"), else memory-bound   (part of core: RoPE and head layout; rank
            M*C*e read and written                    chunks run 1/ws of it per pulled chunk)
chunk{c}    measured ("chunk{c}:bxS"), else core's    (rank chunks with query chunks: rank c's
            share ((2c+1)/ws^2 causal, 1/ws not)      rows of the core, before their projection)
dgrad_qkv   GEMM (M, H, C)                            dx gathered, M*H*e (wait_rs_dx)
wgrad_o     GEMM (H, A, M); wgrad_qkv GEMM (C, H, M)
==========  ========================================  ====================================
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ...config import Transport
from ...planning.candidates import TILE_CHOICES
from ...planning.tiling import tile_bounds
from ...runtime.exchange import block_tag
from ...sim import HardwareModel
from ..common.cost import MLPCostModel
from ..common.rank_chunks import step_tag


class AttentionCostModel(MLPCostModel):
    """Tiles are batch rows (``rows`` = batch); see the module table."""

    def __init__(self, *, batch: int, seq_local: int, world_size: int, hidden: int, heads: int, kv_heads: int,
                 head_dim: int, elt: int, sequence_parallel: bool, causal: bool, model: HardwareModel,
                 chunked_heads: bool = False, query_chunks: bool = False):
        d = head_dim
        super().__init__(rows=batch, world_size=world_size, hidden=hidden, n_in=(heads + 2 * kv_heads) * d,
                         f_local=heads * d, elt=elt, sequence_parallel=sequence_parallel, model=model)
        self.s, self.nq, self.nkv, self.d, self.causal = seq_local, heads, kv_heads, d, causal
        self.g = world_size if sequence_parallel else 1
        self.chunked_heads = chunked_heads  # rank chunks run the core's heads step chunk by chunk (no qk-norm)
        self.query_chunks = query_chunks  # rank chunks run the core by query chunks ([Note: query-chunk core])

    @property
    def C(self) -> int:
        return self.I

    @property
    def A(self) -> int:
        return self.F

    def gathered(self, batch_rows: int) -> int:
        return batch_rows * self.s * self.g

    def core_key(self, name: str, b: int) -> str:
        """The measured-op key of the core (``"core"``, ``"core_bwd"``, its ``"heads"`` step or query
        chunk ``"chunk{c}"``) over ``b`` sequences: everything its time depends on (the calibration
        cache holds every layer's keys: ``"core:2x8192:q8kv2d128:causal"``)."""
        return f"{name}:{b}x{self.g * self.s}:q{self.nq}kv{self.nkv}d{self.d}:{'causal' if self.causal else 'full'}"

    def core_ops(self, tile_choices=TILE_CHOICES) -> Dict[str, Tuple[str, int]]:
        """Key -> (name, batch rows) of every core op the candidates run (for measuring)."""
        sizes = {b - a for k in tile_choices for a, b in tile_bounds(self.rows, k)}
        names = ("core", "core_bwd") + (("heads",) if self.chunked_heads else ()) + \
            (tuple(f"chunk{c}" for c in range(self.g)) if self.query_chunks else ())
        return {self.core_key(name, b): (name, b) for b in sizes for name in names}

    def gemms(self, m: int) -> List[Tuple[int, int, int]]:
        H, C, A = self.H, self.C, self.A
        return [(m, C, H), (m, H, A), (m, A, H), (m, H, C), (H, A, m), (C, H, m)]

    def _core_ms(self, b: int) -> float:
        md, S = self.model, self.g * self.s
        flops = 4.0 * b * self.nq * S * S * self.d * (0.5 if self.causal else 1.0)
        return md.gemm_fixed_ms + flops / (md.gemm_tflops * 1e9) + md.mem_ms(3 * b * S * self.C * self.e)

    def op_ms(self, m: int, name: str) -> float:
        md, H, C, A = self.model, self.H, self.C, self.A
        b = m // (self.g * self.s)
        if name == "core":
            return md.op_measured.get(self.core_key("core", b), self._core_ms(b))
        if name == "core_bwd":
            return md.op_measured.get(self.core_key("core_bwd", b), 2.5 * self._core_ms(b))
        if name == "heads":
            return md.op_measured.get(self.core_key("heads", b), md.mem_ms(2 * m * C * self.e))
        if name.startswith("chunk"):
            c, g = int(name[5:]), self.g
            share = (2 * c + 1) / (g * g) if self.causal else 1 / g
            return md.op_measured.get(self.core_key(name, b), share * (self._core_ms(b) - md.gemm_fixed_ms)
                                      + md.gemm_fixed_ms)
        shapes = {"qkv": (m, C, H), "proj": (m, H, A), "dgrad_o": (m, A, H), "dgrad_qkv": (m, H, C),
                  "wgrad_o": (H, A, m), "wgrad_qkv": (C, H, m)}
        return md.gemm_ms(*shapes[name])

    def sizes(self) -> Dict[str, int]:
        H, C, A = self.H, self.C, self.A
        return {"ag": H, "ag_x": H, "qkv": C, "core": A + C, "proj": H if self.sp else 0, "ag_dy": H,
                "dgrad_o": A, "core_bwd": C, "dgrad_qkv": H if self.sp else 0}

    def frees(self, *, save: bool, keep_xg: bool, backward: bool) -> Dict[str, Optional[str]]:
        keep = save and not backward
        return {"ag": None if keep_xg else "qkv", "qkv": None if keep else "core", "core": None if keep else "proj",
                "proj": "wait_rs", "ag_dy": "wgrad_o", "ag_x": "wgrad_qkv", "dgrad_o": "core_bwd",
                "core_bwd": "wgrad_qkv", "dgrad_qkv": "wait_rs_dx"}

    # ----------------------------------------------------------------- rank chunks ([Note: rank-chunk cost])
    def chunk_rows(self) -> int:
        return self.rows * self.s

    def rank_tiles(self) -> Tuple[int, ...]:
        """Batch tile counts of the rank-chunk candidates: 1, 2 and 4, as the batch allows."""
        return tuple(sorted({min(k, self.rows) for k in (1, 2, 4)}))

    def rank_blocks(self, tiles: int) -> List[Tuple[int, int]]:
        return tile_bounds(self.rows, tiles)

    def piece_rows(self) -> Tuple[int, ...]:
        """Row counts of the pieces: each tile's, and the halves of the last one's (its halved last
        push)."""
        if not (self.sp and self.ws > 1):
            return ()
        rows = {(b - a) * self.s for k in self.rank_tiles() for a, b in tile_bounds(self.rows, k)}
        last = {(b - a) * self.s for k in self.rank_tiles() for a, b in tile_bounds(self.rows, k)[-1:]}
        return tuple(sorted(rows | {r // 2 for r in last} | {r - r // 2 for r in last}))

    def diagonal_first(self, transport: str) -> bool:
        """Whether a rank-chunk forward runs each causal query chunk's diagonal piece in its QKV
        piece ([Note: query-chunk core]): where one chunk's transfer over ``transport`` outlasts its
        QKV projection, so that the QKV pieces would wait for the pulls; elsewhere the diagonal
        pieces' outputs would only be held from the QKV pieces to the projections (the llama3-70b
        shape: 50 MiB more, no faster). Not a collective decision: the exchange is the same."""
        if not (self.query_chunks and self.causal and self.sp and self.ws > 1):
            return False
        return self.transfer_ms(transport, self.chunk_bytes()) > self.op_ms(self.chunk_rows(), "qkv")

    def rank_pieces(self, backward: bool, tiles: int = 1,
                    transport: Transport = Transport.COPY_ENGINE
                    ) -> List[Tuple[str, str, float, int, int, int, float, float]]:
        """Per batch tile: own rows' projection, the pulled peers', the core on the tile's rows,
        the peers' projections (pushed; backward, the QKV weight gradient after the push is the
        tail, or with one tile a piece of its own over every gathered row after the own rows'),
        the own rows' last (``RankChunkAttention``). With ``chunked_heads`` each forward
        chunk also runs 1/ws of the core's heads step, and the core the rest. With
        ``query_chunks`` the forward has no core piece: each projection piece runs its rows'
        query chunk first, as rank 0 does (its own chunk, the cheapest of a causal core, comes
        last and leaves the most of its last push exposed: the slowest rank sets the sum); where
        :meth:`diagonal_first` (over ``transport``), the chunk's diagonal piece runs in its QKV
        piece instead, priced as chunk 0 (which is its diagonal piece alone), and the projection
        piece keeps the rest. The last tile's last peer piece runs in two halves of its rows, each
        pushing its half (the halved last push); the weight gradient, if any, after the second."""
        ws, out = self.ws, []
        first, core, last = (("dgrad_o", "wgrad_o"), "core_bwd", ("dgrad_qkv", "wgrad_qkv")) if backward else \
            (("qkv",), "core", ("proj",))
        bounds = tile_bounds(self.rows, tiles)
        for i, (b0, b1) in enumerate(bounds):
            T = (b1 - b0) * self.s

            def ms(ops):
                return sum(self.op_ms(T, op) for op in ops)
            M = self.gathered(b1 - b0)
            heads = self.op_ms(M, "heads") if self.chunked_heads and not backward else 0.0

            def tag(j):
                return step_tag(j, i, len(bounds))
            peers = range(1, ws)
            whole = backward and len(bounds) == 1  # the QKV weight gradient over every row, last
            tail = 0.0 if whole else ms(last[1:])
            dgrad = ms(last[:1]) if whole else ms(last)
            by_query = self.query_chunks and not backward

            diag = self.op_ms(M, "chunk0") if by_query and self.diagonal_first(transport) else 0.0

            def chunk(j):  # rank 0's step j projects rank j's rows
                return self.op_ms(M, f"chunk{j}") - diag if by_query else 0.0

            def project(j):  # step j's pieces: the last tile's last peer in halves ([Note: halved last push])
                if j != ws - 1 or i != len(bounds) - 1 or T < 2:
                    return [(last[0], tag(j), chunk(j) + dgrad, 0, j, i, tail, 1.0)]
                h = T // 2
                return [(last[0], step_tag(j, i, len(bounds), 0), chunk(j) + self.op_ms(h, last[0]), 0, j, i, 0.0,
                         h / T),
                        (last[0], step_tag(j, i, len(bounds), 1), self.op_ms(T - h, last[0]) + tail, 0, j, i, tail,
                         (T - h) / T)]
            out += ([(first[0], tag(0), ms(first) + heads / ws + diag, 0, 0, i, 0.0, 1.0)]
                    + [(first[0], tag(j), ms(first) + heads / ws + diag, j, 0, i, 0.0, 1.0) for j in peers]
                    + ([] if by_query else [(core, block_tag(i, "all", len(bounds)), self.op_ms(M, core) - heads,
                                             0, 0, i, 0.0, 1.0)])
                    + [p for j in peers for p in project(j)]
                    + [(last[0], tag(0), chunk(0) + dgrad, 0, 0, i, tail, 1.0)])
            if whole:
                wgrad = self.op_ms(M, last[1])
                out.append((last[1], block_tag(i, "all", 1), wgrad, 0, 0, i, wgrad, 1.0))
        return out

    def early_sum_rows(self, backward: bool, transport: str) -> int:
        """Backward over the copy engine, all rows: summed once the last tile's own dgrad has
        written its rows, beside that piece's QKV weight gradient. Forward none: the last piece is
        the own rows' projection, the sum needs it."""
        return self.chunk_rows() if backward and transport == Transport.COPY_ENGINE else 0

    def early_sum_waits_own(self, backward: bool) -> bool:
        return True

    def rank_chunk_peak(self, serial_peak: int, slot_bytes: int) -> int:
        """The serial plan's peak plus the slots, minus the serial gathered partial (``[ws*T, H]``)
        that one chunk's partial replaces."""
        return serial_peak + slot_bytes - (self.ws - 1) * self.chunk_rows() * self.H * self.e

    def saved_bytes(self, m: int, keep_xg: bool) -> int:
        return (m * (2 * self.C + self.A) + (m * self.H if keep_xg else 0)) * self.e
