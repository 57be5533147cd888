"""Row layouts of the MoE's exchange: the permutation between rows grouped by one key, then
another, and the same rows grouped the other way round (the K-tile exchange groups each tile's
received rows by local expert with it; the rank pieces gather their weight gradients' operands
expert-major with it).

Reference: :func:`regroup_index` equals, for ``counts [K, A, B]``, the argsort (stable) of the
rows' ``(tile, b, a)`` keys when the rows are laid out in ``(tile, a, b)`` order, each tile's
positions counted from its first row.
"""
from __future__ import annotations

import torch


def regroup_index(counts: torch.Tensor, size: int) -> torch.Tensor:
    """Rows laid out tile by tile, each tile grouped by ``a`` then ``b`` (``counts [K, A, B]`` rows
    per group) -> for each position of the same rows grouped by tile, then ``b``, then ``a``, the
    row it takes, counted from its tile's first row. ``size`` is any bound on ``counts.sum()``
    known to the host (positions past the sum hold rows in range but are meaningless), so the
    device never syncs. The inverse is ``regroup_index(counts.transpose(1, 2), size)``."""
    K = counts.shape[0]
    lengths = counts.transpose(1, 2).reshape(-1)  # groups in (tile, b, a) order
    ends = torch.cumsum(lengths, 0)
    flat = counts.reshape(-1)
    tile_rows = counts.sum((1, 2))
    src_start = (torch.cumsum(flat, 0) - flat).view_as(counts) - (torch.cumsum(tile_rows, 0) - tile_rows).view(K, 1, 1)
    shift = src_start.transpose(1, 2).reshape(-1) - (ends - lengths)
    p = torch.arange(size, device=counts.device)
    group = torch.searchsorted(ends, p, right=True).clamp_(max=lengths.numel() - 1)
    return p + shift[group]
