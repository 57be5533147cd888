"""Weight initialisation the layer families share."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def init_linear_(w: torch.Tensor, b: Optional[torch.Tensor]) -> None:
    """In place, as ``nn.Linear(w.shape[1], w.shape[0])`` initialises its weight then bias."""
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    if b is not None:
        bound = 1 / math.sqrt(w.shape[1])
        b.uniform_(-bound, bound)
