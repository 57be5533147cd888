"""Planning a layer call: the tile plan type, the candidates a layer offers and their costs
simulated, calibration on the device and its disk cache, measured traces, first-call
verification, and the machinery every planned layer shares (:class:`.planned.PlannedLayer`:
per-call agreement, plan cache, CUDA-graph calls, ``torch.compile`` calls, copies)."""
from .plan import TilePlan

__all__ = ["TilePlan"]
