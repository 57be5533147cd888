"""overlap_layers: drop-in parallel transformer layers that hide communication under compute."""
from .config import OverlapConfig
from .integrations import swap
from .integrations.dtensor import distribute_params, param_groups
from .layers import (OverlapAttention, OverlapMLP, OverlapMoE, OverlapTransformerBlock, RouterKind, Routing,
                     UlyssesAttention, finalize_grads, load_plans, reduce_replicated_grads, save_plans)
from .plot import plot_timeline
from .runtime.group import PlanMismatchError

__all__ = ["OverlapAttention", "OverlapConfig", "OverlapMLP", "OverlapMoE", "OverlapTransformerBlock",
           "PlanMismatchError", "RouterKind", "Routing", "UlyssesAttention", "distribute_params", "finalize_grads", "load_plans",
           "param_groups", "plot_timeline", "reduce_replicated_grads", "save_plans", "swap"]
__version__ = "0.1.0"
