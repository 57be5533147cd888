"""Cost model, discrete-event simulator and planner (pure Python, no torch.distributed)."""
from .costmodel import COMM_KINDS, HardwareModel, analytic_model
from .planner import Candidate, Choice, choose
from .simulator import Costs, Event, Timeline, chrome_trace, simulate

__all__ = ["COMM_KINDS", "HardwareModel", "analytic_model", "Candidate", "Choice", "choose",
           "Costs", "Event", "Timeline", "chrome_trace", "simulate"]
