"""The planner: choice rule, MLP candidates on synthetic hardware, rank agreement, plan cache."""
import pytest
import torch
import torch.distributed as dist

from overlap_layers import OverlapConfig, OverlapMLP, PlanMismatchError
from overlap_layers.layers.mlp.layer import MLPPlan
from overlap_layers.planning.candidates import plan_candidates
from overlap_layers.layers.common.cost import MLPCostModel
from overlap_layers.sim import COMM_KINDS, Candidate, HardwareModel, choose
from pool import RankFailure


def cand(k, ms, peak=100, regather=False):
    return Candidate(k, regather, (), (), ms, 0.0, peak)


def test_choose_keeps_serial_within_margin():
    c = choose([cand(1, 10.0), cand(2, 9.8)], margin=0.03)
    assert c.candidate.num_tiles == 1 and "kept K=1" in c.reason
    c = choose([cand(1, 10.0), cand(2, 9.0)], margin=0.03)
    assert c.candidate.num_tiles == 2


def test_choose_respects_budget():
    c = choose([cand(1, 10.0, peak=500), cand(2, 9.0, peak=400), cand(4, 8.0, peak=450)], budget_bytes=420)
    assert c.candidate.num_tiles == 2
    c = choose([cand(1, 10.0, peak=500), cand(2, 9.0, peak=400)], budget_bytes=10)
    assert c.candidate.peak_bytes == 400 and "no candidate fits" in c.reason


def hw(interference, gbps, alpha=0.02, tflops=500.0):
    return HardwareModel(gemm_tflops=tflops, gemm_fixed_ms=0.01, mem_gbps=2500.0, launch_ms=0.005,
                         interference=interference, comm={k: (alpha, gbps) for k in COMM_KINDS})


class _Programs:
    """The MLP's real tile programs, built by a layer-free helper (no process group needed)."""

    def __init__(self, sp=True):
        from overlap_layers.layers.mlp.layer import MLPCall as _Call
        from overlap_layers.layers.mlp.layer import mlp_backward_program as _backward_program
        from overlap_layers.layers.mlp.layer import mlp_forward_program as _forward_program
        self.sp, self._f, self._b, self._Call = sp, _forward_program, _backward_program, _Call

    def __call__(self, k, save, regather):
        c = self._Call(None, "swiglu", self.sp, MLPPlan(k, regather=regather), save, None, None)
        return self._f(c, None, None, None), self._b(c, None, None, {}, False)


def llama8b_tp4(model):
    return MLPCostModel(rows=4096, world_size=4, hidden=4096, n_in=2 * 3584, f_local=3584, elt=2,
                        sequence_parallel=True, model=model)


@pytest.mark.parametrize("training", [False, True])
def test_interference_makes_tiling_lose(training):
    # NVLink-like: fast link, and NCCL kernels slow the GEMMs 3x while they run.
    choice = choose(plan_candidates(llama8b_tp4(hw(3.0, 300.0)), _Programs(), training=training))
    assert choice.candidate.num_tiles == 1, choice.reason


@pytest.mark.parametrize("training", [False, True])
def test_slow_link_makes_tiling_win(training):
    # PCIe-like: communication dominates and does not take SMs.
    choice = choose(plan_candidates(llama8b_tp4(hw(1.0, 15.0)), _Programs(), training=training))
    assert choice.candidate.num_tiles > 1, choice.reason
    serial = next(c for c in choice.candidates if c.is_serial)
    assert choice.candidate.predicted_ms < serial.predicted_ms


def test_memory_budget_changes_the_choice():
    cands = plan_candidates(llama8b_tp4(hw(1.0, 15.0)), _Programs(), training=True)
    free = choose(cands)
    budget = free.candidate.peak_bytes - 1
    assert any(c.peak_bytes <= budget for c in cands)
    tight = choose(cands, budget_bytes=budget)
    assert tight.candidate != free.candidate and tight.candidate.peak_bytes <= budget
    # Under round-robin every tile's re-gather is issued in segment 0, so re-gathering x saves no
    # peak memory over keeping it: the model must not claim otherwise.
    for k in {c.num_tiles for c in cands}:
        keep = next(c for c in cands if c.num_tiles == k and not c.regather)
        again = next(c for c in cands if c.num_tiles == k and c.regather)
        assert again.peak_bytes >= keep.peak_bytes


