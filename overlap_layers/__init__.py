"""overlap_layers: drop-in parallel transformer layers that hide communication under compute."""
from .config import OverlapConfig
from .integrations import swap
from .layers import OverlapAttention, OverlapMLP, OverlapMoE, UlyssesAttention, reduce_replicated_grads
from .plot import plot_timeline
from .runtime.group import PlanMismatchError
from .layers import finalize_grads

__all__ = ["OverlapAttention", "OverlapConfig", "OverlapMLP", "OverlapMoE", "PlanMismatchError", "UlyssesAttention",
           "plot_timeline", "reduce_replicated_grads", "swap"]
__all__ += ["finalize_grads"]
__version__ = "0.1.0"
