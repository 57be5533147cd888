"""First-call verification ([Note: first-call verification]) and warm-up planning."""
import math
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from overlap_layers import OverlapConfig, OverlapMLP
from overlap_layers.layers.mlp.layer import MLPPlan
from overlap_layers.planning.plan_cache import PlanCache
from test_mlp import expect_value_error_on_every_rank


class _OneRank:
    """An Agreement of a group of one (the gather returns this rank's row)."""

    def gather(self, values, dtype=torch.int64, who=None):
        return [tuple(values)]


class _Fixed:
    """A finished stopwatch reading a given device time (its host time is less)."""

    prequeue_ms = 0.0

    def __init__(self, ms):
        self.ms, self.done = ms, True

    def elapsed_ms(self):
        return self.ms

    def host_ms(self):
        return 0.0


def _serial(plan):
    """Contenders: the plan and K=1 (just the plan when it is serial)."""
    return [plan] if plan.num_tiles == 1 else [plan, MLPPlan(1, reason=plan.reason)]


@pytest.mark.parametrize("tiled_ms,serial_ms,bwd,want_k", [
    (1.0, 2.0, None, 2), (2.0, 1.0, None, 1),
    # the backward decides when every trial timed one: forward says tiled, forward+backward says serial
    (1.0, 2.0, (5.0, 1.0), 1), (2.0, 1.0, (0.5, 5.0), 2)])
def test_cache_alternates_then_keeps_the_faster(tiled_ms, serial_ms, bwd, want_k):
    cache = PlanCache(_OneRank(), trials=2)
    made = []
    make = lambda key: made.append(key) or MLPPlan(2, reason="planned")  # noqa: E731
    ks, timed = [], []
    for _ in range(10):
        plan, trial = cache.get("k", make, _serial, torch.device("cpu"))
        ks.append(plan.num_tiles)
        assert cache.verifying()
        timed.append(trial is not None)
        if trial is None:  # the warm-up cycle, and the first of two calls in a row
            continue
        assert trial.plan is plan
        trial.fwd = _Fixed(tiled_ms if trial.index == 0 else serial_ms)
        if bwd is not None:
            trial.bwd = _Fixed(bwd[0] if trial.index == 0 else bwd[1])
    # one warm-up call each, then two cycles (the second in reverse order), each contender twice in a row
    assert ks == [2, 1] + [2, 2, 1, 1] + [1, 1, 2, 2] and timed == [False] * 2 + [False, True] * 4
    assert len(made) == 1
    plan, trial = cache.get("k", make, _serial, torch.device("cpu"))
    assert trial is None and not cache.verifying() and plan.num_tiles == want_k
    assert ("kept K=2" if want_k == 2 else "switched to K=1") in plan.reason
    assert ("forward+backward" if bwd else "(forward,") in plan.reason
    # the numbers behind it: per contender the compared time and each trial's (device, host) ms
    tiled, serial = (tiled_ms + bwd[0], serial_ms + bwd[1]) if bwd else (tiled_ms, serial_ms)
    assert plan.verification == (("K=2", tiled, ((tiled, 0.0),) * 2, ((0, tiled),) * 2),
                                 ("K=1", serial, ((serial, 0.0),) * 2, ((0, serial),) * 2))
    again, trial = cache.get("k", make, _serial, torch.device("cpu"))
    assert again is plan and trial is None and len(made) == 1


class _HostBound(_Fixed):
    """A finished stopwatch whose host time exceeds its device time."""

    def __init__(self, ms, host):
        super().__init__(ms)
        self.host = host

    def host_ms(self):
        return self.host


