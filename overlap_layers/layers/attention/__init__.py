"""Attention: the tensor-parallel :class:`~.layer.OverlapAttention` (its core, query chunks and
cost model beside it) and the sequence-parallel :class:`~.ulysses.UlyssesAttention`."""
from .layer import OverlapAttention
from .ulysses import UlyssesAttention

__all__ = ["OverlapAttention", "UlyssesAttention"]