# ------------------------------------------------------------------ on ranks
def auto_layer(rank, ws, seqs):
    layer = OverlapMLP(16, 32, group=dist.group.WORLD, config=OverlapConfig(num_tiles="auto"))
    made = []
    orig = layer.planner.make_plan
    layer.planner.make_plan = lambda *a: made.append(a) or orig(*a)
    for s in seqs:
        layer(torch.randn(1, s, 16, requires_grad=True)).sum().backward()
    p = layer.plan
    return len(made), p.digest(), p.reason, len(p.candidates), layer.explain()


def test_auto_plans_once_per_bucket_and_ranks_agree(pool2):
    res = pool2.run(auto_layer, [5, 6, 7, 8])  # rows 5..8 share the bucket 8
    assert [r[0] for r in res] == [1, 1]
    assert res[0][1] == res[1][1] and res[0][2] and res[0][3] >= 4
    assert "pred ms" in res[0][4] and "reason:" in res[0][4]
    res = pool2.run(auto_layer, [5, 9])  # two buckets
    assert [r[0] for r in res] == [2, 2]


def forced_mismatch(rank, ws):
    layer = OverlapMLP(16, 32, group=dist.group.WORLD)
    if rank == 1:
        layer.planner.make_plan = lambda rows, dtype, save: MLPPlan(2, reason="forced")
    layer(torch.randn(1, 8, 16))


def test_forced_disagreement_raises_plan_mismatch_on_every_rank(pool2):
    with pytest.raises(RankFailure) as info:
        pool2.run(forced_mismatch, timeout=60)
    assert all(e and e[0] == "PlanMismatchError" for e in info.value.errors()), info.value


def test_plan_mismatch_error_is_exported():
    assert issubclass(PlanMismatchError, RuntimeError)


# ------------------------------------------------------------------ bucket search
import itertools  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

from overlap_layers.planning.candidates import bucket_partitions, search_buckets  # noqa: E402
from overlap_layers.planning.tiling import tile_bounds  # noqa: E402
from overlap_layers.schedule import round_robin  # noqa: E402
from overlap_layers.sim import Costs, analytic_model, simulate  # noqa: E402
from programs import mlp_like  # noqa: E402


def _handles(prog):
    return list(dict.fromkeys(op.handle for op in prog.comm_ops()))


def _old_pairs(k):
    return tuple(tuple(range(i, min(i + 2, k))) for i in range(0, k, 2))


def _makespan(prog, k, costs, buckets):
    return simulate(round_robin(prog, k, buckets=dict(buckets)), costs).makespan_ms


def _mlp_programs_and_costs(cm, k, training=True):
    """(program, costs) for the forward and each backward variant at K, as plan_candidates builds them."""
    bounds, out = tile_bounds(cm.rows, k), []
    for regather in (False, True):
        f, b = _Programs()(k, training, regather)
        keep = not regather
        if not regather:
            out.append((f, cm.costs(f, bounds, num_streams=1, save=training, keep_xg=keep, backward=False)))
        out.append((b, cm.costs(b, bounds, num_streams=1, save=True, keep_xg=keep, backward=True)))
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 8])
def test_bucket_partitions_are_valid_and_ordered(k):
    parts = bucket_partitions(k)
    assert parts[0] == tuple((t,) for t in range(k)) and len(set(parts)) == len(parts)
    for p in parts:  # every one covers all tiles in adjacent runs: round_robin accepts it
        round_robin(mlp_like(), k, buckets={"ag": p})
    if k <= 5:
        assert len(parts) == 2 ** (k - 1)
    else:  # optional singleton first/last tile, equal runs between them
        assert len(parts) < 2 ** (k - 1) and _old_pairs(k) in parts and (tuple(range(k)),) in parts
        assert ((0,),) + tuple((i, i + 1) for i in range(1, k - 1, 2)) + ((k - 1,),) in parts
        for p in parts:
            inner = p[1 if len(p[0]) == 1 and len(p) > 1 else 0:]
            inner = inner[:-1] if len(inner) > 1 and len(inner[-1]) == 1 else inner
            assert len({len(g) for g in inner}) == 1, p


