"""The layers: they describe tile programs and never schedule."""
from .attention import OverlapAttention
from .block import OverlapTransformerBlock
from .grads import finalize_grads, reduce_replicated_grads
from .mlp import OverlapMLP
from .moe import OverlapMoE
from .planned import TilePlan
from .ulysses import UlyssesAttention

__all__ = ["OverlapAttention", "OverlapMLP", "OverlapMoE", "OverlapTransformerBlock", "finalize_grads",
           "reduce_replicated_grads", "TilePlan", "UlyssesAttention"]
