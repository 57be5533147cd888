"""The sum of an exchange's partial slots, the last step of a rank-chunk reduce-scatter.

Reference (what :func:`sum_slots` must equal; :func:`sum_slots_reference`): ``torch.sum(slots, 0,
out=out)`` for ``slots [n, R, C]`` whose rows are contiguous (a row block of the exchange's slots)
and ``out [R, C]``, summed in float32 for half types and rounded once.

On CUDA one Triton kernel reads every slot once and writes the sum once; torch's reduction over
the leading dimension runs at about half the memory bandwidth (73 us for four 32 MiB slots on an
H200, where the bytes take about 40). Elsewhere (CPU, no Triton, other layouts) it is ``torch.sum``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .triton_gate import runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: torch.sum
    triton = None

_BLOCK = 4096  # elements of one program


def _fused(slots: torch.Tensor, out: torch.Tensor) -> bool:
    if not runs_triton(slots) or slots.dim() != 3 or out.dtype != slots.dtype:
        return False
    if slots.dtype not in (torch.float16, torch.bfloat16, torch.float32):  # float64 keeps its precision
        return False
    n, R, C = slots.shape
    return (slots.stride(2) == 1 and slots.stride(1) == C and out.is_contiguous() and out.shape == (R, C)
            and 0 < n <= 16)


def sum_slots_reference(slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The module reference in torch ops: ``torch.sum`` over the slots into ``out``."""
    return torch.sum(slots, 0, out=out)


def sum_slots(slots: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out = slots.sum(0)`` (module docstring; a new tensor when ``out`` is None); returns ``out``."""
    if out is None:
        out = slots.new_empty(slots.shape[1:])
    if not _fused(slots, out):
        return sum_slots_reference(slots, out)
    numel = out.numel()
    if numel:
        _sum_kernel[(triton.cdiv(numel, _BLOCK),)](slots, out, numel, slots.stride(0), N=slots.shape[0],
                                                    BLOCK=_BLOCK)
    return out


if triton is not None:
    @triton.jit
    def _sum_kernel(slots_ptr, out_ptr, numel, slot_stride, N: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(N):
            acc += tl.load(slots_ptr + k * slot_stride + idx, mask=mask).to(tl.float32)
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)
