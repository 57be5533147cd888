"""The layers' activations (the MLP's and the MoE experts'): :func:`act` and :func:`act_backward`,
SwiGLU through its fused kernels (:mod:`overlap_layers.kernels.swiglu`), also where autograd
records it (:func:`swiglu_recorded`).

Reference, per kind, of ``pre [M, I]`` (a gated kind's ``pre`` is ``[gate | up]``, ``I = 2F``):

==============  ==========================================================
``swiglu``      ``silu(gate) * up``
``geglu_tanh``  ``gelu(gate, approximate="tanh") * up`` (Gemma's MLP)
``gelu``        ``gelu(pre)`` (exact)
``relu``        ``relu(pre)``
==============  ==========================================================
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...kernels.swiglu import fused_available, swiglu, swiglu_backward, swiglu_reference
from ...kernels.triton_gate import worth_launching
from ...planning.first_order import first_order


class _SwiGLU(torch.autograd.Function):
    """``h`` recorded by autograd with the fused kernels both ways (first derivatives only)."""

    @staticmethod
    def forward(ctx, pre_MI):
        ctx.save_for_backward(pre_MI)
        return swiglu(pre_MI)

    @staticmethod
    @first_order  # [Note: first-order backward]: the fused kernel's gradient carries no graph
    def backward(ctx, dh_MF):
        (pre_MI,) = ctx.saved_tensors
        return swiglu_backward(pre_MI, dh_MF.contiguous())[0]


def swiglu_recorded(pre_MI: torch.Tensor) -> torch.Tensor:
    """``h`` for a region autograd records: fused where
    :func:`~overlap_layers.kernels.swiglu.fused_available` and the launch pays
    (:func:`~overlap_layers.kernels.triton_gate.worth_launching`), else the eager formula (which
    also supports higher derivatives)."""
    if fused_available(pre_MI) and worth_launching(pre_MI):
        return _SwiGLU.apply(pre_MI)
    gate, up = pre_MI.chunk(2, dim=-1)
    return F.silu(gate) * up


ACTIVATIONS = ("swiglu", "geglu_tanh", "gelu", "relu")
GATED = ("swiglu", "geglu_tanh")  # fc1 rows: gate rows, then up rows


def gated(kind: str) -> bool:
    """Whether ``kind`` is gated: fc1 is twice the ffn width (gate rows, then up rows)."""
    return kind in GATED


def _geglu_tanh_backward(pre_MI: torch.Tensor, dh_MF: torch.Tensor):
    """``(d(loss)/d(pre), act(pre))`` of ``geglu_tanh``."""
    gate, up = pre_MI.chunk(2, dim=-1)
    g = F.gelu(gate, approximate="tanh")
    dpre = torch.cat([torch.ops.aten.gelu_backward(dh_MF * up, gate, approximate="tanh"), dh_MF * g], dim=-1)
    return dpre, g * up


def act(kind: str, pre_MI: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(pre); swiglu runs fused on CUDA (``kernels/swiglu.py``) where the launch pays
    (:func:`~overlap_layers.kernels.triton_gate.worth_launching`: a decoding step's few rows take
    the eager formula, whose launches cost the host less), without autograd on the first ``rows``
    rows only where given (a count on the device; the other rows are then unwritten)."""
    if kind == "swiglu":
        if torch.is_grad_enabled() and pre_MI.requires_grad:
            return swiglu_recorded(pre_MI)
        if rows is None and not worth_launching(pre_MI):
            return swiglu_reference(pre_MI)
        return swiglu(pre_MI, rows)
    if kind == "geglu_tanh":
        gate, up = pre_MI.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    if kind == "gelu":
        return F.gelu(pre_MI)
    return F.relu(pre_MI)


def act_backward(kind: str, pre_MI: torch.Tensor, dh_MF: torch.Tensor, out: Optional[torch.Tensor] = None,
                  h_out: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None):
    """``(d(loss)/d(pre), act(pre))`` given d(loss)/d(act(pre)): the backward also hands back the
    activation the weight gradient of fc2 needs (for swiglu both come from one fused pass). The
    first into ``out`` if given, which may be ``pre_MI`` (overwritten only after it is read), the
    second into ``h_out`` if given. ``rows``: as :func:`act`'s (swiglu's fused kernel then leaves
    the rows past it unwritten; the others compute every row)."""
    if kind == "swiglu":
        return swiglu_backward(pre_MI, dh_MF, out, h_out, rows)
    if kind == "geglu_tanh":
        dpre, act = _geglu_tanh_backward(pre_MI, dh_MF)
        if h_out is not None:
            act = h_out.copy_(act)
        return (dpre if out is None else out.copy_(dpre)), act
    aten, gelu = torch.ops.aten, kind == "gelu"
    if h_out is None:
        act = F.gelu(pre_MI) if gelu else F.relu(pre_MI)
    else:  # before ``out``, which may be pre_MI, is written
        act = aten.gelu.out(pre_MI, out=h_out) if gelu else torch.clamp(pre_MI, min=0, out=h_out)
    if out is None:
        return (aten.gelu_backward(dh_MF, pre_MI) if gelu else aten.threshold_backward(dh_MF, pre_MI, 0)), act
    return (aten.gelu_backward.grad_input(dh_MF, pre_MI, grad_input=out) if gelu
            else aten.threshold_backward.grad_input(dh_MF, pre_MI, 0, grad_input=out)), act
