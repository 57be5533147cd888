"""The checks of a planned layer's arguments and inputs, each the same on every rank for the same
arguments (an input's error is a code the call's agreement gathers, so that every rank raises)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..config import OverlapConfig, check_num_tiles


def resolve_config(config: Optional[OverlapConfig], num_tiles):
    """``(config, K or "auto")`` from a layer's ``config=`` and ``num_tiles=`` arguments (an explicit
    ``num_tiles`` overrides ``config.num_tiles``); ValueError on anything else."""
    if config is None:
        config = OverlapConfig()
    elif not isinstance(config, OverlapConfig):
        raise ValueError(f"config={config!r}; must be an overlap_layers.OverlapConfig or None")
    return config, check_num_tiles(config.num_tiles if num_tiles is None else num_tiles)


def finite_number(v, zero_ok: bool = False) -> bool:
    """Whether ``v`` is a real number (an int or a float, not a bool), finite and positive (or
    zero, with ``zero_ok``): the check of the layers' float arguments."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and v < math.inf
            and (v >= 0 if zero_ok else v > 0))


def check_dtype(dtype) -> None:
    """ValueError unless a layer's ``dtype=`` is None (torch's default) or a floating-point
    ``torch.dtype`` (its parameters require grad)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r}; must be None (torch's default) or a floating-point torch.dtype")


X_ERRORS = {
    1: "input must be 3-D [batch, seq, hidden]",
    2: "input hidden dim must equal hidden_size",
    3: "input dtype must be floating and equal the weights' dtype outside autocast",
    4: "input must be on the weights' device",
}


def x_error(x, hidden_size: int, weight: torch.Tensor) -> int:
    """This rank's error code for a layer input ``x`` (0 if fine; keys of :data:`X_ERRORS`)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return 1
    if x.shape[-1] != hidden_size:
        return 2
    if x.device != weight.device:
        return 4
    if not x.is_floating_point() or (x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type)):
        return 3
    return 0
