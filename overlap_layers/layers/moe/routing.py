"""Top-k routing of the MoE: one kernel on CUDA (Triton, :mod:`overlap_layers.kernels.routing`,
whose docstring gives the reference), its torch reference elsewhere; differentiable in the logits.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ...kernels.routing import fused_available, route_fused, route_topk_reference


class _Route(torch.autograd.Function):
    """The kernel's forward with the reference's gradient (module docstring)."""

    @staticmethod
    def forward(ctx, logits, k: int, normalize: bool, shift: int):
        probs, top_p, experts, weights, keys, counts = route_fused(logits, k, normalize, shift)
        ctx.save_for_backward(probs, top_p, experts)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(experts, keys, counts)
        return probs, top_p, experts, weights, keys, counts

    @staticmethod
    def backward(ctx, g_probs, g_top_p, g_experts, g_weights, g_keys, g_counts):
        probs, top_p, experts = ctx.saved_tensors
        g_top = torch.zeros_like(top_p) if g_top_p is None else g_top_p
        if g_weights is not None:
            if ctx.normalize:
                s = top_p.sum(-1, keepdim=True)
                g_top = g_top + (g_weights - (g_weights * top_p).sum(-1, keepdim=True) / s) / s
            else:
                g_top = g_top + g_weights
        g = torch.zeros_like(probs) if g_probs is None else g_probs.clone()
        g.scatter_add_(1, experts, g_top)
        return probs * (g - (g * probs).sum(-1, keepdim=True)), None, None, None


def route_topk(logits: torch.Tensor, k: int, normalize: bool, shift: int = 0) -> Tuple[torch.Tensor, ...]:
    """``(probs [T, E], top_p [T, k], experts [T, k] int64, weights [T, k], keys [T*k], counts [E]
    int64)`` of the module reference; one kernel where :func:`fused_available` (the keys int16 for
    fewer than 2**15 experts, else int64)."""
    if not fused_available(logits):
        return route_topk_reference(logits, k, normalize, shift)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Route.apply(logits, k, normalize, shift)
    return route_fused(logits, k, normalize, shift)
