"""Tiling rules shared by the layers.

Tiles follow ``torch.tensor_split`` semantics: ``n`` rows in ``k`` tiles gives the first
``n % k`` tiles one extra row (n=5, k=4: 2, 1, 1, 1). The effective tile count is
``min(k, n)`` (never an empty tile) and is what a layer reports.
"""
from __future__ import annotations

from typing import List, Tuple

# Interim rule for num_tiles="auto" until the planner lands: a tile must carry at least this
# many gathered rows (tokens of the whole group) for its GEMMs to stay efficient.
AUTO_MIN_ROWS_PER_TILE = 4096


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


def interim_num_tiles(gathered_rows: int) -> int:
    """K for ``num_tiles="auto"`` before the planner: 2 when both tiles keep at least
    :data:`AUTO_MIN_ROWS_PER_TILE` gathered rows, else 1 (the serial layer)."""
    return 2 if gathered_rows >= 2 * AUTO_MIN_ROWS_PER_TILE else 1