def test_verification_compares_host_time_where_it_exceeds_the_device_time():
    """An eager call costs the larger of its device and host time: the tiled plan runs 1.0 ms on
    the device but 1.6-1.8 ms on the host against K=1's 1.2 / 1.1, so K=1 is kept, and the record
    shows each trial's two times (the decision's number is the minimum over trials of the larger)."""
    cache = PlanCache(_OneRank(), trials=2)
    host = {2: iter([1.8, 1.6]), 1: iter([1.1, 1.1])}
    for _ in range(10):
        plan, trial = cache.get("k", lambda key: MLPPlan(2, reason="planned"), _serial, torch.device("cpu"))
        if trial is not None:
            trial.fwd = _HostBound(1.0 if plan.num_tiles == 2 else 1.2, next(host[plan.num_tiles]))
    plan, _ = cache.get("k", None, _serial, torch.device("cpu"))
    assert plan.num_tiles == 1 and "K=2 1.600 ms, K=1 1.200 ms" in plan.reason
    assert plan.verification == (("K=2", 1.6, ((1.0, 1.8), (1.0, 1.6)), ((0, 1.8), (0, 1.6))),
                                 ("K=1", 1.2, ((1.2, 1.1), (1.2, 1.1)), ((0, 1.2), (0, 1.2))))


def test_boost_clocks_of_the_first_calls_do_not_pick_the_plan():
    """A GPU that was idle runs its first calls fast (boost clocks), then slows to its steady
    speed. Here the first two calls run at 0.85x; the tiled plan is 5% slower than K=1 in steady
    state. The warm-up cycle takes those calls, so the trials see steady speeds and K=1 stays
    (timing the tiled plan's first call would have read 0.89 against K=1's 1.0)."""
    cache = PlanCache(_OneRank(), trials=2)
    steady = {2: 1.05, 1: 1.0}
    for call in range(10):
        plan, trial = cache.get("k", lambda key: MLPPlan(2, reason="planned"), _serial, torch.device("cpu"))
        if trial is not None:
            trial.fwd = _Fixed(steady[plan.num_tiles] * (0.85 if call < 2 else 1.0))
    plan, trial = cache.get("k", None, _serial, torch.device("cpu"))
    assert trial is None and plan.num_tiles == 1 and "K=2 1.050 ms, K=1 1.000 ms" in plan.reason


@settings(deadline=None, max_examples=40)
@given(n=st.integers(2, 4), trials=st.integers(1, 3))
def test_verification_calls_warm_up_each_then_time_each_trials_times(n, trials):
    """For n contenders: one untimed call each, then ``trials`` cycles in alternating order, each
    contender twice in a row with the second timed; the decision comes at the next call."""
    cache = PlanCache(_OneRank(), trials=trials)
    rivals = lambda plan: [plan] + [MLPPlan(k, reason="r") for k in range(3, n + 1)] + [MLPPlan(1, reason="r")]  # noqa: E731
    seen = []
    for _ in range(n * (1 + 2 * trials)):
        plan, trial = cache.get("k", lambda key: MLPPlan(2, reason="planned"), rivals, torch.device("cpu"))
        seen.append((plan.num_tiles, trial is not None))
        if trial is not None:
            trial.fwd = _Fixed(1.0)
        assert cache.verifying()
    order = [2] + list(range(3, n + 1)) + [1]
    assert seen[:n] == [(k, False) for k in order]
    for c in range(trials):
        cycle = seen[n + 2 * n * c:n + 2 * n * (c + 1)]
        assert cycle == [(k, t) for k in (order if c % 2 == 0 else order[::-1]) for t in (False, True)]
    plan, trial = cache.get("k", None, rivals, torch.device("cpu"))
    assert trial is None and not cache.verifying()


def test_cache_times_every_contender_and_keeps_the_fastest():
    cache = PlanCache(_OneRank(), trials=2)
    three = lambda plan: [plan, MLPPlan(4, reason=plan.reason), MLPPlan(1, reason=plan.reason)]  # noqa: E731
    ms = {2: [2.0, 2.2], 4: [1.7, 1.5], 1: [3.0, 3.0]}
    ks = []
    for _ in range(15):
        plan, trial = cache.get("k", lambda key: MLPPlan(2, reason="planned"), three, torch.device("cpu"))
        ks.append(plan.num_tiles)
        if trial is not None:
            trial.fwd = _Fixed(ms[plan.num_tiles].pop(0))
    assert ks == [2, 4, 1] + [2, 2, 4, 4, 1, 1] + [1, 1, 4, 4, 2, 2]
    plan, _ = cache.get("k", None, three, torch.device("cpu"))
    assert plan.num_tiles == 4 and "switched to K=4" in plan.reason and "K=4 1.500 ms" in plan.reason


