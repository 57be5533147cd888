"""The transformer block (:class:`~.layer.OverlapTransformerBlock`): attention then MLP or MoE,
each behind its norm, and their batch tiles fused into one program (:mod:`.fused`)."""
from .layer import OverlapTransformerBlock

__all__ = ["OverlapTransformerBlock"]
