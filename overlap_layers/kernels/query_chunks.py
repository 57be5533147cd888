"""The merge of the attention core's query-chunk pieces (``layers/attention/query_chunks.py``) as
one Triton kernel: reads both pieces, writes the output in any layout.

Reference (:func:`merge_reference`), for one piece ``(o1 [b, n, s, d], l1 [b, n, s])`` or two of
one row's keys merged exactly, into ``o_out [b, n, s, d]`` and ``lse_out [b, n, s]`` (any
strides)::

    one piece    o_out, lse_out = o1, l1
    two pieces   lse_out = logaddexp(l1, l2);  o_out = o1 * exp(l1 - lse_out) + o2 * exp(l2 - lse_out)
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch merge
    triton = None


def merge_reference(o_out, lse_out, o1, l1, o2=None, l2=None) -> None:
    """The module reference in torch ops."""
    if o2 is None:
        o_out.copy_(o1)
        lse_out.copy_(l1)
        return
    lse = torch.logaddexp(l1, l2)
    o_out.copy_(o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1))
    lse_out.copy_(lse)


_ROWS = 64  # rows of one merge program

if triton is not None:
    @triton.jit
    def _merge_kernel(o1, l1, o2, l2, out, lout, s, nh, d,
                      o1_b, o1_h, o1_s, l1_b, l1_h, l1_s, o2_b, o2_h, o2_s, l2_b, l2_h, l2_s,
                      out_b, out_h, out_s, lo_b, lo_h, lo_s, TWO: tl.constexpr, D: tl.constexpr,
                      ROWS: tl.constexpr):
        bh = tl.program_id(1)
        b, h = bh // nh, bh % nh
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, D)
        rm, m = rows < s, (rows < s)[:, None] & (cols < d)[None, :]
        la = tl.load(l1 + b * l1_b + h * l1_h + rows * l1_s, mask=rm, other=0.0).to(tl.float32)
        x = tl.load(o1 + b * o1_b + h * o1_h + rows[:, None] * o1_s + cols[None, :], mask=m, other=0.0)
        x = x.to(tl.float32)
        if TWO:
            lb = tl.load(l2 + b * l2_b + h * l2_h + rows * l2_s, mask=rm, other=0.0).to(tl.float32)
            y = tl.load(o2 + b * o2_b + h * o2_h + rows[:, None] * o2_s + cols[None, :], mask=m, other=0.0)
            top = tl.maximum(la, lb)
            ea, eb = tl.exp(la - top), tl.exp(lb - top)
            tot = ea + eb
            x = x * (ea / tot)[:, None] + y.to(tl.float32) * (eb / tot)[:, None]
            la = top + tl.log(tot)
        tl.store(out + b * out_b + h * out_h + rows[:, None] * out_s + cols[None, :],
                 x.to(out.dtype.element_ty), mask=m)
        tl.store(lout + b * lo_b + h * lo_h + rows * lo_s, la.to(lout.dtype.element_ty), mask=rm)


def merge_fused(o_out, lse_out, o1, l1, o2=None, l2=None) -> None:
    """The module reference by one kernel (where Triton runs on the pieces' device; the kernel
    merges in float32)."""
    b, nh, s, d = o1.shape
    two = o2 is not None
    if not two:
        o2, l2 = o1, l1
    for t in (o_out, o1, o2):
        assert t.stride(3) == 1, "the merge reads and writes rows of d contiguous elements"
    if b * nh * s == 0:
        return
    _merge_kernel[(triton.cdiv(s, _ROWS), b * nh)](
        o1, l1, o2, l2, o_out, lse_out, s, nh, d,
        *o1.stride()[:3], *l1.stride(), *o2.stride()[:3], *l2.stride(), *o_out.stride()[:3], *lse_out.stride(),
        TWO=two, D=triton.next_power_of_2(d), ROWS=_ROWS)
