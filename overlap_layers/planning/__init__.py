"""Planning a layer call: what a planned layer describes (:class:`.layer_spec.TiledLayer`, the
hooks it provides), the planner each layer owns (:class:`.planner.LayerPlanner`: per-call
agreement, plan cache and first-call verification, plan making from calibrated numbers and
simulated candidates, recomputation, CUDA-graph calls, traces), the tile plan type, and the
``torch.compile``, DTensor and copy support of the layers."""
from .plan import TilePlan

__all__ = ["TilePlan"]
