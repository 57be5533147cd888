"""The MoE's combine as one pass over the expert rows (Triton kernels, for the layer's
``layers/moe/combine.py``): the weighted sum of each token's k result rows, read where they are.
The device path uses it ([Note: MoE graph calls] in ``layers/moe/device.py``), and so does every
eager call without autograd ([Note: MoE no-grad combine] in ``layers/moe/eager.py``).

Reference (:func:`combine_rows_reference`; ``own [>= n_own, H]``, ``back``: result rows, those at
rows below ``n_own`` in ``own`` and the others in ``back``; ``pos [T*k]``: the row of each
token-major assignment's result (the eager call's: its send-order row; the device path's: its place
in the exchange's buffers), negative for one that is not sent; ``weights [T, k]``; ``kept``: rows
from it on were dropped by capacity; ``late``: where the own rows from ``n_first`` on are, from its
row 0 (the device path runs them last; without it ``n_first = n_own``))::

    row(p)  = 0 if p < 0 or p >= kept else own[p] if p < n_first else late[p - n_first] if p < n_own
              else back[p]
    y[t]    = sum over j < k of  weights[t, j] * row(pos[t*k + j])      (weights cast to the rows'
                                                                         dtype, summed in float32,
                                                                         float64 rows in float64)

which ``torch.where``, ``index_select`` and ``bmm`` compute by reading and writing the rows three
times (the ``where`` broadcasts its mask and runs as a strided elementwise kernel); the kernel
reads each row once (measured: see docs/measurements.md, MoE device path).

The layer's ``weigh_rows`` is the combine's autograd form, for calls whose router needs its
gradient (``rows [T, k, H]`` token-major, ``weights [T, k]`` of the rows' dtype;
:func:`weigh_rows_reference`, :func:`weigh_backward_into_reference`)::

    y[t]           = sum over j of weights[t, j] * rows[t, j]          (summed in float32, as bmm)
    d rows[t, j]   = weights[t, j] * dy[t]
    d weights[t, j] = sum over h of dy[t, h] * rows[t, j, h]           (summed in float32)

[Note: MoE weighted combine]
Written as ``torch.bmm(weights[:, None], rows)``, its three batched GEMMs (inner or outer size k)
take several times what reading and writing the rows costs. The kernels read each row once
forward, and once backward, where they also write its gradient: 3-4x faster than ``bmm`` for
qwen3-30b-a3b's rows, more for mixtral-8x7b's (measured: see docs/measurements.md, MoE eager
path).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path
    triton = None


def combine_rows_fused(own: torch.Tensor, back: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                       n_own: Union[int, torch.Tensor], kept: Union[None, int, torch.Tensor], late: torch.Tensor,
                       n_first: Union[int, torch.Tensor], rows_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The module reference by one kernel (where Triton runs on the rows' device; ``own``, ``back``
    and ``late`` contiguous): arguments as the layer's ``combine_rows`` takes them, ``late`` and
    ``n_first`` given (``own`` and ``n_own`` where the call has no late rows)."""
    T, k = weights.shape
    H = own.shape[1]
    y = own.new_empty((T, H))
    if T:
        block = min(1024, triton.next_power_of_2(H))
        w = weights.to(own.dtype).contiguous()  # rounded by torch, as the reference's cast
        _combine_kernel[(T,)](own, late, back, pos.contiguous(), w, y, y if rows_out is None else rows_out,
                              n_first, n_own, n_own if kept is None else kept, H=H, K=k, HAS_KEPT=kept is not None,
                              LOADED=isinstance(n_own, torch.Tensor), WIDE=own.dtype == torch.float64,
                              ROWS_OUT=rows_out is not None, BLOCK_H=block, num_warps=4)
    return y


