"""Tiling rules shared by the layers.

Tiles follow ``torch.tensor_split`` semantics: ``n`` rows in ``k`` tiles gives the first
``n % k`` tiles one extra row (n=5, k=4: 2, 1, 1, 1). The effective tile count is
``min(k, n)`` (never an empty tile) and is what a layer reports.
"""
from __future__ import annotations

from typing import List, Tuple

def tile_bounds(n: int, k: int) -> List[Tuple[int, int]]:
    """``[start, stop)`` row ranges of ``min(k, n)`` tiles, ``torch.tensor_split`` style."""
    k = max(1, min(k, n))
    base, extra = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def effective_num_tiles(n: int, k: int) -> int:
    return max(1, min(k, n))