@pytest.mark.parametrize("k", [3, 4, 6, 8])
def test_search_beats_adjacent_pairs_when_latency_is_high(k):
    # alpha = 2 ms per collective against ~1 ms of bandwidth time per tile: merging pays.
    cm = llama8b_tp4(hw(1.0, 15.0, alpha=2.0))
    for prog, costs in _mlp_programs_and_costs(cm, k):
        hs = _handles(prog)
        buckets, best, plain = search_buckets(prog, k, costs)
        old = min(_makespan(prog, k, costs, [(h, _old_pairs(k)) for h, on in zip(hs, mask) if on])
                  for mask in itertools.product((False, True), repeat=len(hs)))
        assert buckets and best.makespan_ms < plain.makespan_ms - 1e-6, (prog.name, buckets)
        assert best.makespan_ms <= old + 1e-9, (prog.name, buckets, best.makespan_ms, old)
        assert best.makespan_ms == pytest.approx(_makespan(prog, k, costs, buckets))
    # The candidates carry the searched plan next to the unbucketed one, and it is faster.
    cands = [c for c in plan_candidates(cm, _Programs(), training=True) if c.num_tiles == k]
    for regather in (False, True):
        plain_c, bucketed_c = [c for c in cands if c.regather == regather]
        assert not plain_c.buckets_fwd and not plain_c.buckets_bwd
        assert bucketed_c.buckets_fwd and bucketed_c.buckets_bwd
        assert bucketed_c.predicted_ms < plain_c.predicted_ms


@pytest.mark.parametrize("interference, gbps", [(1.0, 15.0), (1.0, 300.0), (1.3, 100.0), (3.0, 3000.0)])
@pytest.mark.parametrize("training", [False, True])
def test_no_latency_means_no_buckets(interference, gbps, training):
    # Without a per-collective latency a bucket costs exactly its members' sum and only loses
    # overlap. launch_ms is zeroed too: the model charges no host launch for a deferred bucket
    # member, so with launch_ms > 0 a bucket does save launches (a few us) and may win.
    model = replace(hw(interference, gbps, alpha=0.0), launch_ms=0.0)
    cands = plan_candidates(llama8b_tp4(model), _Programs(), training=training)
    assert all(not c.buckets_fwd and not c.buckets_bwd for c in cands), \
        [(c.num_tiles, c.buckets_fwd, c.buckets_bwd) for c in cands if c.buckets_fwd or c.buckets_bwd]
    assert len(cands) == 6 * (2 if training else 1)  # one candidate per K (x regather)


def _exhaustive(prog, k, costs):
    hs = _handles(prog)
    return min((_makespan(prog, k, costs, zip(hs, combo)), combo)
               for combo in itertools.product(bucket_partitions(k), repeat=len(hs)))


@pytest.mark.parametrize("compute_ms, comm_ms, alpha, interference", [
    (1.0, 1.0, 0.4, 1.5), (0.5, 1.0, 0.4, 1.0), (0.5, 1.0, 0.2, 1.5),
    # Here descent from unbucketed alone stops at 15.4 ms (ag (0,)(1,2,3), rs (0,)(1,)(2,3)); the
    # optimum, 15.2 ms, is adjacent pairs on both: found by the pairs seed.
    (0.5, 2.0, 0.2, 1.0)])
def test_search_matches_exhaustive_on_small_synthetic(compute_ms, comm_ms, alpha, interference):
    costs = Costs(compute_ms={"fc1": compute_ms, "fc2": compute_ms}, comm_ms={"ag": comm_ms, "rs": comm_ms},
                  comm_alpha_ms=alpha, interference=interference)
    buckets, best, plain = search_buckets(mlp_like(), 4, costs)
    ex_ms, _ = _exhaustive(mlp_like(), 4, costs)  # 8 x 8 combinations
    assert buckets and best.makespan_ms < plain.makespan_ms
    assert best.makespan_ms == pytest.approx(ex_ms, abs=1e-9)


