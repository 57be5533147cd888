"""Benchmark of OverlapTransformerBlock (norms, attention, MLP; sequence parallel), composed of
the attention and MLP benches of the same preset.

Modes as for the MLP (``overlap_layers.bench.mlp``): ``serial`` / ``naive`` / ``auto`` set K on
both sublayers, ``rank`` / ``rank_ce`` pin the rank-chunk plan on both; ``compute`` is the
attention's and the MLP's compute-only references run back to back, then the block's own math on
this rank's rows (:meth:`BlockBench.residual_fn`: both norms and both residual adds, and their
backward), and ``comm`` the sublayers' collectives back to back, so the limit is max(compute,
comm) of the whole block. No ``asynctp``.

[Note: the block's compute-only reference]
The reference includes the norms and residual adds: they are compute the block runs on every call
(a pass or two each over this rank's rows), so a reference without them would credit the block
with work it cannot skip. On a 4x H200 machine the block's auto runs about 0.3 ms slower than the
attention's and the MLP's auto together at llama3-8b, TP 4, 16384 tokens, and
:meth:`BlockBench.residual_fn` alone takes 0.34-0.39 ms of the 8b block's 10.6 ms reference and
0.59-0.61 of the 70b block's 36.7.

Records carry each sublayer's plan (``attention_plan``, ``mlp_plan``) and the most tiles either
cuts a call into (``tiles``: batch tiles, times the ranks for rank chunks).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..layers.block.layer import OverlapTransformerBlock
from ..planning.plan import TilePlan
from .attention import AttentionBench, AttentionShape
from .mlp import PRESETS, MLPBench, Shape
from .runner import Profile, Progress, pass_fn, run_modes, verification_info


class BlockBench:
    """The bench interface of :class:`~overlap_layers.bench.mlp.MLPBench` for the block."""

    def __init__(self, shape: AttentionShape, group, device, dtype, naive_k):
        self.attn = AttentionBench(shape, group, device, dtype, naive_k)
        ffn = PRESETS[shape.preset]["ffn"]
        self.mlp = MLPBench(Shape(shape.preset, shape.hidden, ffn, shape.batch, shape.seq,
                                  sequence_parallel=shape.sequence_parallel, transport=shape.transport,
                                  cuda_graphs=shape.cuda_graphs, graph_calls=shape.graph_calls,
                                  sm_carveout=shape.sm_carveout), group,
                            device, dtype, naive_k)
        self.layer = OverlapTransformerBlock.from_layers(self.attn.layer, self.mlp.layer)
        self.s, self.group, self.device, self.dtype, self.ws = shape, group, device, dtype, self.attn.ws
        self.x, self.dy = self.attn.x, self.attn.dy
        self.planning_ms: Optional[float] = None
        self.has_rank_chunks = shape.sequence_parallel and self.ws > 1

    def _sublayers(self):
        return (self.layer.attention, self.layer.mlp)

    def _run(self, backward: bool):
        x = self.x.detach().requires_grad_(backward)
        return pass_fn(lambda: self.layer(x, position_embeddings=self.attn.cos_sin), backward, [self.dy],
                       [x, *self.layer.parameters()])

    def layer_fn(self, k, backward: bool):
        """Both sublayers at K=``k`` (or "auto": run until both settled their first-call verification)."""
        for sub in self._sublayers():
            sub.num_tiles, sub.plan = k, None
            sub.pin_plan(None)
        run = self._run(backward)
        if k == "auto":
            for _ in range(128):  # verification: 2 calls per contender and trial, twice where disturbed
                run()
                if not self.layer.verifying:  # the sublayers' plans, then the block's (fused or in turn)
                    break
        return run

    def rank_fn(self, transport: str, backward: bool):
        for sub in self._sublayers():
            sub.plan = None
            sub.pin_plan(TilePlan(1, decomposition="rank", transport=transport))
        return self._run(backward)

    def plan_info(self) -> dict:
        a, m = (sub.plan for sub in self._sublayers())
        fused = self.layer.plan is not None and self.layer.plan.fused
        return dict(k=self.layer.plan.label if fused else f"{a.label} + {m.label}", attention_plan=a.label,
                    mlp_plan=m.label, block_plan=self.layer.plan.label if self.layer.plan else None,
                    block_reason=self.layer.plan.reason if self.layer.plan else None,
                    block_verification=verification_info(self.layer.plan), attention_verification=verification_info(a),
                    mlp_verification=verification_info(m),
                    decomposition="rank" if a.decomposition == m.decomposition == "rank" else "batch",
                    transport=a.transport if a.transport == m.transport else "mixed",
                    tiles=max(p.num_tiles * (self.ws if p.decomposition == "rank" else 1) for p in (a, m)))

    def host_overhead_us(self, backward: bool) -> dict:
        return {}

    def flops(self, backward: bool) -> float:
        """The attention's and the MLP's FLOPs (norms and residual adds left out)."""
        return self.attn.flops(backward) + self.mlp.flops(backward)

    def compute_fn(self, backward: bool):
        fa, fm, fr = self.attn.compute_fn(backward), self.mlp.compute_fn(backward), self.residual_fn(backward)
        return lambda: (fa(), fm(), fr())

    def residual_fn(self, backward: bool):
        """The block's math besides its sublayers, on this rank's rows ``x`` (no communication):
        ``h = x + a; y = h + m`` and the norms ``attn_norm(x)``, ``mlp_norm(h)`` (the block's own
        modules), with ``a`` and ``m`` standing for the sublayers' outputs (constants); backward,
        ``y``'s gradient and stand-ins for the sublayers' input gradients through both norms
        (their weights' gradients too) and the residual sums into ``x``'s gradient, as the
        block's backward does ([Note: the block's compute-only reference])."""
        L = self.layer
        x = self.x.detach().requires_grad_(backward)
        a, m, g_attn, g_mlp = (torch.randn_like(self.x) for _ in range(4))

        def forward():
            h = x + a
            return h + m, L.attn_norm(x), L.mlp_norm(h)

        norms = [p for n in (L.attn_norm, L.mlp_norm) for p in n.parameters()]
        return pass_fn(forward, backward, [self.dy, g_attn, g_mlp], [x, *norms])

    def comm_fn(self, backward: bool):
        fa, fm = self.attn.comm_fn(backward), self.mlp.comm_fn(backward)
        return lambda: (fa(), fm())

    def asynctp_fn(self, backward: bool):
        return None


def bench_shape(shape: AttentionShape, group, device, dtype, modes, passes, naive_k, warmup, iters, repeats,
                progress: Optional[Progress] = None, profile: Optional[Profile] = None,
                warm_ms: float = 0.0, peak: Optional[float] = None) -> List[dict]:
    b = BlockBench(shape, group, device, dtype, naive_k)
    fields = dict(shape.record_fields(), layer="block", ffn=b.mlp.s.ffn)
    ks = list(dict.fromkeys(b.attn.cap_k(k) for k in naive_k))
    return run_modes(b, fields, [m for m in modes if m not in ("asynctp", "reference")], passes, ks, warmup, iters,
                     repeats, progress, profile, warm_ms, peak)
