"""SwiGLU and its backward as one pass over memory each (Triton on CUDA, eager elsewhere).

Reference (``pre [M, 2F]`` = gate columns then up columns, ``dh [M, F]``; in torch ops
:func:`swiglu_reference` and :func:`swiglu_backward_reference`), computed in float32 and rounded
once to ``pre``'s dtype::

    h     = silu(g) * u                      with g = pre[:, :F], u = pre[:, F:], s = sigmoid(g)
    dpre  = [dh * u * s * (1 + g * (1 - s)),  dh * g * s]      (d gate, d up)

The eager versions run several kernels (each reading and writing ``M*F`` elements): the forward
two, the backward five plus a recomputation of ``h`` for the weight gradient. The fused backward
returns ``h`` too, so one pass serves both. Used when the tensors are on CUDA, contiguous and
not float64 and Triton imports; otherwise (CPU, no Triton, or float64, which the eager formulas
keep exact where the kernel's float32 would not) the eager formulas run.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .triton_gate import runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the eager path
    triton = None

_BLOCK = 1024
_STRIDED = 1024  # programs of the forward with a row count on the device


def fused_available(pre: torch.Tensor) -> bool:
    return runs_triton(pre) and pre.is_contiguous() and pre.dtype != torch.float64


if triton is not None:
    @triton.jit
    def _gate_up_block(pre_ptr, n, f, BLOCK: tl.constexpr, start=None):
        # the flat indices into h [M, F] of the block at ``start`` (None: this program's block),
        # their mask, the gate offsets in pre [M, 2F] and the gate and up values in float32
        if start is None:
            start = tl.program_id(0).to(tl.int64) * BLOCK
        idx = start + tl.arange(0, BLOCK)
        mask = idx < n
        g_off = (idx // f) * 2 * f + idx % f
        g = tl.load(pre_ptr + g_off, mask=mask).to(tl.float32)
        u = tl.load(pre_ptr + g_off + f, mask=mask).to(tl.float32)
        return idx, mask, g_off, g, u

    @triton.jit
    def _swiglu_fwd_kernel(pre_ptr, h_ptr, n, f, rows_ptr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        if HAS_ROWS:  # only the first rows (a count on the device): the programs stride over them
            limit = tl.minimum(n, tl.load(rows_ptr).to(tl.int64) * f)
            start = tl.program_id(0).to(tl.int64) * BLOCK
            while start < limit:  # a loop bound from the device (a while: Triton's interpreter takes it too)
                idx, mask, g_off, g, u = _gate_up_block(pre_ptr, limit, f, BLOCK, start)
                tl.store(h_ptr + idx, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=mask)
                start += tl.num_programs(0) * BLOCK
        else:
            idx, mask, g_off, g, u = _gate_up_block(pre_ptr, n, f, BLOCK)
            tl.store(h_ptr + idx, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_block(pre_ptr, dh_ptr, dpre_ptr, h_ptr, n, f, BLOCK: tl.constexpr, start=None):
        idx, mask, g_off, g, u = _gate_up_block(pre_ptr, n, f, BLOCK, start)
        dh = tl.load(dh_ptr + idx, mask=mask).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        tl.store(dpre_ptr + g_off, (dh * u * s * (1.0 + g * (1.0 - s))).to(dpre_ptr.dtype.element_ty), mask=mask)
        tl.store(dpre_ptr + g_off + f, (dh * silu).to(dpre_ptr.dtype.element_ty), mask=mask)
        tl.store(h_ptr + idx, (silu * u).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(pre_ptr, dh_ptr, dpre_ptr, h_ptr, n, f, rows_ptr, HAS_ROWS: tl.constexpr,
                           BLOCK: tl.constexpr):
        if HAS_ROWS:  # only the first rows (a count on the device), as the forward kernel
            limit = tl.minimum(n, tl.load(rows_ptr).to(tl.int64) * f)
            start = tl.program_id(0).to(tl.int64) * BLOCK
            while start < limit:
                _swiglu_bwd_block(pre_ptr, dh_ptr, dpre_ptr, h_ptr, limit, f, BLOCK, start)
                start += tl.num_programs(0) * BLOCK
        else:
            _swiglu_bwd_block(pre_ptr, dh_ptr, dpre_ptr, h_ptr, n, f, BLOCK)


def swiglu_reference(pre_MI: torch.Tensor) -> torch.Tensor:
    """``h [M, F]`` of the module reference in torch ops (the eager path)."""
    gate, up = pre_MI.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def swiglu_backward_reference(pre_MI: torch.Tensor, dh_MF: torch.Tensor, dpre: torch.Tensor,
                              h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(dpre [M, 2F], h [M, F])`` of the module reference in torch ops (the eager path), into
    ``dpre`` (which may be ``pre_MI`` itself: written after every read of it) and ``h``."""
    gate, up = pre_MI.chunk(2, dim=-1)
    silu = F.silu(gate)
    d_up = dh_MF * silu
    d_gate = torch.ops.aten.silu_backward(dh_MF * up, gate)
    torch.mul(silu, up, out=h)
    torch.cat([d_gate, d_up], dim=-1, out=dpre)  # after every read of pre_MI (dpre may be it)
    return dpre, h


def swiglu(pre_MI: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``h [M, F]`` of the module reference (no autograd: call it outside recorded regions).
    ``rows``: a one-element integer tensor on the device; where given, the fused kernel computes
    only the first ``rows`` rows and leaves the others unwritten (the eager path computes all)."""
    if not fused_available(pre_MI):
        return swiglu_reference(pre_MI)
    h = pre_MI.new_empty(pre_MI.chunk(2, dim=-1)[0].shape)
    n, f = h.numel(), h.shape[-1]
    if n:
        # with a device count, a grid of the bound's blocks costs about 50 us however few rows run (the
        # MoE's replayed parts): then at most _STRIDED programs loop
        grid = triton.cdiv(n, _BLOCK) if rows is None else min(triton.cdiv(n, _BLOCK), _STRIDED)
        _swiglu_fwd_kernel[(grid,)](pre_MI, h, n, f, h if rows is None else rows, HAS_ROWS=rows is not None,
                                    BLOCK=_BLOCK)
    return h


def swiglu_backward(pre_MI: torch.Tensor, dh_MF: torch.Tensor, out: Optional[torch.Tensor] = None,
                    h_out: Optional[torch.Tensor] = None,
                    rows: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(dpre [M, 2F], h [M, F])`` of the module reference; ``dpre`` into ``out`` if given, which
    may be ``pre_MI`` itself (each element is read before it is written), ``h`` into ``h_out``.
    ``rows``: as :func:`swiglu`'s (the fused kernel leaves the rows past it unwritten)."""
    dpre = torch.empty_like(pre_MI) if out is None else out
    h = pre_MI.new_empty(pre_MI.chunk(2, dim=-1)[0].shape) if h_out is None else h_out
    if not (fused_available(pre_MI) and dh_MF.is_contiguous() and dpre.is_contiguous() and h.is_contiguous()):
        return swiglu_backward_reference(pre_MI, dh_MF, dpre, h)
    n, f = h.numel(), h.shape[-1]
    if n:
        grid = triton.cdiv(n, _BLOCK) if rows is None else min(triton.cdiv(n, _BLOCK), _STRIDED)
        _swiglu_bwd_kernel[(grid,)](pre_MI, dh_MF, dpre, h, n, f, h if rows is None else rows,
                                    HAS_ROWS=rows is not None, BLOCK=_BLOCK)
    return dpre, h
