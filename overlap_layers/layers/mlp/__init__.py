"""The tensor-parallel MLP (:class:`~.layer.OverlapMLP`)."""
from .layer import OverlapMLP

__all__ = ["OverlapMLP"]
