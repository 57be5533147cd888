"""The attention core's heads step as one Triton kernel for q, k and v (CUDA): rank-major
projected rows to the core's head layout with RoPE, and its transpose for the backward.

Reference (what :func:`move_heads` must equal, up to one rounding): :func:`move_heads_reference`,
its torch path. For rows ``[g, b, s, C]`` (C = (nq + 2*nkv)*d, head h of a group starting at column
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

from .triton_gate import runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path
    triton = None

_ROWS = 64  # rows of one program


def head_views(qkv_gbsC: torch.Tensor, nq: int, nkv: int, d: int):
    """q, k, v of rank-major rows ``qkv [g, b, s, C]`` as ``[b, n, g, s, d]`` views (no copy)."""
    def heads(lo: int, n: int) -> torch.Tensor:
        return qkv_gbsC[..., lo * d:(lo + n) * d].unflatten(-1, (n, d)).permute(1, 3, 0, 2, 4)
    return heads(0, nq), heads(nq, nkv), heads(nq + nkv, nkv)


def rope_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              transpose: bool = False) -> torch.Tensor:
    """RoPE of ``x`` into ``out`` per half, with ``x = [x1, x2]`` and the tables' halves ``c1, c2,
    s1, s2``: ``[x1*c1 - x2*s1, x2*c2 + x1*s2]`` (= ``x*cos + rotate_half(x)*sin``), or with
    ``transpose`` its transpose ``[x1*c1 + x2*s2, x2*c2 - x1*s1]`` (the backward). Four
    half-width kernels writing ``out``'s halves in place: no concatenation, no rotated copy."""
    h = x.shape[-1] // 2
    c1, c2, s1, s2 = cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]
    x1, x2, o1, o2 = x[..., :h], x[..., h:], out[..., :h], out[..., h:]
    torch.mul(x1, c1, out=o1).addcmul_(x2, s2 if transpose else s1, value=1 if transpose else -1)
    torch.mul(x2, c2, out=o2).addcmul_(x1, s1 if transpose else s2, value=-1 if transpose else 1)
    return out


def move_heads_reference(rows_gbsC: torch.Tensor, heads: Sequence[torch.Tensor],
                         tables: Optional[Tuple[torch.Tensor, torch.Tensor]], nq: int, nkv: int, d: int,
                         backward: bool) -> None:
    """The module reference in torch ops (the path where :func:`move_heads` does not run): rows
    ``[g, b, s, C]`` to the heads ``(q, k, v) [b, n, g, s, d]`` with RoPE on q and k (``tables``
    ``(cos, sin) [b or 1, g, s, d]``, None: no RoPE), or (``backward``) the heads' gradients back
    to the rows with RoPE's transpose."""
    tables = None if tables is None else tuple(t[:, None] for t in tables)
    for n, (rows, head) in enumerate(zip(head_views(rows_gbsC, nq, nkv, d), heads)):
        src, dst = (head, rows) if backward else (rows, head)
        if n == 2 or tables is None:  # v, or no RoPE
            dst.copy_(src)
        else:
            rope_into(dst, src, *tables, transpose=backward)


def move_heads(rows_gbsC: torch.Tensor, heads: Sequence[torch.Tensor],
               tables: Optional[Tuple[torch.Tensor, torch.Tensor]], nq: int, nkv: int, d: int,
               backward: bool) -> bool:
    """The module reference with ``tables`` ``(cos, sin) [b or 1, g, s, d]`` (None: no RoPE), when
    it can run here (CUDA, Triton, unit strides along d, even d, one dtype for q, k and v, not
    float64, which the torch path keeps exact where the kernel's float32 would not); returns
    whether it ran. One launch for q, k and v ([Note: one heads launch]): on a slow host
    each Triton launch costs 60-100 us, more than the kernel of one rank's chunk (docs/measurements.md,
    Host overhead)."""
    if not runs_triton(rows_gbsC) or d % 2 or rows_gbsC.stride(-1) != 1 or rows_gbsC.dtype == torch.float64:
        return False
    if any(h.stride(-1) != 1 or h.dtype != heads[0].dtype for h in heads):
        return False
    if tables is not None and (tables[0].stride() != tables[1].stride() or tables[0].stride(-1) != 1):
        return False
    g, b, s, _ = rows_gbsC.shape
    R = g * b * s
    if R == 0:
        return True
    half = d // 2
    cos, sin = tables if tables is not None else (rows_gbsC, rows_gbsC)  # unread without RoPE
    t_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    q, k, v = heads
    _heads_kernel[(triton.cdiv(R, _ROWS), nq + 2 * nkv)](
        rows_gbsC, q, k, v, cos, sin, R, b, s,
        *rows_gbsC.stride()[:3], *q.stride()[:4], *k.stride()[:4], *v.stride()[:4], t_b, cos.stride(-3),
        cos.stride(-2), NQ=nq, NKV=nkv, HALF=half, HP=triton.next_power_of_2(half), ROWS=_ROWS,
        ROPE=tables is not None, BACKWARD=backward)
    return True


