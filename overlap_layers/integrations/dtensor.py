"""DTensors for users of the layers: optimizer parameter groups (:func:`param_groups`), and the
layers' DTensor parameters and inputs ([Note: DTensor parameters], [Note: DTensor inputs]), which
live in :mod:`overlap_layers.planning.dtensor` and are re-exported here."""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from ..planning.dtensor import Layout, as_dtensor_params, axis_mesh, dtensor_forward, local

__all__ = ["Layout", "as_dtensor_params", "axis_mesh", "dtensor_forward", "local", "param_groups"]


def param_groups(params, **options) -> list:
    """``params`` (an iterable of parameters, or a module's) as optimizer parameter groups: the
    DTensors in one group, the plain tensors in another, each with ``options``. Foreach and fused
    optimizers (``torch.optim.AdamW(..., foreach=True)`` or ``fused=True``, the CUDA defaults) run
    one kernel over a group and fail on a group mixing DTensors and plain tensors (a ``mesh=``
    layer inside a model whose other parameters stay plain); DTensors of different meshes or
    placements may share a group. Order is kept within each group; empty groups are left out."""
    if isinstance(params, nn.Module):
        params = params.parameters()
    dts, plain = [], []
    for p in params:
        (dts if isinstance(p, DTensor) else plain).append(p)
    return [dict(options, params=g) for g in (dts, plain) if g]
