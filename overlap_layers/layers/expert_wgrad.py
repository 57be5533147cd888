"""The experts' weight gradients of a piece of rows, added into the accumulator inside the GEMM
(Triton on CUDA, torch ops elsewhere).

Reference (``a [R, M]``, ``b [R, N]``: rows grouped by expert, ``ends [G]`` the groups' ends, so
group ``g`` is rows ``ends[g-1] .. ends[g]`` (from 0 for the first); ``out [G, M, N]``)::

    out[g] (+)= a[ends[g-1]:ends[g]].T @ b[ends[g-1]:ends[g]]      (summed in float32, the sum
                                                                   with out's old value too, and
                                                                   rounded once to out's dtype)

with ``+=`` where ``accumulate``, else ``=``; rows past ``ends[-1]`` are not read.

[Note: expert weight gradients in the GEMM]
The rank-chunk MoE backward computes each source's weight gradients as its rows arrive
(``moe_ranks.py``, [Note: MoE weight-gradient accumulation]): with many small experts, one grouped
GEMM per projection per piece; until session 39 each piece after the first then added its result
to the accumulator. On 2x H200
(qwen3-30b-a3b, EP 2, 8192 tokens, session 39) the adds of the second piece were two elementwise
kernels of 273 and 139 us (the accumulators are the layer's whole local expert weights, read twice
and written once), 0.41 ms of a 6.8 ms forward+backward that the compute-only reference never
runs; at EP 4 three pieces add three times. Here the GEMM's epilogue adds its float32 tile to the
accumulator's tile, so a piece costs its GEMM alone. ``torch._grouped_mm`` has no accumulating
form, hence the kernel.
"""
from __future__ import annotations

import torch

from ..runtime.triton_gate import INTERPRETED, runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path
    triton = None

_BM, _BN, _BK, _WARPS, _STAGES = 128, 256, 64, 8, 3  # the fastest of nine on H200 (bench/expert_wgrad_probe.py)


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
    start = 0
    for g, end in enumerate(ends.tolist()):
        part = a[start:end].t().float() @ b[start:end].float()
        out[g].copy_(out[g].float() + part if accumulate else part)
        start = end
    return out


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
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BM)
        tiles_n = tl.cdiv(N, BN)
        g = pid // (tiles_m * tiles_n)
        t = pid % (tiles_m * tiles_n)
        rm = (t // tiles_n) * BM + tl.arange(0, BM)
        rn = (t % tiles_n) * BN + tl.arange(0, BN)
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
        o = out_ptr + g.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
        om = (rm[:, None] < M) & (rn[None, :] < N)
        if ACCUMULATE:
            acc += tl.load(o, mask=om, other=0.0).to(tl.float32)
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=om)