if triton is not None:
    @triton.jit
    def _heads_kernel(rows, q, k, v, cos, sin, R, b, s, r_g, r_b, r_s, q_b, q_n, q_g, q_s, k_b, k_n, k_g, k_s,
                      v_b, v_n, v_g, v_s, t_b, t_g, t_s, NQ: tl.constexpr, NKV: tl.constexpr,
                      HALF: tl.constexpr, HP: tl.constexpr, ROWS: tl.constexpr, ROPE: tl.constexpr,
                      BACKWARD: tl.constexpr):
        # [Note: one heads launch]: the program's head is q's, k's or v's by its column; its
        # pointer and strides are chosen by selects, not by a branch, so the compiler keeps what it
        # knows of each stride's divisibility (a branch loses it: the stores run unvectorized, the
        # forward a third slower than three launches). Only RoPE or the copy (v) is a branch.
        # The kernel takes k's and v's pointers, not their element offsets from q's: an offset is
        # an integer argument, and Triton compiles one variant for offsets within int32 and another
        # beyond, so where the caching allocator put k and v chose between variants at run time: a
        # compile (hundreds of ms) or a module load (tens of ms of host time) inside some call long
        # after the first, which would stall first-call verification's trials (tests/test_kernel_variants.py).
        col = tl.program_id(1)  # the head's place in the rows: q heads, then k, then v
        is_q = col < NQ
        is_k = (col >= NQ) & (col < NQ + NKV)
        head = tl.where(is_q, col, tl.where(is_k, col - NQ, col - NQ - NKV)).to(tl.int64)
        heads = tl.where(is_q, q, tl.where(is_k, k, v))
        h_b = tl.where(is_q, q_b, tl.where(is_k, k_b, v_b)).to(tl.int64)
        h_n = tl.where(is_q, q_n, tl.where(is_k, k_n, v_n)).to(tl.int64)
        h_g = tl.where(is_q, q_g, tl.where(is_k, k_g, v_g)).to(tl.int64)
        h_s = tl.where(is_q, q_s, tl.where(is_k, k_s, v_s)).to(tl.int64)
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        t = (r % s).to(tl.int64)
        bi = ((r // s) % b).to(tl.int64)
        gi = (r // (s * b)).to(tl.int64)
        cols = tl.arange(0, HP)
        m = (r < R)[:, None] & (cols < HALF)[None, :]
        row = (gi * r_g + bi * r_b + t * r_s + col * (2 * HALF))[:, None] + cols[None, :]
        hd = (bi * h_b + head * h_n + gi * h_g + t * h_s)[:, None] + cols[None, :]
        if BACKWARD:
            x1 = tl.load(heads + hd, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(heads + hd + HALF, mask=m, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(rows + row, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(rows + row + HALF, mask=m, other=0.0).to(tl.float32)
        y1 = x1
        y2 = x2
        if ROPE:
            if col < NQ + NKV:  # v is copied
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
        if BACKWARD:
            tl.store(rows + row, y1.to(rows.dtype.element_ty), mask=m)
            tl.store(rows + row + HALF, y2.to(rows.dtype.element_ty), mask=m)
        else:
            tl.store(heads + hd, y1.to(heads.dtype.element_ty), mask=m)
            tl.store(heads + hd + HALF, y2.to(heads.dtype.element_ty), mask=m)
