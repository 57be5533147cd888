"""Costs of the MoE layer's tile programs (the MLP's cost model with the MoE's ops).

The plan is made before routing, from numbers every rank shares: the largest token count of the
group (bucketed) and balanced routing, so each rank sends and receives A = m*k assignment rows
for a tile of m tokens, spread evenly over its El local experts (r = A/El rows each). H hidden,
I expert fc1 width (2*ffn for swiglu), F = ffn, e bytes per element:

===========  ===========================================  ==============================
op           time                                         memory allocated (freed after)
===========  ===========================================  ==============================
dispatch     all-to-all of A*H*e                          received rows, A*H*e (experts)
experts      El x (GEMM (r, I, H) + GEMM (r, H, F))       act and out, A*(I+F+H)*e (combine)
             + memory A*(I+F)*e
combine      all-to-all of A*H*e                          combined rows, A*H*e (kept: the output)
dispatch_bwd all-to-all of A*H*e                          A*H*e (experts_bwd)
experts_bwd  El x (2 GEMMs dgrad + 2 GEMMs wgrad) + act'  A*(I+F+H)*e (combine_bwd)
combine_bwd  all-to-all of A*H*e
===========  ===========================================  ==============================

Routing, the permutation and the weighted combine run once per call whatever K is, so they are
left out (they do not change the choice).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..sim import HardwareModel
from .mlp_cost import MLPCostModel


class MoECostModel(MLPCostModel):
    """``rows`` = tokens per rank (the group's largest, bucketed)."""

    def __init__(self, *, tokens: int, world_size: int, hidden: int, n_in: int, ffn: int, experts: int, top_k: int,
                 elt: int, model: HardwareModel, activation: str = "swiglu"):
        super().__init__(rows=tokens, world_size=world_size, hidden=hidden, n_in=n_in, f_local=ffn, elt=elt,
                         sequence_parallel=False, model=model, activation=activation)
        self.k, self.El = top_k, max(experts // world_size, 1)

    def gathered(self, tokens: int) -> int:
        return tokens * self.k  # assignment rows sent (and, balanced, received)

    def _rows_per_expert(self, a: int) -> int:
        return max(a // self.El, 1)

    def gemms(self, a: int) -> List[Tuple[int, int, int]]:
        r, H, I, F = self._rows_per_expert(a), self.H, self.I, self.F
        return [(r, I, H), (r, H, F), (r, F, H), (r, H, I), (H, F, r), (I, H, r)]

    def act_ops(self, tile_choices=()) -> Dict[str, Tuple[str, int]]:
        return {}  # the activation is costed by bandwidth here

    def op_ms(self, a: int, name: str) -> float:
        md, H, I, F, e = self.model, self.H, self.I, self.F, self.e
        r = self._rows_per_expert(a)
        if name == "experts":
            return self.El * (md.gemm_ms(r, I, H) + md.gemm_ms(r, H, F)) + md.mem_ms(a * (I + F) * e)
        if name == "experts_bwd":
            gemms = md.gemm_ms(r, F, H) + md.gemm_ms(r, H, I) + md.gemm_ms(H, F, r) + md.gemm_ms(I, H, r)
            return self.El * gemms + md.mem_ms(a * (2 * I + F) * e)
        raise KeyError(name)

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
