"""The entry of a planned layer's ``forward``: a call under ``torch.compile`` becomes one opaque op
([Note: compiled calls] in ``planning/compiled.py``), and a DTensor input runs on its local tensor
([Note: DTensor inputs] in ``planning/dtensor.py``)."""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from .compiled import can_compile, compiled_call
from .dtensor import dtensor_forward


def planned_forward(forward: Callable) -> Callable:
    """Decorator of a planned layer's ``forward(self, x, ...)``: a plain ``x`` runs ``forward``
    unchanged; a DTensor ``x`` runs it on ``x``'s local tensor and returns a DTensor with ``x``'s
    placements, the layer's planner told so (:meth:`LayerPlanner.dtensor_call`). While
    ``torch.compile`` traces, the call becomes one opaque op."""
    @functools.wraps(forward)
    def wrapper(self, x, *args, **kwargs):
        if torch.compiler.is_compiling() and can_compile(self, x):
            extras = self._compiled_extras(*args, **kwargs)
            if extras is not None:
                return compiled_call(self, x, extras)
        if not isinstance(x, DTensor):
            return forward(self, x, *args, **kwargs)
        with self.planner.dtensor_call(x):
            return dtensor_forward(self, functools.partial(forward, self), x, *args, **kwargs)
    return wrapper
