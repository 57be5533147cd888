"""The layers: they describe tile programs and never schedule."""
from .mlp import OverlapMLP, reduce_replicated_grads

__all__ = ["OverlapMLP", "reduce_replicated_grads"]