def _verify(cache, ms, calls):
    """``calls`` calls of key "k" (K=2 planned, K=1 serial), each trial reading the next of
    ``ms[K]``; the K of each call and the plan after them."""
    ks = []
    for _ in range(calls):
        plan, trial = cache.get("k", lambda key: MLPPlan(2, reason="planned"), _serial, torch.device("cpu"))
        ks.append(plan.num_tiles)
        if trial is not None:
            trial.fwd = _Fixed(ms[plan.num_tiles].pop(0))
    return ks, cache.get("k", None, _serial, torch.device("cpu"))[0]


ROUND = [2, 2, 1, 1] + [1, 1, 2, 2] + [2, 2, 1, 1]  # three trial cycles of K=2 and K=1


def test_a_disturbed_trial_takes_one_more_round_of_trials():
    """[Note: first-call verification]: K=2 runs 1.0 ms, but all three of its first trials
    were disturbed (1.8, 1.3, a 300 ms stall): one trial within 20% of its best, and on those
    alone K=1 (1.2) would be kept. The decision waits for three more cycles, which continue the
    alternation, and then takes the minimum over all six trials of each: K=2."""
    cache = PlanCache(_OneRank(), trials=3, margin=0.03)
    ms = {2: [1.8, 1.3, 300.0] + [1.0, 1.01, 1.02], 1: [1.2] * 6}
    ks, plan = _verify(cache, ms, 2 + 12 + 12)
    assert ks == [2, 1] + ROUND + [1, 1, 2, 2] + [2, 2, 1, 1] + [1, 1, 2, 2]
    assert ms == {2: [], 1: []} and not cache.verifying()
    assert plan.num_tiles == 2 and "min of 6 calls each (twice as many: a trial was disturbed)" in plan.reason
    assert [len(trials) for _, _, trials, _ in plan.verification] == [6, 6]


def test_disturbed_trials_extend_verification_once():
    """Still disturbed after the extra round: decided then, on the best trials."""
    cache = PlanCache(_OneRank(), trials=2)
    ms = {2: [1.0, 50.0, 60.0, 70.0], 1: [2.0, 2.0, 2.0, 2.0]}
    ks, plan = _verify(cache, ms, 2 + 8 + 8)
    assert ms == {2: [], 1: []} and not cache.verifying() and plan.num_tiles == 2
    assert "K=2 1.000 ms, K=1 2.000 ms" in plan.reason


class _PeerStalled:
    """An Agreement of two ranks whose peer's row is this rank's with the values at ``at``
    (counted after the grad flag) times ``factor``: stalls on the other rank."""

    def __init__(self, at, factor):
        self.at, self.factor = at, factor

    def gather(self, values, dtype=torch.int64, who=None):
        peer = list(values)
        if dtype == torch.float64:  # the trials' times (the plans' digests agree as they are)
            for i in self.at:
                peer[1 + i] *= self.factor
        return [tuple(values), tuple(peer)]


def test_a_stall_on_another_rank_extends_verification_on_this_one():
    """Disturbed is decided on the gathered times, each trial the slowest rank's: this rank's
    trials are steady, the peer's first K=2 trial (or first two) stalled, so this rank extends
    too; with every rank steady it does not."""
    for at in ((0,), (0, 1)):
        ms = {2: [1.0, 1.0, 1.0] * 2, 1: [2.0] * 6}
        ks, plan = _verify(PlanCache(_PeerStalled(at=at, factor=50.0), trials=3), ms, 2 + 24)
        assert ms == {2: [], 1: []} and "twice as many" in plan.reason and plan.num_tiles == 2
        # the record names the slowest rank of each trial: the peer (rank 1) for the stalled ones
        (_, _, _, k2), (_, _, _, k1) = plan.verification
        assert k2 == ((1, 50.0),) * len(at) + ((0, 1.0),) * (6 - len(at)) and k1 == ((0, 2.0),) * 6
    ms = {2: [1.0, 1.0, 1.0], 1: [2.0] * 3}
    ks, plan = _verify(PlanCache(_OneRank(), trials=3), ms, 2 + 12)
    assert ms == {2: [], 1: []} and "twice as many" not in plan.reason and plan.num_tiles == 2


