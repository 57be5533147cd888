"""The layers' activations where autograd records them: SwiGLU through its fused kernels
(:mod:`overlap_layers.kernels.swiglu`) both ways."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.swiglu import fused_available, swiglu, swiglu_backward


class _SwiGLU(torch.autograd.Function):
    """``h`` recorded by autograd with the fused kernels both ways (first derivatives only)."""

    @staticmethod
    def forward(ctx, pre_MI):
        ctx.save_for_backward(pre_MI)
        return swiglu(pre_MI)

    @staticmethod
    def backward(ctx, dh_MF):
        (pre_MI,) = ctx.saved_tensors
        return swiglu_backward(pre_MI, dh_MF.contiguous())[0]


def swiglu_recorded(pre_MI: torch.Tensor) -> torch.Tensor:
    """``h`` for a region autograd records: fused where :func:`~overlap_layers.kernels.swiglu.fused_available`, else the eager
    formula (which also supports higher derivatives)."""
    if fused_available(pre_MI):
        return _SwiGLU.apply(pre_MI)
    gate, up = pre_MI.chunk(2, dim=-1)
    return F.silu(gate) * up
