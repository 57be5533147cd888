"""The layers: they describe tile programs and never schedule. One subpackage per family (mlp,
attention, moe, block) over what they share (common); :mod:`.grads` finishes the gradients of
any of them."""
from ..planning import TilePlan
from .attention import OverlapAttention, UlyssesAttention
from .block import OverlapTransformerBlock
from .grads import finalize_grads, reduce_replicated_grads
from .mlp import OverlapMLP
from .moe import OverlapMoE

__all__ = ["OverlapAttention", "OverlapMLP", "OverlapMoE", "OverlapTransformerBlock", "finalize_grads",
           "reduce_replicated_grads", "TilePlan", "UlyssesAttention"]