def test_two_slow_trials_alike_and_a_stall_take_the_second_round():
    """A wrong pick measured on 4x H200 (docs/measurements.md, Planner), replayed: rank chunks
    (here K=2) timed 5.98, 5.65 and a 353 ms stall against a best of about 4 ms elsewhere, K=1
    steady at 4.94. Two slow trials within 20% of each other would look steady and keep K=1; any
    disturbed trial takes the second round, whose trials find K=2 at 4.04."""
    ms = {2: [5.98, 5.65, 353.0] + [4.12, 4.04, 6.24], 1: [4.94, 5.04, 4.98] * 2}
    ks, plan = _verify(PlanCache(_OneRank(), trials=3), ms, 2 + 24)
    assert ks == [2, 1] + ROUND + VERIFY_EXTRA  # the second round goes on alternating
    assert ms == {2: [], 1: []} and plan.num_tiles == 2 and "twice as many" in plan.reason


def test_steady_trials_decide_after_one_round():
    """Trials within 20% of their best: no extra round (one trial each cannot tell)."""
    for trials, ms in ((3, {2: [1.0, 1.19, 1.1], 1: [2.0, 2.3, 2.1]}), (1, {2: [5.0], 1: [2.0]})):
        cache = PlanCache(_OneRank(), trials=trials)
        ks, plan = _verify(cache, ms, 2 + 4 * trials)
        assert not cache.verifying() and ms == {2: [], 1: []} and len(ks) == 2 + 4 * trials


def test_contenders_add_a_runner_up_within_the_budget():
    from overlap_layers.planning.plan import contenders as _contenders
    from overlap_layers.sim import Candidate
    cands = (Candidate(1, False, (), (), 10.0, 1.0, 500), Candidate(2, False, (), (), 8.0, 0.5, 400),
             Candidate(4, False, (), (), 8.5, 0.4, 300), Candidate(8, False, (), (), 8.2, 0.3, 900))
    plan = MLPPlan(2, predicted_ms=8.0, predicted_peak_bytes=400, reason="r", candidates=cands)
    got = _contenders(plan, budget=500)
    # K=8 is predicted faster than K=4 but needs more memory than the budget: K=4 is the runner-up.
    assert [p.num_tiles for p in got] == [2, 4, 1] and got[1].predicted_ms == 8.5
    assert all(p.reason == "r" for p in got)
    assert _contenders(MLPPlan(1)) == [MLPPlan(1)]


