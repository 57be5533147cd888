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
dgrad_qkv   GEMM (M, H, C)                            dx gathered, M*H*e (wait_rs_dx)
wgrad_o     GEMM (H, A, M); wgrad_qkv GEMM (C, H, M)
==========  ========================================  ====================================

[Note: causal rank-chunk cost]
The causal rank-chunk plan (``attention_causal.py``) runs, per batch tile of b sequences and per
chunk q, one piece: qkv and proj GEMMs of the tile's ``b*s`` rows (forward), or dgrad_o, wgrad_o,
dgrad_qkv and wgrad_qkv (backward), plus the chunk's core. Chunk q's queries meet ``(q+1)*s``
keys under a causal mask, ``(2q+1)/ws^2`` of the whole core's work: its core costs that share of
the tile's chunk cores, measured as one op (``"core_chunks:bxS"``, and ``"core_chunks_bwd:bxS"``:
the chunks' prefix kernels need not run as fast as the whole core's; on H200 with torch 2.11 the
lower-right causal SDPA is flash-attention 2, half the speed of the cuDNN kernel the whole causal
core gets), else that share of the whole core plus three launches (the prefix concatenations
and the output's transpose). It is costed by the rank-chunk recurrence ([Note: rank-chunk
cost]) with the pulls in the chunks' order of use, which depends on the rank: the prediction is
the slowest rank's, the same number on every rank.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..sim import HardwareModel, Timeline
from ..sim.simulator import Event, timeline_from_events
from .attention_causal import pull_order
from .candidates import TILE_CHOICES
from .mlp_cost import MLPCostModel
from .tiling import tile_bounds


