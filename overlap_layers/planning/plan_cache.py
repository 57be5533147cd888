"""Per-layer plan cache with first-call verification (shared by every layer).

Reference: :meth:`PlanCache.get` returns, for a key (shape bucket, dtype, grad mode), the plan
``make(key)`` built at the first call for that key, kept in an LRU of ``size`` entries, except
while the key's first calls are verified (below), when it cycles through the contenders
``contenders_of(plan)``; afterwards it returns the one measured fastest.

[Note: first-call verification]
The planner's model can be wrong (on 4xH200 one shape was predicted 10% faster tiled and measured
10% slower). With ``verify=True``, a key whose plan P is not serial runs its next
``n + 2 * trials * n`` calls on n contenders (P, the layer's runner-up with another K if it has
one, and the serial plan S): first one untimed call of each (the warm-up cycle), then ``trials``
cycles through them, each contender twice in a row with the second call timed by a
:class:`Stopwatch` (forward, and backward when it runs before the decision), so the time is
that of a plan that also ran the call before, as in steady state (switching plans costs
allocator and stream warm-up that a settled layer does not pay). Every other cycle runs the
contenders in reverse order. Both are for the clocks: a GPU that was idle runs its first calls
at boost clocks and slows over the next ~100 ms of load, to the power cap (on 4xH200, 18% from
the first calls of the llama3-70b MLP to its steady state). Without the warm-up cycle the
contenders of the first cycle, P first, were timed faster than they run in steady state, and
unevenly: on 2xH200 the MLP 70b fwd+bwd kept K=4 on trials (52.20 ms against rank chunks'
52.36), and then ran 56.5 ms against rank chunks' 54.1 in steady state.
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

The minimum over trials ignores one stalled trial: the grid runs of sessions 33-35 on 4x H200 show
one trial of 200-800 ms in most verifications of rank chunks (a host stall on some rank, its cause
found in session 51, below; not Python's full collections, which no rank ran in those runs of
session 35, ``gc_full_ms`` in the bench; a stack sampler found Triton compiles, cuDNN graph builds
and slow first backward passes in the layers' first calls, bench/results/session35_*). Two disturbed
trials of three decided wrongly: in one run the block's attention timed rank chunks at 6.14, 4.98
and 298 ms, where the same shape's trials read 3.9-4.1 elsewhere, and kept K=1 (4.94 ms; the block
then ran at 1.18x of its limit instead of about 1.11). So where some contender has a trial slower
than its best by more than ``STALL`` (20%; with ``trials`` >= 2), the decision waits, once, for
``trials`` more cycles (the alternation goes on), and then takes the minimum over every trial. The
check uses the gathered times, so every rank extends alike. In the next run of that row the first
round read 425, 6.78 and 4.11 ms, the extra one 4.12, 4.08 and 4.06: rank chunks kept, the block at
1.12x (session 34). Until session 49 a round was disturbed only where a contender had fewer than two
trials within ``STALL`` of its best; then the same row timed rank chunks at 5.98, 5.65 and 353 ms
(two alike, so no extra round) and kept K=1 at 4.94, and the block ran 12.18 ms (11.55 in the next
run, with rank chunks; 4x H200). Rank chunks' eager trials there are often slow, not only by single
stalls: of 39 trials in eight verifications of that row (session 49), 21 read 5-9 ms (or a stall of
hundreds) against a best of 3.9-4.1, with or without [Note: aligned trials]; K=1's and K=2's read
within 10% of their best. Any disturbed trial now takes the second round, so a wrong pick needs six
slow trials in a row instead of three. What disturbed them was found in session 51 (the block 8b at
TP 4, 4x H200, every trial window probed with a stack sampler and a count of Triton compiles;
session 50 had seen only three Python collections in a stalled pass at TP 2, a symptom): the
attention's heads kernel compiled (400 ms) or loaded (up to 70 ms of host time, the pass up to 4x
slower on the device) a new variant inside a trial, because where the allocator put k and v chose
the variant ([Note: one heads launch] in ``kernels/heads.py``). Before the fix the attention's
rank-chunk trials read 3.96-8.46 ms and one 407 (both verifications took the second round); after
it, in six verifications, no window saw a compile and every contender's trials read within 3% of its
best, without a second round. The second round stays, for stalls of other causes.

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
                 margin: float = 0.0, prequeue_ms: float = 0.0, align: Optional[Callable[[], None]] = None) -> None:
        self._agreement = agreement
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
            digests = {row[0] for row in self._agreement.gather((plan.digest(),))}
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
        table = self._agreement.gather(row, dtype=torch.float64)
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