def test_contenders_add_the_best_rank_plan_and_verify_a_close_serial_plan():
    from overlap_layers.planning.plan import contenders as _contenders
    from overlap_layers.sim import Candidate
    serial = Candidate(1, False, (), (), 10.0, 1.0, 500)
    ce = Candidate(1, False, (), (), 9.8, 0.1, 600, decomposition="rank", transport="copy_engine")
    ce_regather = Candidate(1, True, (), (), 9.9, 0.1, 550, decomposition="rank", transport="copy_engine")
    p2p = Candidate(1, False, (), (), 12.0, 2.0, 600, decomposition="rank", transport="nccl")
    k2 = Candidate(2, False, (), (), 9.0, 0.5, 700)
    cands = (serial, ce, ce_regather, p2p, k2)
    plan = MLPPlan(2, predicted_ms=9.0, predicted_peak_bytes=700, reason="r", candidates=cands)
    got = _contenders(plan)
    # one rival per other kind (the best-predicted one), serial last
    assert [(p.decomposition, p.transport, p.regather) for p in got] == [
        ("batch", "nccl", False), ("rank", "copy_engine", False), ("rank", "nccl", False), ("batch", "nccl", False)]
    assert got[-1].is_serial and got[1].label == "rank chunks over copy_engine"
    # a serial plan with a rival predicted within VERIFY_CLOSE: timed against it; out of budget or far: alone
    p2p_far = Candidate(1, False, (), (), 13.0, 2.0, 600, decomposition="rank", transport="nccl")
    kept = MLPPlan(1, predicted_ms=10.0, predicted_peak_bytes=500, reason="r", candidates=(serial, ce, p2p_far))
    assert [p.label for p in _contenders(kept)] == ["rank chunks over copy_engine", "K=1"]
    assert _contenders(kept, budget=550) == [kept]
    near = MLPPlan(1, predicted_ms=10.0, reason="r", candidates=(serial, p2p))  # 20% slower: still timed
    assert [p.label for p in _contenders(near)] == ["rank chunks over nccl", "K=1"]
    far = MLPPlan(1, predicted_ms=10.0, reason="r", candidates=(serial, p2p_far))
    assert _contenders(far) == [far]
    # close rivals of two kinds: both timed (the best of each kind), K=1 last
    k2_close, k4_close = Candidate(2, False, (), (), 10.3, 0.5, 450), Candidate(4, False, (), (), 10.4, 0.4, 400)
    both = MLPPlan(1, predicted_ms=10.0, reason="r", candidates=(serial, ce, p2p_far, k2_close, k4_close))
    assert [p.label for p in _contenders(both)] == ["K=2", "rank chunks over copy_engine", "K=1"]


@pytest.mark.parametrize("tiled_ms,want_k", [(0.98, 1), (0.96, 2)])
def test_verification_keeps_serial_unless_clearly_faster(tiled_ms, want_k):
    cache = PlanCache(_OneRank(), trials=1, margin=0.03)
    for _ in range(6):
        plan, trial = cache.get("k", lambda key: MLPPlan(2), _serial, torch.device("cpu"))
        if trial is not None:
            trial.fwd = _Fixed(tiled_ms if trial.index == 0 else 1.0)
    plan, _ = cache.get("k", None, _serial, torch.device("cpu"))
    assert plan.num_tiles == want_k


def test_cache_does_not_verify_serial_or_when_off():
    cache = PlanCache(_OneRank())
    plan, trial = cache.get("a", lambda key: MLPPlan(1), _serial, torch.device("cpu"))
    assert trial is None and not cache.verifying()
    cache = PlanCache(_OneRank(), verify=False)
    plan, trial = cache.get("a", lambda key: MLPPlan(4), _serial, torch.device("cpu"))
    assert trial is None and plan.num_tiles == 4


def test_cache_is_lru_bounded():
    cache = PlanCache(_OneRank(), size=2, verify=False)
    made = []
    for key in ["a", "b", "a", "c", "a", "b"]:
        cache.get(key, lambda k: made.append(k) or MLPPlan(1), _serial, torch.device("cpu"))
    assert made == ["a", "b", "c", "b"] and len(cache) == 2


def slowed_layer(rank, ws, slow, training):
    """The planner is forced to K=2; each rank sleeps ``slow[rank][k]`` ms inside every K=k call,
    so local timings disagree across ranks."""
    layer = OverlapMLP(16, 32, group=dist.group.WORLD)
    layer.planner.make_plan = lambda rows, dtype, save: MLPPlan(2, reason="forced")
    run = layer._run

    def slowed(x, plan, *rest):
        time.sleep(slow[rank].get(plan.num_tiles, 0) / 1e3)
        return run(x, plan, *rest)
    layer._run = slowed
    ks, after = [], 0
    while after < 2 and len(ks) < 40:  # until decided (a jittery host may extend it), then two calls
        x = torch.randn(2, 8, 16, requires_grad=training)
        y = layer(x)
        if training:
            y.sum().backward()
        ks.append(layer.plan.num_tiles)
        after += not layer.verifying
    return ks, layer.plan.digest(), layer.plan.reason, layer.verifying


