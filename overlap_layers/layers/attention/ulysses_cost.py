"""Costs of the Ulysses layer's tile programs (the MLP's cost model with Ulysses' ops).

Tiles are batch rows, or, for batch 1, groups of each rank's query heads ([Note: tiles] in
``layers/attention/ulysses.py``); a tile's "units" are its batch rows or its heads. Per tile: b batch rows, nh
query heads per rank, hk the KV heads they read, t = b*s local tokens, S = ws*s,
W = ws*(nh + 2*hk)*d the qkv rows sent (and received), F = ws*nh*d the attention features,
e bytes per element:

=========  ========================================  ==================================
op         time                                      memory allocated (freed after)
=========  ========================================  ==================================
qkv        GEMM (W, t, H)                            send, W*t*e (a2a_qkv)
a2a_qkv    all-to-all of W*t*e                       recv, W*t*e (core; the graph's leaf)
core       measured ("ucore:bxSxnh"), else SDPA      o, F*t*e (a2a_o)
           FLOPs 4*b*nh*S^2*d (halved if causal)
a2a_o      all-to-all of F*t*e                       oT, F*t*e (out_proj; saved)
out_proj   GEMM (t, H, F)
dgrad_o    GEMM (F, t, H)                            do, F*t*e (a2a_do)
a2a_do     all-to-all of F*t*e                       dout, F*t*e (core_bwd)
wgrad_o    GEMM (H, F, t)
core_bwd   measured ("ucore_bwd:..."), else 2.5x     drecv, W*t*e (a2a_dqkv)
a2a_dqkv   all-to-all of W*t*e                       dsend, W*t*e (wgrad_qkv)
dgrad_x    GEMM (t, H, W);  wgrad_qkv GEMM (W, H, t)
=========  ========================================  ==================================
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ...planning.candidates import TILE_CHOICES
from ...planning.tiling import tile_bounds
from ...sim import HardwareModel
from ..common.cost import MLPCostModel


class UlyssesCostModel(MLPCostModel):
    """``rows`` = the tile units (batch rows, or local query heads when ``by_heads``)."""

    has_rank_chunks = False

    def __init__(self, *, batch: int, seq_local: int, world_size: int, hidden: int, heads: int, kv_heads: int,
                 head_dim: int, elt: int, causal: bool, model: HardwareModel):
        ws = world_size
        self.by_heads = batch == 1
        self.B, self.s, self.nq, self.nkv, self.d, self.causal = batch, seq_local, heads, kv_heads, head_dim, causal
        self.hq, self.ws = heads // ws, ws
        super().__init__(rows=self.hq if self.by_heads else batch, world_size=ws, hidden=hidden,
                         n_in=self._W(self.hq), f_local=ws * self.hq * head_dim, elt=elt, sequence_parallel=False,
                         model=model)

    # ----------------------------------------------------------------- tile geometry
    def _hk(self, nh: int) -> int:
        return max(1, nh * self.nkv // self.nq)

    def _W(self, nh: int) -> int:
        return self.ws * (nh + 2 * self._hk(nh)) * self.d

    def _tile(self, m: int) -> Tuple[int, int, int, int]:
        """(b, nh, t, W) of a tile of ``m`` units (module legend)."""
        b, nh = (self.B, m) if self.by_heads else (m, self.hq)
        return b, nh, b * self.s, self._W(nh)

    def gathered(self, units: int) -> int:
        return units

    def core_key(self, name: str, m: int) -> str:
        b, nh, _, _ = self._tile(m)
        return f"u{name}:{b}x{self.ws * self.s}x{nh}:kv{self._hk(nh)}d{self.d}:{'causal' if self.causal else 'full'}"

    def core_ops(self, tile_choices=TILE_CHOICES) -> Dict[str, Tuple[str, int, int]]:
        """Key -> (name, batch rows, heads) of every core op the candidates run (for measuring)."""
        out = {}
        for m in {b - a for k in tile_choices for a, b in tile_bounds(self.rows, k)}:
            b, nh, _, _ = self._tile(m)
            for name in ("core", "core_bwd"):
                out[self.core_key(name, m)] = (name, b, nh)
        return out

    def gemms(self, m: int) -> List[Tuple[int, int, int]]:
        b, nh, t, W = self._tile(m)
        F, H = self.ws * nh * self.d, self.H
        return [(W, t, H), (t, H, F), (F, t, H), (H, F, t), (t, H, W), (W, H, t)]

    # ----------------------------------------------------------------- time
    def _core_ms(self, m: int) -> float:
        md = self.model
        b, nh, t, W = self._tile(m)
        S = self.ws * self.s
        flops = 4.0 * b * nh * S * S * self.d * (0.5 if self.causal else 1.0)
        return md.gemm_fixed_ms + flops / (md.gemm_tflops * 1e9) + md.mem_ms(3 * W * t * self.e)

    def op_ms(self, m: int, name: str) -> float:
        md = self.model
        if name == "core":
            return md.op_measured.get(self.core_key("core", m), self._core_ms(m))
        if name == "core_bwd":
            return md.op_measured.get(self.core_key("core_bwd", m), 2.5 * self._core_ms(m))
        b, nh, t, W = self._tile(m)
        F, H = self.ws * nh * self.d, self.H
        shapes = {"qkv": (W, t, H), "out_proj": (t, H, F), "dgrad_o": (F, t, H), "wgrad_o": (H, F, t),
                  "dgrad_x": (t, H, W), "wgrad_qkv": (W, H, t)}
        return md.gemm_ms(*shapes[name])

    # ----------------------------------------------------------------- bytes
    def comm_bytes(self, m: int, name: str) -> int:
        b, nh, t, W = self._tile(m)
        width = W if name in ("a2a_qkv", "a2a_dqkv") else self.ws * nh * self.d
        return width * t * self.e

    def op_bytes(self, m: int, name: str) -> int:
        b, nh, t, W = self._tile(m)
        F = self.ws * nh * self.d
        width = {"qkv": W, "a2a_qkv": W, "core": F, "a2a_o": F, "dgrad_o": F, "a2a_do": F, "core_bwd": W,
                 "a2a_dqkv": W}.get(name, 0)
        return width * t * self.e

    def frees(self, *, save: bool, keep_xg: bool, backward: bool) -> Dict[str, Optional[str]]:
        keep = save and not backward
        return {"qkv": "a2a_qkv", "a2a_qkv": None if keep else "core", "core": "a2a_o",
                "a2a_o": None if keep else "out_proj", "dgrad_o": "a2a_do", "a2a_do": "core_bwd",
                "core_bwd": "a2a_dqkv", "a2a_dqkv": "wgrad_qkv"}

    def saved_bytes(self, m: int, keep_xg: bool) -> int:
        """recv (the graph's leaf), the graph's o and roped q/k, and oT."""
        b, nh, t, W = self._tile(m)
        return (2 * W + 2 * self.ws * nh * self.d) * t * self.e

    def local_bytes(self) -> int:
        return self.B * self.s * self.H * self.e

    def grad_bytes(self) -> int:
        return (self._W(self.hq) * self.H + self.H * self.ws * self.hq * self.d) * self.e