def test_search_bound_when_not_exhaustive():
    # The search is a local one. On the MLP's backward with re-gather at K=4 (3 collectives,
    # 8**3 combinations) it finds 8.695 ms where the exhaustive minimum is 8.152 ms (6.7% better:
    # ag_dy/ag_x fully merged and rs_dx as (0,)(1,2,3) vs ag_dy (0,1)(2,3), ...). What it does
    # guarantee: never slower than unbucketed or than any unbucketed/adjacent-pairs combination,
    # and no single collective's partition change improves it.
    cm = llama8b_tp4(hw(1.0, 100.0, alpha=1.0))
    prog, costs = _mlp_programs_and_costs(cm, 4)[2]
    assert "ag_x" in _handles(prog)
    buckets, best, plain = search_buckets(prog, 4, costs)
    ex_ms, _ = _exhaustive(prog, 4, costs)
    assert ex_ms <= best.makespan_ms + 1e-9 and best.makespan_ms < plain.makespan_ms
    hs, pairs = _handles(prog), _old_pairs(4)
    for mask in itertools.product((False, True), repeat=len(hs)):
        assert best.makespan_ms <= _makespan(prog, 4, costs, [(h, pairs) for h, on in zip(hs, mask) if on]) + 1e-9
    assign = dict(buckets)
    for h in hs:
        for p in bucket_partitions(4):
            assert _makespan(prog, 4, costs, {**assign, h: p}) >= best.makespan_ms - 1e-9, (h, p)
    print(f"bucket search {best.makespan_ms:.4f} ms vs exhaustive {ex_ms:.4f} ms "
          f"(+{best.makespan_ms / ex_ms - 1:.1%}), unbucketed {plain.makespan_ms:.4f} ms")


def test_budget_excluding_the_bucketed_plan_keeps_its_k_unbucketed():
    # K <= 6 offered, so the smaller K (larger peaks) fall out of the budget with the bucketed K=6
    # plan, whose buckets keep two tiles' buffers alive at once: K=6 unbucketed remains.
    cands = plan_candidates(llama8b_tp4(hw(1.0, 15.0, alpha=1.0)), _Programs(), training=False,
                           tile_choices=(1, 2, 4, 6))
    free = choose(cands).candidate
    assert free.num_tiles == 6 and free.buckets_fwd, free
    plain = next(c for c in cands if c.num_tiles == free.num_tiles and not c.buckets_fwd)
    assert plain.peak_bytes < free.peak_bytes  # the bucket keeps more buffers alive at once
    tight = choose(cands, budget_bytes=plain.peak_bytes)
    assert tight.candidate == plain, tight.reason


def test_candidates_are_deterministic_and_pair_unbucketed_with_bucketed():
    cm = llama8b_tp4(hw(1.0, 15.0, alpha=0.5))
    a = plan_candidates(cm, _Programs(), training=True)
    assert a == plan_candidates(cm, _Programs(), training=True)
    for k, regather in {(c.num_tiles, c.regather) for c in a}:
        group = [c for c in a if c.num_tiles == k and c.regather == regather]
        assert 1 <= len(group) <= 2 and not group[0].buckets_fwd and not group[0].buckets_bwd
        for c in group[1:]:
            assert c.predicted_ms < group[0].predicted_ms
            for pairs in (c.buckets_fwd, c.buckets_bwd):
                assert [h for h, _ in pairs] == sorted(h for h, _ in pairs)


@pytest.mark.parametrize("training", [False, True])
def test_planning_time_llama3_70b_tp4(training):
    # hidden 8192, ffn 28672 over 4 ranks, 16384 tokens with sequence parallelism. Wall time is
    # printed, never asserted (CI machines vary); run with -s to see it.
    ws = 4
    cm = MLPCostModel(rows=16384 // ws, world_size=ws, hidden=8192, n_in=2 * 28672 // ws, f_local=28672 // ws,
                      elt=2, sequence_parallel=True, model=analytic_model("cuda"))
    t0 = time.perf_counter()
    cands = plan_candidates(cm, _Programs(), training=training)
    dt = time.perf_counter() - t0
    print(f"plan_candidates llama3-70b TP4 training={training}: {dt * 1e3:.0f} ms, {len(cands)} candidates")
    assert {c.num_tiles for c in cands} == {1, 2, 3, 4, 6, 8}