VERIFY_KS = [2, 1] + [2, 2, 1, 1] + [1, 1, 2, 2] + [2, 2, 1, 1]  # K=2 against K=1, three trials
VERIFY_EXTRA = [1, 1, 2, 2] + [2, 2, 1, 1] + [1, 1, 2, 2]  # three more, where a trial was disturbed


def verified(ks, then):
    """Whether ``ks`` is a verification of K=2 against K=1, extended or not, then ``then``."""
    return ks in (VERIFY_KS + then, VERIFY_KS + VERIFY_EXTRA + then)


@pytest.mark.parametrize("training", [False, True])
def test_verification_agrees_across_ranks_with_different_timings(pool2, training):
    # Rank 0 alone would keep K=2 (its K=1 calls are slow); rank 1's K=2 calls are slower still,
    # and the layer is as slow as its slowest rank: both ranks must switch to K=1.
    res = pool2.run(slowed_layer, {0: {1: 30}, 1: {2: 90}}, training)
    for ks, _, reason, verifying in res:
        assert verified(ks, [1, 1]) and not verifying
        assert "switched to K=1" in reason and ("forward+backward" if training else "(forward,") in reason
    assert res[0][1] == res[1][1]
    res = pool2.run(slowed_layer, {0: {1: 60}, 1: {1: 40}}, training)
    assert res[0][0] == res[1][0] and verified(res[0][0], [2, 2])
    assert all("kept K=2" in r[2] for r in res)


def warmed(rank, ws, shapes):
    layer = OverlapMLP(16, 32, group=dist.group.WORLD, config=OverlapConfig(verify_first_calls=False))
    made = []
    orig = layer.planner.make_plan
    layer.planner.make_plan = lambda *a: made.append(a[0]) or orig(*a)
    plans = layer.warmup(shapes)
    planned = list(made)
    for b, s in shapes:
        layer(torch.randn(b, s, 16, requires_grad=True)).sum().backward()
    return planned, made, [p.digest() for p in plans]


def test_warmup_plans_ahead_once_per_bucket(pool2):
    res = pool2.run(warmed, [(2, 8), (1, 16), (3, 8)])  # rows 16, 16, 24 -> buckets 16 and 32
    for planned, made, digests in res:
        assert planned == [16, 32] and made == planned and len(digests) == 3
    assert res[0][2] == res[1][2]


def warm_mismatch(rank, ws):
    OverlapMLP(16, 32, group=dist.group.WORLD).warmup([(2, 8 * (rank + 1))])


def test_warmup_with_different_shapes_raises_on_every_rank(pool2):
    expect_value_error_on_every_rank(pool2, warm_mismatch, match="same shapes")


def warm_bad(rank, ws):
    OverlapMLP(16, 32, group=dist.group.WORLD).warmup([(2,)])


def test_warmup_rejects_bad_shapes(pool2):
    expect_value_error_on_every_rank(pool2, warm_bad, match="shapes=")


def warm_bad_on_one_rank(rank, ws, bad):
    OverlapMLP(16, 32, group=dist.group.WORLD).warmup(**(bad if rank == 1 else dict(shapes=[(2, 8)])))


@pytest.mark.parametrize("bad", [dict(shapes=[(2,)]), dict(shapes=[(0, 8)]), dict(shapes=[(2, 8)], dtype=torch.int8)])
def test_warmup_rejects_bad_arguments_on_one_rank_on_every_rank(pool2, bad):
    """Bad arguments on rank 1 alone: its ValueError, and the others' (the ranks disagree), not a
    rank left waiting in the agreement."""
    expect_value_error_on_every_rank(pool2, warm_bad_on_one_rank, bad, match=("shapes=", "dtype=", "same shapes"))


