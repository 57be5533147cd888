"""overlap_layers: drop-in parallel transformer layers that hide communication under compute."""
from .config import OverlapConfig
from .layers import OverlapAttention, OverlapMLP, reduce_replicated_grads
from .layers import UlyssesAttention
from .plot import plot_timeline
from .runtime.group import PlanMismatchError

__all__ = ["OverlapAttention", "OverlapConfig", "OverlapMLP", "PlanMismatchError", "plot_timeline", "reduce_replicated_grads", "UlyssesAttention"]
__version__ = "0.1.0"
