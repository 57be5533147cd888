"""The attention core's heads step as one Triton kernel per head group (CUDA): rank-major
projected rows to the core's head layout with RoPE, and its transpose for the backward.

Reference (what :func:`move_heads` must equal, up to one rounding): ``attention_core._move_heads``'
torch path. For rows ``[g, b, s, C]`` (C = (nq + 2*nkv)*d, head h of a group starting at column
``lo*d``), heads ``[b, n, g, s, d]`` and tables ``cos, sin [b or 1, g, s, d]`` with halves ``c1,
c2, s1, s2``::

    forward   head[.., h, ..] = [x1*c1 - x2*s1, x2*c2 + x1*s2]    x = rows[.., (lo+h)*d:(lo+h+1)*d]
    backward  rows[.., (lo+h)*d ..] = [x1*c1 + x2*s2, x2*c2 - x1*s1]    x = head[.., h, ..]

for q and k; v is copied. Computed in float32 and rounded once (the torch path rounds after the
product and again after the sum). One read and one write of every element: the torch path runs four
strided half-width kernels per tensor at about a quarter of the memory bandwidth (measured: about
50 us per 8b chunk, where the bytes take about 10).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path
    triton = None

_ROWS = 64  # rows of one program


def move_heads(rows_gbsC: torch.Tensor, heads: Sequence[torch.Tensor],
               tables: Optional[Tuple[torch.Tensor, torch.Tensor]], nq: int, nkv: int, d: int,
               backward: bool) -> bool:
    """The module reference with ``tables`` ``(cos, sin) [b or 1, g, s, d]`` (None: no RoPE), when
    it can run here (CUDA, Triton, unit strides along d, even d); returns whether it ran."""
    if triton is None or not rows_gbsC.is_cuda or d % 2 or rows_gbsC.stride(-1) != 1:
        return False
    if any(h.stride(-1) != 1 for h in heads):
        return False
    if tables is not None and (tables[0].stride() != tables[1].stride() or tables[0].stride(-1) != 1):
        return False
    g, b, s, _ = rows_gbsC.shape
    R = g * b * s
    if R == 0:
        return True
    half = d // 2
    for lo, n, head, rope in ((0, nq, heads[0], tables is not None), (nq, nkv, heads[1], tables is not None),
                              (nq + nkv, nkv, heads[2], False)):
        cos, sin = tables if rope else (rows_gbsC, rows_gbsC)  # unread without RoPE
        t_b = 0 if cos.shape[0] == 1 else cos.stride(0)
        _heads_kernel[(triton.cdiv(R, _ROWS), n)](
            rows_gbsC[..., lo * d:], head, cos, sin, R, b, s, *rows_gbsC.stride()[:3], *head.stride()[:4], t_b,
            cos.stride(-3), cos.stride(-2), HALF=half, HP=triton.next_power_of_2(half), ROWS=_ROWS, ROPE=rope,
            BACKWARD=backward)
    return True


if triton is not None:
    @triton.jit
    def _heads_kernel(rows, heads, cos, sin, R, b, s, r_g, r_b, r_s, h_b, h_n, h_g, h_s, t_b, t_g, t_s,
                      HALF: tl.constexpr, HP: tl.constexpr, ROWS: tl.constexpr, ROPE: tl.constexpr,
                      BACKWARD: tl.constexpr):
        head = tl.program_id(1)
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        t = (r % s).to(tl.int64)
        bi = ((r // s) % b).to(tl.int64)
        gi = (r // (s * b)).to(tl.int64)
        cols = tl.arange(0, HP)
        m = (r < R)[:, None] & (cols < HALF)[None, :]
        row = (gi * r_g + bi * r_b + t * r_s + head * (2 * HALF))[:, None] + cols[None, :]
        hd = (bi * h_b + head * h_n + gi * h_g + t * h_s)[:, None] + cols[None, :]
        if BACKWARD:
            x1 = tl.load(heads + hd, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(heads + hd + HALF, mask=m, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(rows + row, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(rows + row + HALF, mask=m, other=0.0).to(tl.float32)
        if ROPE:
            tb = (bi * t_b + gi * t_g + t * t_s)[:, None] + cols[None, :]
            c1 = tl.load(cos + tb, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(cos + tb + HALF, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(sin + tb, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(sin + tb + HALF, mask=m, other=0.0).to(tl.float32)
            if BACKWARD:
                y1 = x1 * c1 + x2 * s2
                y2 = x2 * c2 - x1 * s1
            else:
                y1 = x1 * c1 - x2 * s1
                y2 = x2 * c2 + x1 * s2
        else:
            y1 = x1
            y2 = x2
        if BACKWARD:
            tl.store(rows + row, y1.to(rows.dtype.element_ty), mask=m)
            tl.store(rows + row + HALF, y2.to(rows.dtype.element_ty), mask=m)
        else:
            tl.store(heads + hd, y1.to(heads.dtype.element_ty), mask=m)
            tl.store(heads + hd + HALF, y2.to(heads.dtype.element_ty), mask=m)