def test_capture_neither_plans_nor_advances_verification():
    """[Note: CUDA graphs]: a captured call with no plan for its key raises; during verification
    it runs the planned plan, takes no trial and leaves the sequence of trials as it was."""
    cache = PlanCache(_OneRank(), trials=1)
    make = lambda key: MLPPlan(2, reason="planned")  # noqa: E731
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="before its plan"):
        cache.get("k", make, _serial, cpu, capturing=True)
    assert len(cache) == 0
    seen = []
    for capturing in (False, True, True, False, False, True, False, False, False):
        plan, trial = cache.get("k", make, _serial, cpu, capturing=capturing)
        seen.append((plan.num_tiles, trial is not None))
        if trial is not None:
            trial.fwd = _Fixed(1.0 if trial.index == 0 else 3.0)
    # eager calls alone: K=2 and K=1 once (warm-up), then K=2 untimed, K=2 timed, K=1 untimed, K=1 timed,
    # then decided (K=2); captured calls run K=2
    assert seen == [(2, False), (2, False), (2, False), (1, False), (2, False), (2, False), (2, True),
                    (1, False), (1, True)]
    plan, trial = cache.get("k", make, _serial, cpu)
    assert trial is None and not cache.verifying() and plan.num_tiles == 2


def test_prequeued_trials_carry_the_prequeue_to_their_stopwatch():
    align = object()  # [Note: aligned trials]: what runs after the sleep (a barrier of the ranks' devices)
    cache = PlanCache(_OneRank(), trials=1, prequeue_ms=20.0, align=align)
    make = lambda key: MLPPlan(2, reason="planned")  # noqa: E731
    for _ in range(3):  # the warm-up cycle and the first of two calls in a row are not timed
        assert cache.get("k", make, _serial, torch.device("cpu"))[1] is None
    _, trial = cache.get("k", make, _serial, torch.device("cpu"))
    assert trial is not None and trial.fwd.prequeue_ms == 20.0 and trial.fwd.align is align
    bwd = trial.fwd.sibling()  # the backward's stopwatch
    assert bwd is not trial.fwd and (bwd.prequeue_ms, bwd.align, bwd.done) == (20.0, align, False)
    assert PlanCache(_OneRank()).prequeue_ms == 0.0 and PlanCache(_OneRank()).align is None


def _layers_align(rank, ws):
    """Whether a layer's trials align their ranks' devices, eager and replayed (graph calls), on
    this gloo group; and the barrier of a group of one."""
    from overlap_layers.runtime.timing import rank_barrier
    eager = OverlapMLP(16, 8 * ws, group=dist.group.WORLD)
    replayed = OverlapMLP(16, 8 * ws, group=dist.group.WORLD, config=OverlapConfig(graph_calls=True))
    alone = dist.new_group([rank], use_local_synchronization=True)
    return eager.planner.plans.align, replayed.planner.plans.align, replayed.planner.plans.prequeue_ms > 0, rank_barrier(alone)


def test_trials_align_only_nccl_groups(pool2):
    """rank_barrier: none on gloo (CPU collectives block the host, which times them) or for one rank."""
    assert pool2.run(_layers_align) == [(None, None, True, None)] * 2


def _capture_on(rank, ws, capturing_ranks, plan_first, new_batch=False):
    """An auto OverlapMLP call under a faked CUDA-graph capture on ``capturing_ranks`` (on a
    batch of another size than the first call's with ``new_batch``)."""
    from overlap_layers.planning import call_agreement
    torch.manual_seed(0)
    layer = OverlapMLP(16, 8 * ws, group=dist.group.WORLD)
    x = torch.randn(2, 4, 16)
    eager = layer(x) if plan_first else None
    real = call_agreement.capturing_graph
    call_agreement.capturing_graph = lambda t: rank in capturing_ranks
    try:
        y = layer(torch.cat([x, x]) if new_batch else x)
        return tuple(y.shape), bool(torch.equal(y, eager))
    finally:
        call_agreement.capturing_graph = real


def test_capture_on_some_ranks_raises_on_every_rank(pool2):
    """A call every rank agrees anew (a new batch size) names the divergence on every rank."""
    expect_value_error_on_every_rank(pool2, _capture_on, (0,), True, True, match="capturing a CUDA graph differs")


def test_capture_before_planning_raises_on_every_rank(pool2):
    from pool import RankFailure
    with pytest.raises(RankFailure) as info:
        pool2.run(_capture_on, (0, 1), False, timeout=60)
    errors = info.value.errors()
    assert all(e is not None and e[0] == "RuntimeError" and "before its plan" in e[1] for e in errors), errors