def combine_rows_reference(own: torch.Tensor, back: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                           n_own: Union[int, torch.Tensor], kept: Union[None, int, torch.Tensor], late: torch.Tensor,
                           n_first: Union[int, torch.Tensor], rows_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The module reference in torch ops (arguments as :func:`combine_rows_fused`'s)."""
    T, k = weights.shape
    H = own.shape[1]
    p = pos[:, None]

    def rows_at(t: torch.Tensor, shift=0) -> torch.Tensor:  # t's row at each position (clamped: chosen below)
        return t[(pos - shift).clamp(0, t.shape[0] - 1)] if t.shape[0] else t.new_zeros((pos.numel(), H))

    rows = torch.where(p < n_own, torch.where(p < n_first, rows_at(own), rows_at(late, n_first)), rows_at(back))
    rows = torch.where((p >= 0) & (p < kept) if kept is not None else p >= 0, rows, 0)
    if rows_out is not None:
        rows_out.copy_(rows)
    return torch.bmm(weights.to(rows.dtype).unsqueeze(1), rows.view(T, k, H)).squeeze(1)


def weigh_fused(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``y [T, H]`` of the weighting (module docstring) by one kernel, for contiguous ``rows [T, k,
    H]`` and ``weights [T, k]`` of one dtype (where Triton runs on their device)."""
    T, k, H = rows.shape
    y = rows.new_empty((T, H))
    if T and H:
        _weigh_kernel[(T,)](rows, weights, y, H=H, K=k, KP=triton.next_power_of_2(k), BLOCK_H=_block(H, k),
                            WIDE=rows.dtype == torch.float64, num_warps=4)
    return y


def weigh_backward_fused(rows, weights, dy, pos, dst, divert=None) -> torch.Tensor:
    """The kernel's ``d weights``; the rows' gradients into ``dst``: token-major, or each at its
    ``pos`` where given (none where negative or past ``dst``), those of ``divert``'s places into
    its buffer ``(bounds, out)`` (the layer's ``weigh_backward_into``); contiguous tensors."""
    T, k, H = rows.shape
    d_w = torch.empty_like(weights)
    bounds, out = divert if divert is not None else (d_w, dst)
    if T and H:
        _weigh_backward_kernel[(T,)](rows, weights, dy, d_w, dst, dst if pos is None else pos, dst.shape[0],
                                     bounds, out, out.shape[0], H=H, K=k, KP=triton.next_power_of_2(k),
                                     BLOCK_H=_block(H, k), HAS_POS=pos is not None, DIVERT=divert is not None,
                                     WIDE=rows.dtype == torch.float64, num_warps=4)
    elif T:
        d_w.zero_()
    return d_w


def weigh_rows_reference(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``y [T, H]`` of the weighting (module docstring) in torch ops (``bmm``, differentiable)."""
    return torch.bmm(weights.unsqueeze(1), rows).squeeze(1)


def weigh_backward_into_reference(rows: torch.Tensor, weights: torch.Tensor, dy: torch.Tensor, pos: torch.Tensor,
                                  dst: torch.Tensor,
                                  divert: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """The weighting's backward with the rows' gradients placed (the layer's ``weigh_backward_into``)
    in torch ops: ``d weights`` returned, each ``d rows[t, j]`` into ``dst[pos[t*k + j]]`` or
    ``divert``'s buffer (its two bounds read on the host)."""
    T, k, H = rows.shape
    out = divert[1] if divert is not None else dst
    wide = torch.float64 if rows.dtype == torch.float64 else torch.float32
    d_w = (rows.to(wide) * dy.to(wide)[:, None]).sum(-1).to(weights.dtype)
    d_rows = (weights.to(wide)[:, :, None] * dy.to(wide)[:, None]).to(dst.dtype).view(T * k, H)
    p = pos.reshape(-1).to(torch.int64)
    ok = p >= 0
    if divert is not None:
        lo, hi = divert[0].reshape(2).tolist()
        mine = ok & (p >= lo) & (p < hi)
        ok &= ~mine
        fits = mine & (p - lo < out.shape[0])
        out[p[fits] - lo] = d_rows[fits]
    ok &= p < dst.shape[0]
    dst[p[ok]] = d_rows[ok]
    return d_w


def _block(H: int, k: int) -> int:
    """Columns per step: up to 2048, and at most 16384 elements of a token's k rows at once (wide
    steps: qwen3-30b-a3b's rows, k 8 and H 2048, run more than twice as fast with 2048 columns as
    with 512; measured: see docs/measurements.md, MoE)."""
    return max(16, min(triton.next_power_of_2(H), 2048, 16384 // triton.next_power_of_2(k)))


if triton is not None:
    @triton.jit
    def _weigh_kernel(rows_ptr, w_ptr, y_ptr, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      BLOCK_H: tl.constexpr, WIDE: tl.constexpr):
        """One token per program: its k rows weighted and summed, BLOCK_H columns at a time."""
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)
        c = tl.arange(0, BLOCK_H)
        dt = tl.float64 if WIDE else tl.float32
        w = tl.load(w_ptr + t * K + j, mask=j < K, other=0.0).to(dt)
        for h0 in tl.static_range(0, H, BLOCK_H):
            cols = h0 + c
            m = (j[:, None] < K) & (cols[None, :] < H)
            r = tl.load(rows_ptr + (t * K + j[:, None]) * H + cols[None, :], mask=m, other=0.0).to(dt)
            tl.store(y_ptr + t * H + cols, tl.sum(w[:, None] * r, axis=0).to(y_ptr.dtype.element_ty), mask=cols < H)

    @triton.jit
    def _weigh_backward_kernel(rows_ptr, w_ptr, dy_ptr, d_w_ptr, dst_ptr, pos_ptr, dst_rows, bounds_ptr, out_ptr,
                               out_rows, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK_H: tl.constexpr,
                               HAS_POS: tl.constexpr, DIVERT: tl.constexpr, WIDE: tl.constexpr):
        """One token per program: its rows' gradients (its weights times dy; token-major, or at
        their places where ``HAS_POS``, those of places ``bounds[0] .. bounds[1]-1`` into ``out``
        from its row 0 where ``DIVERT``) and its weights' (dy's dot with each row, summed over the
        columns)."""
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)
        c = tl.arange(0, BLOCK_H)
        dt = tl.float64 if WIDE else tl.float32
        w = tl.load(w_ptr + t * K + j, mask=j < K, other=0.0).to(dt)
        if HAS_POS:
            place = tl.load(pos_ptr + t * K + j, mask=j < K, other=-1).to(tl.int64)
            live = (j < K) & (place >= 0) & (place < dst_rows)
        else:
            place = t * K + j
            live = j < K
        if DIVERT:
            lo = tl.load(bounds_ptr).to(tl.int64)
            mine = (j < K) & (place >= lo) & (place < tl.load(bounds_ptr + 1).to(tl.int64))
            live = live & ~mine
            out_at = place - lo
            mine = mine & (out_at < out_rows)
        acc = tl.zeros([KP], dtype=dt)
        for h0 in tl.static_range(0, H, BLOCK_H):
            cols = h0 + c
            m = (j[:, None] < K) & (cols[None, :] < H)
            at = (t * K + j[:, None]) * H + cols[None, :]
            g = tl.load(dy_ptr + t * H + cols, mask=cols < H, other=0.0).to(dt)
            r = tl.load(rows_ptr + at, mask=m, other=0.0).to(dt)
            acc += tl.sum(r * g[None, :], axis=1)
            d = (w[:, None] * g[None, :]).to(dst_ptr.dtype.element_ty)
            tl.store(dst_ptr + place[:, None] * H + cols[None, :], d, mask=live[:, None] & (cols[None, :] < H))
            if DIVERT:
                tl.store(out_ptr + out_at[:, None] * H + cols[None, :], d, mask=mine[:, None] & (cols[None, :] < H))
        tl.store(d_w_ptr + t * K + j, acc.to(d_w_ptr.dtype.element_ty), mask=j < K)

    # the counts are bounds, never strides: specialized on their values (==1, divisible by 16),
    # they would compile a variant per routing outcome, inside whatever call first routed so
    @triton.jit(do_not_specialize=["n_first_arg", "n_own_arg", "kept_arg"])
    def _combine_kernel(own_ptr, late_ptr, back_ptr, pos_ptr, w_ptr, y_ptr, rows_ptr, n_first_arg, n_own_arg,
                        kept_arg, H: tl.constexpr, K: tl.constexpr, HAS_KEPT: tl.constexpr, LOADED: tl.constexpr,
                        WIDE: tl.constexpr, ROWS_OUT: tl.constexpr, BLOCK_H: tl.constexpr):
        """One token per program: its k rows, each from ``own``, ``late`` or ``back`` (module
        docstring), also stored unweighted into ``rows`` where ``ROWS_OUT``; ``n_first_arg``,
        ``n_own_arg`` and ``kept_arg`` pointers to the counts where ``LOADED``, else the counts;
        float64 rows (``WIDE``) summed in float64."""
        t = tl.program_id(0).to(tl.int64)
        if LOADED:
            n_first = tl.load(n_first_arg).to(tl.int64)
            n_own = tl.load(n_own_arg).to(tl.int64)
            kept = tl.load(kept_arg).to(tl.int64)
        else:  # host ints (compared with int64 positions as they are)
            n_first = n_first_arg
            n_own = n_own_arg
            kept = kept_arg
        c = tl.arange(0, BLOCK_H)
        for h0 in tl.static_range(0, H, BLOCK_H):
            cols = h0 + c
            cm = cols < H
            acc = tl.zeros([BLOCK_H], dtype=tl.float64 if WIDE else tl.float32)
            for j in tl.static_range(K):
                p = tl.load(pos_ptr + t * K + j).to(tl.int64)
                w = tl.load(w_ptr + t * K + j).to(acc.dtype)
                live = (p >= 0) & (p < kept) if HAS_KEPT else p >= 0
                a = tl.load(own_ptr + p * H + cols, mask=cm & live & (p < n_first), other=0.0)
                d = tl.load(late_ptr + (p - n_first) * H + cols, mask=cm & live & (p >= n_first) & (p < n_own),
                            other=0.0)
                b = tl.load(back_ptr + p * H + cols, mask=cm & live & (p >= n_own), other=0.0)
                if ROWS_OUT:  # one of the three is the row, the others 0: exact
                    tl.store(rows_ptr + (t * K + j) * H + cols, a + d + b, mask=cm)
                acc += w * (a.to(acc.dtype) + d.to(acc.dtype) + b.to(acc.dtype))
            tl.store(y_ptr + t * H + cols, acc.to(y_ptr.dtype.element_ty), mask=cm)
