"""The tile plan: what one call of a planned layer runs (:class:`TilePlan`), the plans first-call
verification times against the planner's (:func:`contenders`), the plan of a simulated
candidate (:func:`plan_of`), and a plan explained as text (:func:`explain`)."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Optional

from ..config import Decomposition, Transport
from ..sim.planner import plan_label


@dataclass(frozen=True)
class TilePlan:
    """What one call of a layer runs: tiles, buckets per collective, backward strategy.

    ``predicted_ms`` / ``predicted_peak_bytes`` / ``reason`` / ``candidates`` explain a planner's
    choice (None / empty for a fixed or pinned plan), and ``verification`` the first-call
    verification's numbers (:class:`~overlap_layers.planning.plan_cache.PlanCache`); none of them
    changes what runs."""

    num_tiles: int
    buckets_fwd: tuple = ()
    buckets_bwd: tuple = ()
    regather: bool = False  # backward re-gathers x instead of saving the gathered input
    num_streams: int = 2
    transport: Transport = Transport.NCCL  # or COPY_ENGINE (rank decomposition only)
    decomposition: Decomposition = Decomposition.BATCH  # or RANK: split by source rank (layers/common/rank_chunks.py)
    # SMs the GEMMs leave free in (forward, backward) where the plan overlaps NCCL collectives with
    # them (:attr:`carved_sms`; [Note: SM carveout]); changes no collective
    carveout: tuple = ()
    predicted_ms: Optional[float] = field(default=None, compare=False)
    predicted_peak_bytes: Optional[int] = field(default=None, compare=False)
    reason: str = field(default="", compare=False)
    candidates: tuple = field(default=(), compare=False, repr=False)
    verification: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        # the strings of Transport and Decomposition as their members (others stay, for the checks)
        object.__setattr__(self, "transport", Transport.coerce(self.transport))
        object.__setattr__(self, "decomposition", Decomposition.coerce(self.decomposition))

    @property
    def buckets(self) -> dict:
        return {"fwd": dict(self.buckets_fwd), "bwd": dict(self.buckets_bwd)}

    @property
    def is_serial(self) -> bool:
        return (self.num_tiles == 1 and not self.buckets_fwd and not self.buckets_bwd and not self.regather
                and self.decomposition == Decomposition.BATCH)

    def runs_plain(self, trace, launch_log) -> bool:
        """Whether a call under this plan runs as plain torch ops: a serial plan in a call that
        records no ``trace`` or ``launch_log`` ([Note: plain serial calls] in
        ``layers/common/plain_tp.py``)."""
        return self.is_serial and trace is None and launch_log is None

    def carved_sms(self, backward: bool) -> int:
        """SMs the pass's GEMMs leave free: :attr:`carveout`'s, where the plan overlaps NCCL
        collectives with its GEMMs (batch tiles, K > 1); else 0."""
        overlaps = self.num_tiles > 1 and self.decomposition == Decomposition.BATCH and self.transport == Transport.NCCL
        return self.carveout[int(backward)] if overlaps and self.carveout else 0

    @property
    def label(self) -> str:
        """See :func:`~overlap_layers.sim.planner.plan_label`."""
        return plan_label(self.decomposition, self.transport, self.num_tiles)

    def digest(self) -> int:
        """Equal on every rank for plans that run the same collectives (``hash()`` is salted)."""
        key = (self.num_tiles, self.buckets_fwd, self.buckets_bwd, self.regather, self.num_streams, self.transport,
               self.decomposition)
        return zlib.crc32(repr(key).encode())


# A serial plan is timed against rivals predicted within this fraction of it. The model's error is
# this large: on 4x H200 (TP 4, llama3-8b MLP) rank chunks over the copy engine were predicted 7-25%
# slower than K=1 and ran 5-19% faster as CUDA-graph replays (bench/results/graphs_h200x4_2026-11-26.md).
VERIFY_CLOSE = 0.25


def contenders(plan: TilePlan, budget: Optional[int] = None) -> list:
    """What first-call verification times, the plain layer (K=1) last, each carrying ``plan``'s
    explanation and its own prediction. For a tiled ``plan``: ``plan``, the best-predicted
    candidate within ``budget`` (the planner's memory budget, as :func:`~overlap_layers.sim.choose`
    applies it) of each other kind (batch tiles with fewer tiles than a batch-tiled ``plan``, with
    at most half as many where the best of those is another plan, and with more; or with another
    K > 1; rank chunks per transport), then K=1. For a serial
    ``plan``: the same rivals, only those predicted at most :data:`VERIFY_CLOSE` slower than K=1
    (the model cannot tell them apart), then K=1; or ``[plan]`` alone."""
    def as_plan(c):
        return plan_of(c, reason=plan.reason, candidates=plan.candidates, carveout=plan.carveout,
                       num_streams=plan.num_streams)

    def best(cands):
        return min(cands, key=lambda c: (c.predicted_ms, c.num_tiles))

    serial = next((c for c in plan.candidates if c.is_serial), None)
    kinds = {}
    for c in plan.candidates:
        kind = (c.decomposition, c.transport)
        if c.decomposition == Decomposition.BATCH:
            same = c.num_tiles == 1 or (plan.decomposition == Decomposition.BATCH and c.num_tiles == plan.num_tiles)
            if plan.decomposition == Decomposition.BATCH and plan.num_tiles > 1:  # the model may misjudge either way
                kind += ("fewer tiles" if c.num_tiles < plan.num_tiles else "more tiles",)
        else:
            same = kind == (plan.decomposition, plan.transport)
        if same or (budget is not None and c.peak_bytes > budget):
            continue
        if plan.is_serial and (serial is None or c.predicted_ms > serial.predicted_ms * (1 + VERIFY_CLOSE)):
            continue
        kinds.setdefault(kind, []).append(c)
    # The model favours many tiles (it does not see NCCL slowed beside the GEMMs, nor the host's cost
    # per tile): with P2P disabled on 2x H200 it put K=6 and K=8 ahead of K=4, which ran 6-16% faster
    # (docs/measurements.md, Planner: "P2P off, half the tiles"). So a plan of K >= 4 is also timed against the
    # best plan of at most half its tiles, not only against the best-predicted K below it.
    for kind, cands in list(kinds.items()):
        half = [c for c in cands if 2 * c.num_tiles <= plan.num_tiles]
        if kind[-1] == "fewer tiles" and half and best(half) is not best(cands):
            kinds[kind[:-1] + ("half the tiles",)] = half
    rivals = [as_plan(best(cands)) for _, cands in sorted(kinds.items())]
    if plan.is_serial:
        return [*rivals, plan] if rivals else [plan]
    return [plan, *rivals, as_plan(serial) if serial else TilePlan(1, reason=plan.reason)]


def plan_of(c, *, reason: str, candidates: tuple, carveout: tuple = (), num_streams: int = 2) -> TilePlan:
    """The plan that runs candidate ``c`` (a :class:`~overlap_layers.sim.Candidate`)."""
    return TilePlan(c.num_tiles, c.buckets_fwd, c.buckets_bwd, c.regather, num_streams, transport=c.transport,
                    decomposition=c.decomposition, carveout=carveout, predicted_ms=c.predicted_ms,
                    predicted_peak_bytes=c.peak_bytes, reason=reason, candidates=candidates)


def explain(plan: Optional[TilePlan]) -> str:
    """``plan`` as a text table of the candidates the planner compared (``layer.explain()``)."""
    p = plan
    if p is None:
        return "no plan yet: the layer plans at its first call"
    lines = [f"plan: K={p.num_tiles} regather={p.regather} buckets={p.buckets} transport={p.transport} "
             f"decomposition={p.decomposition}",
             f"reason: {p.reason or 'fixed by num_tiles or pin_plan'}"]
    if p.candidates:
        lines.append(f"{'K':>3} {'regather':>8} {'pred ms':>9} {'exposed ms':>10} {'peak MiB':>9}  buckets")
        for c in sorted(p.candidates, key=lambda c: (c.num_tiles, c.regather)):
            lines.append(f"{c.num_tiles:>3} {str(c.regather):>8} {c.predicted_ms:>9.3f} {c.exposed_comm_ms:>10.3f} "
                         f"{c.peak_bytes / 2**20:>9.1f}  {dict(c.buckets_fwd)} / {dict(c.buckets_bwd)}")
    return "\n".join(lines)
