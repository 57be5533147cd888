"""The expert-parallel MoE (:class:`~.layer.OverlapMoE`): routing, the rank-chunk and device
paths, the combine, and its cost model."""
from .layer import OverlapMoE
from .routing import RouterKind, Routing

__all__ = ["OverlapMoE", "RouterKind", "Routing"]
