"""Per-layer plan cache with first-call verification (shared by every layer).

Reference: :meth:`PlanCache.get` returns, for a key (shape bucket, dtype, grad mode), the plan
``make(key)`` built at the first call for that key, kept in an LRU of ``size`` entries, except
while the key's first calls are verified (below), when it cycles through the contenders
``contenders_of(plan)``; afterwards it returns the one measured fastest.

[Note: first-call verification]
The planner's model can be wrong (a shape predicted 10% faster tiled can measure 10% slower).
With ``verify=True``, a key whose plan P is not serial runs its next
``n + 2 * trials * n`` calls on n contenders (P, the layer's runner-up with another K if it has
one, and the serial plan S): first one untimed call of each (the warm-up cycle), then ``trials``
cycles through them, each contender twice in a row with the second call timed by a
:class:`Stopwatch` (forward, and backward when it runs before the decision), so the time is
that of a plan that also ran the call before, as in steady state (switching plans costs
allocator and stream warm-up that a settled layer does not pay). Every other cycle runs the
contenders in reverse order. Both are for the clocks: a GPU that was idle runs its first calls
at boost clocks and slows over the next ~100 ms of load, to the power cap. Without the warm-up
cycle the contenders of the first cycle, P first, are timed faster than they run in steady state,
and unevenly, which can keep the wrong plan (measured: see docs/measurements.md, Planner).
At the call after that every rank contributes each of its trials (forward+backward if every
rank timed a backward for every trial, else forward only) in one host gather; a trial's time is
the largest over the ranks (the call runs at its slowest rank's pace), and a contender's the
minimum over its trials. The fastest contender replaces P on every rank alike (ties to the
earlier one), except that the serial plan is kept unless the fastest beats it by more than
``margin``, as in planning. The kept plan carries the numbers in ``verification``
(:func:`verification_record`); its ``reason`` says the decision in words. The gather happens at
the same call on every rank because the cache is a function of the call history, which every
rank shares (each call already agreed on its key, [Note: agreement]); the decision uses only the
gathered numbers.

The minimum over trials ignores one stalled trial (a host stall on some rank, hundreds of
milliseconds), not several: with two of three trials disturbed, the wrong contender can win. So
where some contender has any trial slower than
its best by more than ``STALL`` (20%; with ``trials`` >= 2), the decision waits, once, for
``trials`` more cycles (the alternation goes on), and then takes the minimum over every trial: a
wrong pick then needs six slow trials in a row instead of three. The check uses the gathered
times, so every rank extends alike. Work that runs inside a trial window slows a trial this way:
a Triton kernel compiled or loaded long after the first call, where an argument's value chose a
new variant ([Note: one heads launch] in ``kernels/heads.py``; ``tests/test_kernel_variants.py``
checks that no package kernel compiles again after a layer's first calls). The second round
guards against stalls of other causes. Measured, with the stalls found and the decisions they
changed: see docs/measurements.md (Planner).

A call captured into a CUDA graph (``capturing``, agreed like the key) can neither plan nor time:
it runs the key's current plan (the planned plan while verification is pending), takes no trial
and does not advance the verification, which goes on at the next eager calls; a key with no plan
yet raises RuntimeError on every rank. With ``prequeue_ms``, each trial's stopwatches queue the
call ahead of the device first (:class:`Stopwatch`), then wait for every rank's device to get
there (``align``: [Note: aligned trials] in ``runtime/timing.py``), so contenders are compared as
CUDA-graph replays would run them; without it, as a steady eager loop runs them: the larger of a
trial's device time and its host time (:func:`~overlap_layers.runtime.timing.total_ms`).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import torch

from ..runtime.group import Agreement, PlanMismatchError
from ..runtime.timing import Stopwatch, total_ms


def _label(plan) -> str:
    return getattr(plan, "label", None) or f"K={getattr(plan, 'num_tiles', '?')}"


@dataclass
class Trial:
    """One timed call during verification; the layer stops ``fwd`` and fills ``bwd``."""

    plan: object
    index: int  # which contender (0: the planned plan)
    fwd: Stopwatch
    bwd: Optional[Stopwatch] = None


STALL = 0.2  # a trial slower than its contender's best by more than this fraction is disturbed


@dataclass
class _Entry:
    plan: object
    contenders: Optional[List[object]]  # None once settled
    trials: Optional[List[Trial]]  # None once settled
    step: int = 0  # verification calls so far
    rounds: int = 1  # rounds of ``trials`` cycles: 2 once disturbed trials extended it


def verification_record(contenders: Sequence[object], measured: Sequence[float], trials: Sequence[Trial],
                        with_bwd: bool, slowest: Sequence[Sequence[Tuple[int, float]]]) -> tuple:
    """Per contender, in order: ``(label, ms, ((device ms, host ms), ...), ((rank, ms), ...))``:
    the number the decision compared (the minimum over this pass's trials, each the slowest
    rank's); this rank's trials of that pass (forward, or forward+backward summed), each's device
    and host time, which :func:`~overlap_layers.runtime.timing.total_ms` takes the larger of (a
    trial whose host time is the larger ran host-bound); and per trial the slowest rank and its
    time (``slowest``, from the gather), which tell a stall on another rank from one here."""
    def times(t: Trial) -> Tuple[float, float]:
        watches = (t.fwd, t.bwd) if with_bwd else (t.fwd,)
        return sum(w.elapsed_ms() for w in watches), sum(w.host_ms() for w in watches)
    return tuple((_label(p), ms, tuple(times(t) for t in trials if t.index == i), tuple(slowest[i]))
                 for i, (p, ms) in enumerate(zip(contenders, measured)))


class PlanCache:
    """The plans of one layer, per key; see the module docstring and [Note: first-call verification]."""

    def __init__(self, agreement: Agreement, *, size: int = 32, verify: bool = True, trials: int = 3,
                 margin: float = 0.0, prequeue_ms: float = 0.0, align: Optional[Callable[[], None]] = None,
                 who: Optional[Callable[[], str]] = None) -> None:
        self._agreement, self._who = agreement, who  # who: the gathers' description in their errors
        self._size, self._verify, self._trials, self._margin = size, verify, trials, margin
        self.prequeue_ms, self.align = prequeue_ms, align  # the trials' stopwatches': [Note: aligned trials]
        self._entries: "OrderedDict[Hashable, _Entry]" = OrderedDict()
        self.last_key: Optional[Hashable] = None

    def __len__(self) -> int:
        return len(self._entries)

    def verifying(self, key: Optional[Hashable] = None) -> bool:
        """Whether the calls for ``key`` (default: the last key used) are still being verified."""
        entry = self._entries.get(self.last_key if key is None else key)
        return entry is not None and entry.trials is not None

    def settled(self, key: Hashable) -> Optional[object]:
        """The plan of ``key`` once its verification is over; None while it runs or before the
        key's first call. Changes nothing (no planning, no recency)."""
        entry = self._entries.get(key)
        return entry.plan if entry is not None and entry.trials is None else None

    def settled_items(self) -> List[Tuple[Hashable, object]]:
        """``(key, plan)`` of every settled key, least recently used first."""
        return [(key, e.plan) for key, e in self._entries.items() if e.trials is None]

    def preload(self, key: Hashable, plan: object) -> None:
        """Hold ``plan`` as ``key``'s settled plan, as if planned and verified (a plan file's:
        ``load_plans``); the caller has agreed it across the ranks."""
        self._entries[key] = _Entry(plan, None, None)
        self._entries.move_to_end(key)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def get(self, key: Hashable, make: Callable[[Hashable], object],
            contenders_of: Callable[[object], Sequence[object]], device: torch.device, *,
            call: bool = True, capturing: bool = False) -> Tuple[object, Optional[Trial]]:
        """The plan for ``key`` and, during verification, the :class:`Trial` this call must time.

        ``contenders_of(plan)`` lists the plans to time, the serial plan last (just ``[plan]``
        when there is nothing to verify). ``call=False`` plans
        without running (warm-up): no trial is handed out. ``capturing``: the call is being
        captured into a CUDA graph (see the module docstring)."""
        entry = self._entries.get(key)
        if entry is None and capturing:
            raise RuntimeError(f"a layer call is being captured into a CUDA graph before its plan for {key} exists: "
                               "planning times work on the device, which capture forbids; run one eager call of "
                               "this shape (or layer.warmup([(batch, seq_local)])) before capturing")
        if entry is None:
            plan = make(key)
            digests = {row[0] for row in self._agreement.gather((plan.digest(),), who=self._who)}
            if len(digests) > 1:
                raise PlanMismatchError(f"ranks of the group chose different plans for {key}: digests "
                                        f"{sorted(digests)}; this rank: {plan}")
            contenders = list(contenders_of(plan)) if self._verify else [plan]
            entry = self._entries[key] = _Entry(plan, contenders, [] if len(contenders) > 1 else None)
            if len(self._entries) > self._size:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        self.last_key = key
        if not call or entry.trials is None or capturing:
            return entry.plan, None
        n = len(entry.contenders)
        timed = None
        if entry.step == n * (1 + 2 * self._trials * entry.rounds):  # every trial of this round taken
            timed = self._timed(entry)
            if entry.rounds == 1 and self._disturbed(timed[1]):
                entry.rounds, timed = 2, None  # [Note: first-call verification]: once, more trials
        if timed is None:
            step, entry.step = entry.step, entry.step + 1
            if step < n:  # the warm-up cycle
                return entry.contenders[step], None
            cycle, pos = divmod(step - n, 2 * n)  # each contender twice in a row; the second call is timed
            i = pos // 2 if cycle % 2 == 0 else n - 1 - pos // 2
            if pos % 2 == 0:
                return entry.contenders[i], None
            trial = Trial(entry.contenders[i], i, Stopwatch(device, self.prequeue_ms, self.align))
            entry.trials.append(trial)
            return trial.plan, trial
        entry.plan = self._decide(entry, *timed)
        entry.trials = entry.contenders = None
        return entry.plan, None

    def _timed(self, entry: _Entry) -> Tuple[bool, List[List[float]], List[List[Tuple[int, float]]]]:
        """``(with_bwd, per contender the time of each of its trials, the largest over the
        ranks, and per trial (the rank with that time, the time))`` from one gather; every rank has
        the same trials in the same order (the call history), so the rows line up."""
        trials, n = entry.trials, len(entry.contenders)
        mine = [[t for t in trials if t.index == i] for i in range(n)]
        has_bwd = all(t.bwd is not None and t.bwd.done for t in trials)
        row = [float(has_bwd)] + [total_ms(t.fwd) for ts in mine for t in ts] + \
              [total_ms(t.fwd, t.bwd) if has_bwd else math.inf for ts in mine for t in ts]
        table = self._agreement.gather(row, dtype=torch.float64, who=self._who)
        with_bwd = min(r[0] for r in table) == 1.0
        off, per = (1 + len(trials)) if with_bwd else 1, [len(ts) for ts in mine]
        out, slowest, at = [], [], off
        for count in per:
            worst = [max(enumerate(r[at + j] for r in table), key=lambda rank_ms: rank_ms[1]) for j in range(count)]
            out.append([ms for _, ms in worst])
            slowest.append(worst)
            at += count
        return with_bwd, out, slowest

    def _disturbed(self, times: List[List[float]]) -> bool:
        """Whether some contender has a trial slower than its best by more than :data:`STALL`
        (``times`` from :meth:`_timed`, so every rank answers alike; never with one trial each)."""
        return self._trials >= 2 and any(t > min(ts) * (1.0 + STALL) for ts in times for t in ts)

    def _decide(self, entry: _Entry, with_bwd: bool, times: List[List[float]], slowest):
        trials, contenders = entry.trials, entry.contenders
        n = len(contenders)
        measured = [min(ts) for ts in times]
        win = min(range(n), key=lambda i: (measured[i], i))
        if win != n - 1 and measured[win] > measured[-1] * (1.0 - self._margin):
            win = n - 1  # as in planning: a tiled plan must win by more than the margin
        what = "forward+backward" if with_bwd else "forward"
        listed = ", ".join(f"{_label(p)} {ms:.3f} ms" for p, ms in zip(contenders, measured))
        more = " (twice as many: a trial was disturbed)" if entry.rounds > 1 else ""
        verdict = (f"verified on the first calls ({what}, min of {self._trials * entry.rounds} calls each{more}, "
                   f"max over ranks): {listed}: {'kept' if contenders[win] is entry.plan else 'switched to'} "
                   f"{_label(contenders[win])}")
        return replace(contenders[win], reason=f"{entry.plan.reason}; {verdict}",
                       verification=verification_record(contenders, measured, trials, with_bwd, slowest))
