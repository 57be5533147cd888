"""The MoE's combine of each token's k expert result rows, weighted, where they are (the kernels
and their torch references: ``kernels/moe_combine.py``, whose docstring gives the reference and
[Note: MoE weighted combine]): argument checks, the path (the kernels where Triton runs, else the
references) and the weighting's autograd form. The device path uses it ([Note: MoE graph calls]
in ``layers/moe/device.py``), and so does every eager call without autograd ([Note: MoE no-grad
combine] in ``layers/moe/eager.py``).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ...kernels.moe_combine import (combine_rows_fused, combine_rows_reference, weigh_backward_fused,
                                    weigh_backward_into_reference, weigh_fused, weigh_rows_reference)
from ...kernels.triton_gate import runs_triton
from ...planning.first_order import first_order


def combine_rows(own: torch.Tensor, back: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                 n_own: Union[int, torch.Tensor], kept: Union[None, int, torch.Tensor] = None,
                 late: Optional[torch.Tensor] = None, n_first: Union[None, int, torch.Tensor] = None,
                 rows_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y [T, H]`` of the combine (``kernels/moe_combine.py``: its reference); ``n_own``, ``kept``
    and ``n_first`` are host ints or one-element integer tensors on the device (``kept`` None: every
    row kept; all of one kind; ``n_first`` given with ``late``). ``own``, ``back`` and ``late`` are
    ``[*, H]`` of one dtype, ``pos`` ``T*k`` positions. ``rows_out`` (``[T*k, H]``, contiguous),
    where given, gets each assignment's ``row(pos)`` unweighted, token-major (what
    :func:`weigh_backward_into` reads)."""
    T, k = weights.shape
    H = own.shape[1]
    if late is None:
        late, n_first = own, n_own
    if (own.dtype != back.dtype or late.dtype != own.dtype or back.shape[1] != H or late.shape[1] != H
            or pos.numel() != T * k or n_first is None
            or (rows_out is not None and (rows_out.shape != (T * k, H) or rows_out.dtype != own.dtype
                                          or not rows_out.is_contiguous()))):
        raise ValueError(f"combine_rows: own {tuple(own.shape)} {own.dtype}, back {tuple(back.shape)} {back.dtype}, "
                         f"late {tuple(late.shape)} {late.dtype} from {n_first!r}, pos of {pos.numel()} for weights "
                         f"{tuple(weights.shape)}, rows_out {None if rows_out is None else tuple(rows_out.shape)}; "
                         "valid: rows of one width and dtype, T*k positions, n_first with late, a contiguous "
                         "rows_out [T*k, H] of that dtype")
    if runs_triton(own) and own.is_contiguous() and back.is_contiguous() and late.is_contiguous():
        return combine_rows_fused(own, back, pos, weights, n_own, kept, late, n_first, rows_out)
    return combine_rows_reference(own, back, pos, weights, n_own, kept, late, n_first, rows_out)


class _WeighRows(torch.autograd.Function):
    """:func:`weigh_rows` by the kernels (both ways; first derivatives only)."""

    @staticmethod
    def forward(ctx, rows, weights):
        ctx.save_for_backward(rows, weights)
        return weigh_fused(rows, weights)

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy):
        rows, weights = ctx.saved_tensors
        d_rows = torch.empty_like(rows)
        return d_rows, weigh_backward_fused(rows, weights, dy.contiguous(), None, d_rows)


def weigh_backward_into(rows: torch.Tensor, weights: torch.Tensor, dy: torch.Tensor, pos: torch.Tensor,
                        dst: torch.Tensor, divert: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """:func:`weigh_rows`' backward with the rows' gradients placed: ``d rows[t, j]``
    (``kernels/moe_combine.py``) into ``dst[pos[t*k + j]]`` (``[rows, H]``, contiguous; an assignment at a negative
    place, or past ``dst``, is not written), and ``d weights`` returned, from ``rows [T, k, H]``,
    ``weights [T, k]`` and ``dy [T, H]`` of one dtype: the device path's training call places its
    output gradient where its input rows went ([Note: MoE weighted combine]). ``divert``: None, or
    ``(bounds, out)``, ``bounds`` two integers on the device ``(lo, hi)`` and ``out`` ``[*, H]``
    (contiguous, ``dst``'s dtype): the rows of places ``lo .. hi-1`` go to ``out[place - lo]``
    instead (none past its rows; [Note: own rows kept apart] in ``layers/moe/device.py``)."""
    T, k, H = rows.shape
    out = divert[1] if divert is not None else dst
    if (weights.shape != (T, k) or dy.shape != (T, H) or pos.numel() != T * k or dst.dim() != 2
            or dst.shape[1] != H or len({rows.dtype, weights.dtype, dy.dtype, dst.dtype, out.dtype}) != 1
            or not dst.is_contiguous() or out.dim() != 2 or out.shape[1] != H or not out.is_contiguous()
            or divert is not None and (divert[0].numel() != 2 or divert[0].is_floating_point())):
        raise ValueError(f"weigh_backward_into: rows {tuple(rows.shape)}, weights {tuple(weights.shape)}, dy "
                         f"{tuple(dy.shape)}, {pos.numel()} places, dst {tuple(dst.shape)}, divert "
                         f"{None if divert is None else (tuple(divert[0].shape), tuple(out.shape))}; valid: rows "
                         "[T, k, H], weights [T, k], dy [T, H], T*k places, a contiguous dst [*, H] and a divert's "
                         "contiguous [*, H] after its two integer bounds, all of one dtype")
    if runs_triton(rows):
        return weigh_backward_fused(rows.contiguous(), weights.contiguous(), dy.contiguous(), pos.contiguous(), dst,
                                    None if divert is None else (divert[0].reshape(2).contiguous(), out))
    return weigh_backward_into_reference(rows, weights, dy, pos, dst, divert)


def weigh_rows(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``y [T, H]`` of the weighting (``kernels/moe_combine.py``) for ``rows [T, k, H]`` and
    ``weights [T, k]`` of one dtype ([Note: MoE weighted combine]); differentiable in both, by the
    kernels where Triton runs, else by ``bmm``."""
    if rows.dim() != 3 or weights.shape != rows.shape[:2] or weights.dtype != rows.dtype \
            or weights.device != rows.device:
        raise ValueError(f"weigh_rows: rows {tuple(rows.shape)} {rows.dtype}, weights {tuple(weights.shape)} "
                         f"{weights.dtype}; valid: rows [T, k, H] and weights [T, k] of one dtype and device")
    if runs_triton(rows):
        return _WeighRows.apply(rows.contiguous(), weights.contiguous())
    return weigh_rows_reference(rows, weights)
