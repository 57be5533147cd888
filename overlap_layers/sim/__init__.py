"""Discrete-event simulator of a schedule on the streams, with a cost model (pure Python)."""
from .simulator import Costs, Event, Timeline, simulate

__all__ = ["Costs", "Event", "Timeline", "simulate"]