def test_capture_after_planning_runs_the_plan(pool2):
    assert pool2.run(_capture_on, (0, 1), True) == [((2, 4, 16), True)] * 2



@pytest.mark.parametrize("prequeue_ms,device,host,want", [
    (0.0, [1.0, 2.0], [0.5, 0.5], 3.0),   # device-bound eager passes: their device time
    (0.0, [1.0, 2.0], [2.5, 1.5], 4.0),   # host-bound: the host's wall time sets a loop's pace
    (10.0, [1.0, 2.0], [2.5, 1.5], 3.0),  # prequeued (timed as replays): device time only
])
def test_total_ms_of_trial_passes(prequeue_ms, device, host, want):
    """runtime/timing.total_ms: what passes cost a steady loop, from fake finished stopwatches."""
    from overlap_layers.runtime.timing import Stopwatch, total_ms

    def watch(dev_ms, host_ms):
        w = Stopwatch(torch.device("cpu"), prequeue_ms)
        w._start, w._stop, w._host_start, w._host_stop = 0.0, dev_ms / 1e3, 0.0, host_ms / 1e3
        return w
    assert total_ms(*[watch(d, h) for d, h in zip(device, host)]) == pytest.approx(want)
    assert total_ms(watch(1.0, 1.0), None) == math.inf


def test_contenders_time_fewer_and_more_tiles_around_a_tiled_plan():
    """A batch-tiled plan is timed against the best-predicted K below it and the best above it
    (with P2P disabled the model can put K=8 next to K=4 while K=2 runs faster), then K=1."""
    from overlap_layers.planning.plan import contenders as _contenders
    from overlap_layers.sim import Candidate
    cands = tuple(Candidate(k, False, (), (), ms, 0.0, 100) for k, ms in
                  ((1, 12.0), (2, 9.0), (3, 9.5), (4, 8.0), (6, 8.9), (8, 8.8)))
    plan = MLPPlan(4, predicted_ms=8.0, reason="r", candidates=cands)
    assert [p.num_tiles for p in _contenders(plan)] == [4, 2, 8, 1]
    two = MLPPlan(2, predicted_ms=9.0, reason="r", candidates=cands)  # nothing between K=1 and K=2
    assert [p.num_tiles for p in _contenders(two)] == [2, 4, 1]


def test_contenders_of_many_tiles_add_the_best_of_at_most_half():
    """A plan of K >= 4 is also timed against the best-predicted plan of at most K/2 tiles where
    that is not already the best-predicted K below it (with P2P disabled the model can put K=6 and
    8 ahead of a K=4 that runs faster)."""
    from overlap_layers.planning.plan import contenders as _contenders
    from overlap_layers.sim import Candidate
    cands = tuple(Candidate(k, False, (), (), ms, 0.0, 100) for k, ms in
                  ((1, 12.0), (2, 9.4), (3, 9.6), (4, 9.0), (6, 8.2), (8, 8.0)))
    # K=8: K=6 is the best below, K=4 the best of at most 4; K=1 last
    assert [p.num_tiles for p in _contenders(MLPPlan(8, reason="r", candidates=cands))] == [8, 6, 4, 1]
    # K=6: K=4 below, K=2 of at most 3; K=8 above
    assert [p.num_tiles for p in _contenders(MLPPlan(6, reason="r", candidates=cands))] == [6, 4, 2, 8, 1]
    # K=4: the best below (K=2) is also the best of at most 2: timed once; K=8 the best above
    assert [p.num_tiles for p in _contenders(MLPPlan(4, reason="r", candidates=cands))] == [4, 2, 8, 1]
    # a memory budget that K=4 exceeds leaves K=2 as the best of at most half
    tight = tuple(Candidate(c.num_tiles, False, (), (), c.predicted_ms, 0.0, 900 if c.num_tiles == 4 else 100)
                  for c in cands)
    assert [p.num_tiles for p in _contenders(MLPPlan(8, reason="r", candidates=tight), budget=500)] == [8, 6, 2, 1]
