"""CUDA streams for tiles: created lazily per layer, reused across calls.

``torch.cuda.Stream()`` draws from c10's per-device stream pool, so streams are cheap; each layer
keeps the ones it drew so tile t always runs on the same stream (forward and backward), which
keeps saved tensors on the stream that allocated them.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch


class StreamPool:
    def __init__(self) -> None:
        self._streams: Dict[int, List["torch.cuda.Stream"]] = {}

    def get(self, device: torch.device, count: int) -> Optional[List["torch.cuda.Stream"]]:
        """``count`` compute streams on ``device``; None on a non-CUDA device."""
        if device.type != "cuda":
            return None
        idx = device.index if device.index is not None else torch.cuda.current_device()
        have = self._streams.setdefault(idx, [])
        while len(have) < count:
            have.append(torch.cuda.Stream(device=idx))
        return have[:count]
