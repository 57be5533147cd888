"""The MoE rank chunks' grouped-GEMM offsets of their pieces in one launch (Triton), for
``layers/moe/ranks.py``'s ``piece_offsets``.

Reference (:func:`piece_offsets_reference`), from ``counts [ws, El]`` (rows from source s per
local expert of ``rank``; any strides), ``[ws + 2, El]`` int32::

    out[2 + j] = cumsum(counts[(rank + j) % ws])       (own rows, then the peers in step order)
    out[0]     = min(out[2], m)                          (the first part of the own rows: [0, m))
    out[1]     = out[2] - out[0]                         (the second part: the rest)
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path
    triton = None


def piece_offsets_reference(counts: torch.Tensor, rank: int, m: int) -> torch.Tensor:
    """The module reference in torch ops (four launches)."""
    ws, El = counts.shape
    out = counts.new_empty((ws + 2, El), dtype=torch.int32)
    # own, then the peers in step order
    ends = torch.cumsum(torch.roll(counts, -rank, 0), 1, dtype=torch.int32, out=out[2:])
    torch.clamp(ends[:1], max=m, out=out[:1])  # the first part: own rows [0, m)
    torch.sub(ends[:1], out[:1], out=out[1:2])  # the second part: the rest
    return out


def piece_offsets_fused(counts: torch.Tensor, rank: int, m: int) -> torch.Tensor:
    """The module reference by one kernel (where Triton runs on ``counts``' device)."""
    ws, El = counts.shape
    out = counts.new_empty((ws + 2, El), dtype=torch.int32)
    _piece_offsets_kernel[(1,)](counts, out, rank, m, counts.stride(0), counts.stride(1), WS=ws, EL=El,
                                EL_P2=triton.next_power_of_2(El), num_warps=1)
    return out


if triton is not None:
    @triton.jit
    def _piece_offsets_kernel(counts_ptr, out_ptr, rank, m, s0, s1, WS: tl.constexpr, EL: tl.constexpr,
                              EL_P2: tl.constexpr):
        """the module reference: row ``2 + j`` the cumulative counts of source ``(rank + j) % WS``,
        row 0 those of the own rows clamped to ``m``, row 1 the rest."""
        e = tl.arange(0, EL_P2)
        live = e < EL
        for j in tl.static_range(WS):
            s = (rank + j) % WS
            ends = tl.cumsum(tl.load(counts_ptr + s * s0 + e * s1, mask=live, other=0).to(tl.int32), 0)
            tl.store(out_ptr + (2 + j) * EL + e, ends, mask=live)
            if j == 0:
                first = tl.minimum(ends, m)
                tl.store(out_ptr + e, first, mask=live)
                tl.store(out_ptr + EL + e, ends - first, mask=live)
