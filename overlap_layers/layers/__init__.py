"""The layers: they describe tile programs and never schedule. One subpackage per family (mlp,
attention, moe, block) over what they share (common); :mod:`.grads` finishes the gradients of
any of them; :mod:`.plan_files` writes and reads their settled plans."""
from ..planning import TilePlan
from .attention import OverlapAttention, UlyssesAttention
from .block import OverlapTransformerBlock
from .grads import finalize_grads, reduce_replicated_grads
from .mlp import OverlapMLP
from .moe import OverlapMoE, RouterKind, Routing
from .plan_files import load_plans, save_plans

__all__ = ["OverlapAttention", "OverlapMLP", "OverlapMoE", "OverlapTransformerBlock", "finalize_grads",
           "load_plans", "reduce_replicated_grads", "RouterKind", "Routing", "save_plans", "TilePlan",
           "UlyssesAttention"]
