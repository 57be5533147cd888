"""The experts' weight gradients of a piece of rows, added into the accumulator inside the GEMM
(Triton on CUDA, torch ops elsewhere).

Reference (:func:`grouped_wgrad_reference`; ``a [R, M]``, ``b [R, N]``: rows grouped by expert,
``ends [G]`` the groups' ends, so group ``g`` is rows ``ends[g-1] .. ends[g]`` (from 0 for the
first); ``out [G, M, N]``)::

    out[g] (+)= a[ends[g-1]:ends[g]].T @ b[ends[g-1]:ends[g]]      (summed in float32, the sum
                                                                   with out's old value too, and
                                                                   rounded once to out's dtype)

with ``+=`` where ``accumulate``, else ``=``; rows past ``ends[-1]`` are not read.

:func:`grouped_wgrad_parts`' reference (:func:`grouped_wgrad_parts_reference`; rows of one group
spread over ``P`` parts: ``a_p [R_p, M]``, ``b_p [R_p, N]``; ``part``, ``lo``, ``hi`` ``[S, G]``:
segment ``s`` of group ``g`` is the rows ``lo[s, g] .. hi[s, g]`` of part ``part[s, g]``)::

    out[g] (+)= sum over s of a_part[lo:hi].T @ b_part[lo:hi]     (part = part[s, g], and so on;
                                                                   summed in float32 over every
                                                                   segment, rounded once)

[Note: expert weight gradients in one pass]
The MoE device path's backward ([Note: MoE training graphs] in ``layers/moe/device.py``) runs each part
of rows as it arrives, six parts at EP 4. With one :func:`grouped_wgrad` per part, each part
would read and write the whole accumulator (the local experts' weights, 302 MB for qwen3-30b-a3b
at EP 4) and its programs would run about 512 rows per group, too few to fill the kernel's
pipeline: about 1.4x cuBLAS's time for the same rows. :func:`grouped_wgrad_parts` runs every part of a group in one program: the
accumulator is written once and each program's loop runs every row of its group. The parts stay
where they are (no copy into one buffer): the kernel reads their addresses from a table
(:class:`WgradParts`, filled on the device so that a graph can capture it).

Each tile runs one loop per segment, which Triton pipelines anew, and ends each segment with a
partial step: over the parts it runs about 15% slower than over the same rows made contiguous.
Running a group's segments as one loop (each step's segment picked from the segments' bounds in
registers, each row's address picked per row, or Triton's flattened nested loops) is no faster
(measured: see docs/measurements.md, MoE device path).

[Note: expert weight gradients in the GEMM]
The rank-chunk MoE backward computes each source's weight gradients as its rows arrive
(``layers/moe/ranks.py``, [Note: MoE weight-gradient accumulation]): with many small experts, one grouped
GEMM per projection per piece, every piece after the first adding its result to the
accumulator. As separate adds those are elementwise passes over the layer's whole local expert
weights (read twice and written once per piece), which the compute-only reference never runs
(measured: see docs/measurements.md, MoE eager path). Here the GEMM's epilogue adds its float32 tile to the
accumulator's tile, so a piece costs its GEMM alone. ``torch._grouped_mm`` has no accumulating
form, hence the kernel.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from .triton_gate import INTERPRETED, runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path
    triton = None

_BM, _BN, _BK, _WARPS, _STAGES = 128, 256, 64, 8, 3  # the fastest of nine configurations on H200 (bench/probes/expert_wgrad_probe.py)


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                  accumulate: bool = True) -> torch.Tensor:
    """``out`` after the module reference (in place); ``ends`` an integer tensor on ``a``'s
    device, read there by the kernel where Triton runs (no host sync); on CUDA without Triton a
    grouped GEMM and an add (rounded twice), elsewhere a loop over the groups (read on the host)."""
    G, M, N = out.shape
    if (a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or a.shape[1] != M or b.shape[1] != N
            or ends.shape != (G,) or a.dtype != b.dtype or ends.dtype.is_floating_point
            or len({a.device, b.device, ends.device, out.device}) != 1 or not out.is_contiguous()):
        raise ValueError(f"grouped_wgrad: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}, ends "
                         f"{tuple(ends.shape)} {ends.dtype}, out {tuple(out.shape)} (contiguous: "
                         f"{out.is_contiguous()}); valid: a [R, M] and b [R, N] of one dtype, integer ends [G], "
                         "a contiguous out [G, M, N], all on one device")
    if runs_triton(a) and a.stride(1) == 1 and b.stride(1) == 1:
        if G and M and N:
            grid = (G * triton.cdiv(M, _BM) * triton.cdiv(N, _BN),)
            _wgrad_kernel[grid](out, a, b, ends, M, N, a.stride(0), b.stride(0), ACCUMULATE=accumulate,
                                IEEE=a.dtype == torch.float32, INTERPRETED=INTERPRETED, BM=_BM, BN=_BN, BK=_BK,
                                num_warps=_WARPS, num_stages=_STAGES)
        return out
    if a.is_cuda:
        g = torch._grouped_mm(a.t(), b, offs=ends.to(torch.int32))
        return out.add_(g) if accumulate else out.copy_(g)
    return grouped_wgrad_reference(a, b, ends, out, accumulate)


def grouped_wgrad_reference(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                            accumulate: bool = True) -> torch.Tensor:
    """The module reference in torch ops, a loop over the groups (``ends`` read on the host):
    ``out`` in place."""
    start = 0
    for g, end in enumerate(ends.tolist()):
        part = a[start:end].t().float() @ b[start:end].float()
        out[g].copy_(out[g].float() + part if accumulate else part)
        start = end
    return out


class WgradParts:
    """The parts of :func:`grouped_wgrad_parts`: ``a`` and ``b`` the parts' operands (part ``p``:
    ``a[p] [R_p, M]`` and ``b[p] [R_p, N]``, each with unit column stride, the same row stride in
    every part of ``a`` (and of ``b``), one dtype, 16-byte aligned), and where Triton takes them
    a table of their addresses on the device, written by one fill per address (no host-to-device
    copy: a graph can capture it): allocated on the current stream, written on ``stream`` where
    given (the caller orders that stream after the current one, and the kernel after it)."""

    def __init__(self, a, b, stream: Optional[torch.cuda.Stream] = None) -> None:
        self.a, self.b = list(a), list(b)
        t = self.a + self.b
        if (not self.a or len(self.a) != len(self.b) or any(x.dim() != 2 or x.stride(1) != 1 for x in t)
                or len({x.dtype for x in t}) != 1 or len({x.device for x in t}) != 1
                or len({x.shape[1] for x in self.a}) != 1 or len({x.shape[1] for x in self.b}) != 1
                or len({x.stride(0) for x in self.a}) != 1 or len({x.stride(0) for x in self.b}) != 1
                or any(x.shape[0] != y.shape[0] for x, y in zip(self.a, self.b))
                or any(x.data_ptr() % 16 for x in t)):
            raise ValueError("WgradParts: a " + str([(tuple(x.shape), x.stride(), x.dtype) for x in self.a]) + ", b "
                             + str([(tuple(x.shape), x.stride(), x.dtype) for x in self.b]) + "; valid: as many parts "
                             "in a as in b, each 2-D with unit column stride and as many rows as its b, the parts "
                             "of a alike in columns and row stride (those of b too), one dtype and device, "
                             "16-byte aligned")
        self.table = None
        if runs_triton(self.a[0]):
            self.table = torch.empty((2, len(self.a)), dtype=torch.int64, device=self.a[0].device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for i, side in enumerate((self.a, self.b)):
                    for p, x in enumerate(side):
                        self.table[i, p].fill_(x.data_ptr())


def grouped_wgrad_parts(parts: WgradParts, part: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                        out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """``out`` after the module's second reference (in place); ``part``, ``lo``, ``hi`` integer
    tensors ``[S, G]`` on the parts' device with ``0 <= lo <= hi <= R_part`` (read there by the
    kernel where Triton runs: no host sync; elsewhere read on the host by a loop over the
    segments)."""
    G, M, N = out.shape
    a0, b0 = parts.a[0], parts.b[0]
    tables = (part, lo, hi)
    if (a0.shape[1] != M or b0.shape[1] != N or len({t.shape for t in tables}) != 1 or part.dim() != 2
            or part.shape[1] != G or any(t.dtype.is_floating_point for t in tables)
            or len({a0.device, out.device, *(t.device for t in tables)}) != 1 or not out.is_contiguous()):
        raise ValueError(f"grouped_wgrad_parts: parts a [*, {a0.shape[1]}] and b [*, {b0.shape[1]}], part "
                         f"{tuple(part.shape)}, lo {tuple(lo.shape)}, hi {tuple(hi.shape)}, out {tuple(out.shape)} "
                         f"(contiguous: {out.is_contiguous()}); valid: out [G, M, N] contiguous for parts of a "
                         "[*, M] and b [*, N], integer part, lo and hi of one shape [S, G], all on one device")
    if parts.table is not None:
        S = part.shape[0]
        if G and M and N:
            grid = (G * triton.cdiv(M, _BM) * triton.cdiv(N, _BN),)
            _wgrad_parts_kernel[grid](out, parts.table[0], parts.table[1], a0, b0, part.contiguous(), lo.contiguous(),
                                      hi.contiguous(), S, G, M, N, a0.stride(0), b0.stride(0),
                                      ACCUMULATE=accumulate, IEEE=a0.dtype == torch.float32, INTERPRETED=INTERPRETED,
                                      BM=_BM, BN=_BN, BK=_BK, num_warps=_WARPS, num_stages=_STAGES)
        return out
    return grouped_wgrad_parts_reference(parts.a, parts.b, part, lo, hi, out, accumulate)


def grouped_wgrad_parts_reference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], part: torch.Tensor,
                                  lo: torch.Tensor, hi: torch.Tensor, out: torch.Tensor,
                                  accumulate: bool = False) -> torch.Tensor:
    """The module's second reference in torch ops, a loop over the segments (read on the host),
    for the parts ``a`` and ``b``: ``out`` in place."""
    acc = out.float() if accumulate else torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for s_part, s_lo, s_hi in zip(part.tolist(), lo.tolist(), hi.tolist()):
        for g, (p, i, j) in enumerate(zip(s_part, s_lo, s_hi)):
            acc[g] += a[p][i:j].t().float() @ b[p][i:j].float()
    return out.copy_(acc)


if triton is not None:
    @triton.jit
    def _wgrad_step(acc, a_ptr, b_ptr, sa, sb, M, N, rows, end, rm, rn, IEEE: tl.constexpr,
                    INTERPRETED: tl.constexpr):
        live = rows < end
        at = tl.load(a_ptr + rows[:, None] * sa + rm[None, :], mask=live[:, None] & (rm[None, :] < M), other=0.0)
        bt = tl.load(b_ptr + rows[:, None] * sb + rn[None, :], mask=live[:, None] & (rn[None, :] < N), other=0.0)
        if INTERPRETED:  # the interpreter's dot of 16-bit floats is wrong; their float32 products are exact
            at = at.to(tl.float32)
            bt = bt.to(tl.float32)
        return tl.dot(tl.trans(at), bt, acc, input_precision="ieee" if IEEE or INTERPRETED else "tf32")

    @triton.jit
    def _wgrad_kernel(out_ptr, a_ptr, b_ptr, ends_ptr, M, N, sa, sb, ACCUMULATE: tl.constexpr, IEEE: tl.constexpr,
                      INTERPRETED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """One [BM, BN] tile of one group's gradient per program, the tiles of a group adjacent
        (its rows stay in L2 while they run); float32 operands multiplied in full precision (IEEE),
        as torch's float32 GEMMs are by default, not in TF32."""
        g, rm, rn = _wgrad_tile(M, N, BM, BN)
        start = tl.where(g > 0, tl.load(ends_ptr + tl.maximum(g - 1, 0)), 0).to(tl.int64)
        end = tl.load(ends_ptr + g).to(tl.int64)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if INTERPRETED:  # Triton's interpreter takes no loop bound from a load in a for (the same steps)
            k0 = start
            while k0 < end:
                acc = _wgrad_step(acc, a_ptr, b_ptr, sa, sb, M, N, k0 + rk, end, rm, rn, IEEE, INTERPRETED)
                k0 += BK
        else:  # compiled: a for, which Triton pipelines (a while it would not)
            for i in range(0, tl.cdiv(end - start, BK)):
                acc = _wgrad_step(acc, a_ptr, b_ptr, sa, sb, M, N, start + i * BK + rk, end, rm, rn, IEEE,
                                   INTERPRETED)
        _wgrad_store(acc, out_ptr, g, M, N, rm, rn, ACCUMULATE)

    @triton.jit
    def _wgrad_tile(M, N, BM: tl.constexpr, BN: tl.constexpr):
        """This program's group and its tile's rows and columns of the gradient."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BM)
        tiles_n = tl.cdiv(N, BN)
        t = pid % (tiles_m * tiles_n)
        return pid // (tiles_m * tiles_n), (t // tiles_n) * BM + tl.arange(0, BM), (t % tiles_n) * BN + tl.arange(0, BN)

    @triton.jit
    def _wgrad_store(acc, out_ptr, g, M, N, rm, rn, ACCUMULATE: tl.constexpr):
        o = out_ptr + g.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
        om = (rm[:, None] < M) & (rn[None, :] < N)
        if ACCUMULATE:
            acc += tl.load(o, mask=om, other=0.0).to(tl.float32)
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=om)

    @triton.jit
    def _wgrad_parts_kernel(out_ptr, a_table, b_table, a_ref, b_ref, part_ptr, lo_ptr, hi_ptr, S, G, M, N, sa, sb,
                            ACCUMULATE: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """:func:`_wgrad_kernel`'s tiles, each summing its group's segments in turn (their parts'
        addresses read from the tables; ``a_ref``, ``b_ref`` give the element types)."""
        g, rm, rn = _wgrad_tile(M, N, BM, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if INTERPRETED:  # as in _wgrad_kernel: whiles, the interpreter's for taking no bound from an argument
            s = 0
            while s < S:
                p = tl.load(part_ptr + s * G + g)
                k0 = tl.load(lo_ptr + s * G + g).to(tl.int64)
                end = tl.load(hi_ptr + s * G + g).to(tl.int64)
                a_ptr = tl.load(a_table + p).to(tl.pointer_type(a_ref.dtype.element_ty))
                b_ptr = tl.load(b_table + p).to(tl.pointer_type(b_ref.dtype.element_ty))
                while k0 < end:
                    acc = _wgrad_step(acc, a_ptr, b_ptr, sa, sb, M, N, k0 + rk, end, rm, rn, IEEE, INTERPRETED)
                    k0 += BK
                s += 1
        else:
            for s in range(0, S):
                p = tl.load(part_ptr + s * G + g)
                start = tl.load(lo_ptr + s * G + g).to(tl.int64)
                end = tl.load(hi_ptr + s * G + g).to(tl.int64)
                a_ptr = tl.multiple_of(tl.load(a_table + p).to(tl.pointer_type(a_ref.dtype.element_ty)), 16)
                b_ptr = tl.multiple_of(tl.load(b_table + p).to(tl.pointer_type(b_ref.dtype.element_ty)), 16)
                for i in range(0, tl.cdiv(end - start, BK)):
                    acc = _wgrad_step(acc, a_ptr, b_ptr, sa, sb, M, N, start + i * BK + rk, end, rm, rn, IEEE,
                                      INTERPRETED)
        _wgrad_store(acc, out_ptr, g, M, N, rm, rn, ACCUMULATE)