class AttentionCostModel(MLPCostModel):
    """Tiles are batch rows (``rows`` = batch); see the module table."""

    def __init__(self, *, batch: int, seq_local: int, world_size: int, hidden: int, heads: int, kv_heads: int,
                 head_dim: int, elt: int, sequence_parallel: bool, causal: bool, model: HardwareModel):
        d = head_dim
        super().__init__(rows=batch, world_size=world_size, hidden=hidden, n_in=(heads + 2 * kv_heads) * d,
                         f_local=heads * d, elt=elt, sequence_parallel=sequence_parallel, model=model)
        self.s, self.nq, self.d, self.causal = seq_local, heads, d, causal
        self.g = world_size if sequence_parallel else 1

    @property
    def C(self) -> int:
        return self.I

    @property
    def A(self) -> int:
        return self.F

    def gathered(self, batch_rows: int) -> int:
        return batch_rows * self.s * self.g

    def core_key(self, name: str, b: int) -> str:
        return f"{name}:{b}x{self.g * self.s}"

    def core_ops(self, tile_choices=TILE_CHOICES) -> Dict[str, Tuple[str, int]]:
        """Key -> (name, batch rows) of every core op the candidates run (for measuring)."""
        sizes = {b - a for k in tile_choices for a, b in tile_bounds(self.rows, k)}
        return {self.core_key(name, b): (name, b) for b in sizes for name in ("core", "core_bwd")}

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
        """Batch tile counts of the rank-chunk candidates: 1 (the core on all rows at once) and, for
        a causal layer, 2 and 4 as the batch allows (``attention_causal.py``)."""
        if not self.causal:
            return (1,)
        return tuple(sorted({min(k, self.rows) for k in (1, 2, 4)}))

    def piece_rows(self) -> Tuple[int, ...]:
        if not (self.sp and self.ws > 1):
            return ()
        return tuple(sorted({(b - a) * self.s for k in self.rank_tiles() for a, b in tile_bounds(self.rows, k)}))

    def chunk_core_ops(self) -> Dict[str, Tuple[str, int]]:
        """Key -> (name, batch rows) of the causal plan's chunk cores (for measuring)."""
        sizes = {b - a for k in self.rank_tiles() if k > 1 for a, b in tile_bounds(self.rows, k)}
        return {self.core_key(name, b): (name, b) for b in sizes for name in ("core_chunks", "core_chunks_bwd")}

    def _causal_piece_ms(self, b: int, q: int, backward: bool) -> float:
        """One piece of the causal plan: tile of b sequences, chunk q ([Note: causal rank-chunk cost])."""
        m, share = b * self.s, (2 * q + 1) / self.ws ** 2
        measured = self.model.op_measured.get(self.core_key("core_chunks_bwd" if backward else "core_chunks", b))
        if measured is not None:
            core = measured * share
        else:
            core = self.op_ms(self.gathered(b), "core_bwd" if backward else "core") * share + 3 * self.model.launch_ms
        gemms = ("dgrad_o", "wgrad_o", "dgrad_qkv", "wgrad_qkv") if backward else ("qkv", "proj")
        return core + sum(self.op_ms(m, op) for op in gemms)

    def _causal_timeline(self, *, backward: bool, transport: str, sources: int, tiles: int, rank: int) -> Timeline:
        md, ws = self.model, self.ws
        ce = transport == "copy_engine"
        slow = 1.0 if ce else md.interference
        signal = md.op_ms("signal", 0) if ce else 0.0
        bounds = tile_bounds(self.rows, tiles)
        chunk = self.chunk_bytes()
        events = []

        def add(name, tag, stream, start, ms):
            events.append(Event(name, tag, stream, start, start + ms))
            return start + ms

        def transfer(i):
            b0, b1 = bounds[i]
            return self.transfer_ms(transport, chunk) * (b1 - b0) / self.rows

        t = add("to_symmetric", 0, "compute0", 0.0, sources * md.mem_ms(2 * chunk)) if ce else md.launch_ms
        pulled, done = {}, t + signal
        order = pull_order(rank, ws, len(bounds), backward) if ce else \
            [(j, i) for i in range(len(bounds)) for j in range(1, ws)]  # send/recv: posted in step order
        for j, i in order:
            done = pulled[j, i] = add("pull", f"{i}.{j}", "comm", done, sources * transfer(i))
        pushed = 0.0
        for i, (b0, b1) in enumerate(bounds):
            for q in (range(ws - 1, -1, -1) if backward else range(ws)):
                j = (q - rank) % ws
                t = add("chunk_bwd" if backward else "chunk", f"{i}.{q}", "compute0", max(t, pulled.get((j, i), 0.0)),
                        self._causal_piece_ms(b1 - b0, q, backward) * slow)
                if j:
                    pushed = add("push", f"{i}.{j}", "comm", max(pushed, t), transfer(i))
        add("sum", 0, "compute0", max(t, pushed + signal), md.mem_ms((ws + 1) * chunk))
        return timeline_from_events(events, ["compute0", "comm"])

    def rank_chunk_timeline(self, *, backward: bool, transport: str, sources: int, tiles: int = 1) -> Timeline:
        """With ``tiles > 1`` the causal plan's slowest rank ([Note: causal rank-chunk cost]), else
        the all-rows plan's."""
        if tiles == 1:
            return super().rank_chunk_timeline(backward=backward, transport=transport, sources=sources)
        lines = [self._causal_timeline(backward=backward, transport=transport, sources=sources, tiles=tiles, rank=r)
                 for r in range(self.ws)]
        return max(lines, key=lambda tl: tl.makespan_ms)

    def rank_pieces(self, backward: bool) -> List[Tuple[str, str, float, int, int]]:
        """Own rows' projection, the pulled peers', the core on all rows, the peers' projections
        (pushed), the own rows' last (``_RankChunkAttention``)."""
        T, ws, M = self.chunk_rows(), self.ws, self.gathered(self.rows)
        first, core, last = (("dgrad_o", "wgrad_o"), "core_bwd", ("dgrad_qkv", "wgrad_qkv")) if backward else \
            (("qkv",), "core", ("proj",))

        def ms(ops):
            return sum(self.op_ms(T, op) for op in ops)
        peers = range(1, ws)
        return ([(first[0], "own", ms(first), 0, 0)] + [(first[0], str(j), ms(first), j, 0) for j in peers]
                + [(core, "all", self.op_ms(M, core), 0, 0)]
                + [(last[0], str(j), ms(last), 0, j) for j in peers] + [(last[0], "own", ms(last), 0, 0)])

    def rank_chunk_peak(self, serial_peak: int, slot_bytes: int, training: bool = False, tiles: int = 1) -> int:
        """The serial plan's peak plus the slots, minus the serial gathered partial (``[ws*T, H]``)
        that one chunk's partial replaces; the causal plan (``tiles > 1``) saves for backward each
        chunk's key and value prefix (``ws*(ws+1)/2`` chunks of k and v instead of ws)."""
        extra = 0
        if tiles > 1 and training:
            kv = self.C - self.A  # the k and v widths
            extra = (self.ws * (self.ws + 1) // 2 - self.ws) * self.chunk_rows() * kv * self.e
        return serial_peak + slot_bytes + extra - (self.ws - 1) * self.chunk_rows() * self.H * self.e

    def saved_bytes(self, m: int, keep_xg: bool) -> int:
        return (m * (2 * self.C + self.A) + (m * self.H if keep_xg else 0)) * self.e
