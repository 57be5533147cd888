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


def interim_num_tiles(gathered_rows: int) -> int:
    """K for ``num_tiles="auto"`` until the planner lands: 1, the serial layer.

    Measured on 4xH200 with NVLink (bench/results/mlp_nvlink_h200.md), a fixed K=2 split with
    NCCL was 0.99-1.08x the serial layer's time on the llama3 MLP shapes, never a clear win, so
    without a cost model the safe choice is not to tile.
    """
    return 1
