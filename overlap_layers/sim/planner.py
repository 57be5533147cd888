"""Choosing among candidate plans by their simulated time, under a memory budget.

Reference: the chosen plan is the candidate with the smallest predicted time whose predicted
peak fits the budget, except that the serial plan (K=1) is kept unless the best candidate beats
it by more than ``margin`` (a fraction). Ties go to fewer tiles. If nothing fits the budget the
smallest-peak candidate is chosen and the reason says so. Pure function of its inputs, so equal
inputs on every rank give equal choices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..config import Decomposition, Transport


def plan_label(decomposition: str, transport: str, num_tiles: int) -> str:
    """``K=2``, ``rank chunks over copy_engine``, or ``rank chunks over copy_engine, K=2`` (rank
    chunks inside batch tiles)."""
    if decomposition != Decomposition.RANK:
        return f"K={num_tiles}"
    return f"rank chunks over {transport}" + (f", K={num_tiles}" if num_tiles > 1 else "")


@dataclass(frozen=True)
class Candidate:
    num_tiles: int
    regather: bool
    buckets_fwd: tuple
    buckets_bwd: tuple
    predicted_ms: float
    exposed_comm_ms: float
    peak_bytes: int
    decomposition: Decomposition = Decomposition.BATCH  # or RANK: split by source rank (docs/architecture.md, Transports)
    transport: Transport = Transport.NCCL  # or COPY_ENGINE

    def __post_init__(self) -> None:
        # the strings of Decomposition and Transport as their members (others stay as given)
        object.__setattr__(self, "decomposition", Decomposition.coerce(self.decomposition))
        object.__setattr__(self, "transport", Transport.coerce(self.transport))

    @property
    def is_serial(self) -> bool:
        return (self.num_tiles == 1 and not self.regather and not self.buckets_fwd and not self.buckets_bwd
                and self.decomposition == Decomposition.BATCH)

    @property
    def label(self) -> str:
        """For reasons and tables: see :func:`plan_label`."""
        return plan_label(self.decomposition, self.transport, self.num_tiles)


@dataclass(frozen=True)
class Choice:
    candidate: Candidate
    candidates: Tuple[Candidate, ...]
    reason: str


def choose(candidates: Sequence[Candidate], *, budget_bytes: Optional[int] = None,
           margin: float = 0.03) -> Choice:
    if not candidates:
        raise ValueError("choose() needs at least one candidate")
    serial = next((c for c in candidates if c.is_serial), None)
    fits = [c for c in candidates if budget_bytes is None or c.peak_bytes <= budget_bytes]
    key = lambda c: (c.predicted_ms, c.num_tiles, c.peak_bytes, c.regather)  # noqa: E731
    if not fits:
        best = min(candidates, key=lambda c: (c.peak_bytes, c.predicted_ms, c.num_tiles))
        return Choice(best, tuple(candidates),
                      f"no candidate fits the memory budget of {budget_bytes} bytes; chose the smallest "
                      f"predicted peak ({best.peak_bytes} bytes)")
    best = min(fits, key=key)
    if serial is not None and serial in fits and not best.is_serial:
        if best.predicted_ms > serial.predicted_ms * (1.0 - margin):
            return Choice(serial, tuple(candidates),
                          f"kept K=1: the best tiled plan ({best.label}, {best.predicted_ms:.3f} ms) "
                          f"does not beat serial ({serial.predicted_ms:.3f} ms) by more than {margin:.0%}")
        return Choice(best, tuple(candidates),
                      f"{best.label} predicted {best.predicted_ms:.3f} ms vs serial "
                      f"{serial.predicted_ms:.3f} ms ({1 - best.predicted_ms / serial.predicted_ms:.1%} faster)")
    why = "serial is the fastest candidate" if best.is_serial else \
        "serial does not fit the memory budget" if serial is not None else "no serial candidate"
    return Choice(best, tuple(candidates), f"{best.label}: {why}")
