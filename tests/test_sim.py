"""Tier 1: the discrete-event simulator on synthetic programs, answers worked out by hand."""
import ast
import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st

import overlap_layers.sim.simulator as simulator_module
from overlap_layers.schedule import TileProgram, comm, compute, round_robin, wait
from overlap_layers.sim import Costs, simulate


from programs import mlp_like, noop as _noop  # noqa: E402


def mlp_costs(k, comm_ms=None, **kw):
    """Per-tile costs of a layer with 2 ms per GEMM and 1 ms per collective, cut into k tiles."""
    c = 1.0 / k if comm_ms is None else comm_ms
    return Costs(compute_ms={"fc1": 2.0 / k, "fc2": 2.0 / k}, comm_ms={"ag": c, "rs": c}, **kw)


def spans(tl, tile=None):
    """{"name[tile]": (start, end)} for the events of ``tl``."""
    return {f"{e.name}[{e.tile}]": (e.start_ms, e.end_ms) for e in tl.events
            if tile is None or e.tile == tile}


def test_serial_k1():
    # ag 0-1 | fc1 1-3 | fc2 3-5 | rs 5-6: nothing overlaps, both collectives are exposed.
    tl = simulate(round_robin(mlp_like(), 1), mlp_costs(1))
    assert tl.makespan_ms == pytest.approx(6.0)
    assert tl.exposed_comm_ms == pytest.approx(2.0)
    assert tl.stream_busy_ms == pytest.approx({"compute0": 4.0, "comm": 2.0})
    assert spans(tl)["wait_ag[0]"] == (1.0, 1.0)


def test_k2_one_stream_by_hand():
    # Launches: ag0 ag1 | wait_ag0 fc1_0 fc2_0 rs0 | wait_ag1 fc1_1 fc2_1 rs1 | wait_rs0 wait_rs1
    # (one compute stream, alpha 0, no interference).
    # comm:     ag0 0-.5, ag1 .5-1, rs0 2.5-3 (after fc2_0), rs1 4.5-5 (after fc2_1)
    # compute0: fc1_0 .5-1.5, fc2_0 1.5-2.5, fc1_1 2.5-3.5, fc2_1 3.5-4.5, wait_rs1 ends at 5.
    # Exposed: ag0 (0-.5) and rs1 (4.5-5) = 1 ms, half of K=1's 2 ms.
    tl = simulate(round_robin(mlp_like(), 2), mlp_costs(2))
    assert tl.makespan_ms == pytest.approx(5.0)
    assert tl.exposed_comm_ms == pytest.approx(1.0)
    s = spans(tl)
    assert s["rs[0]"] == pytest.approx((2.5, 3.0)) and s["fc1[1]"] == pytest.approx((2.5, 3.5))
    assert s["wait_rs[0]"] == pytest.approx((4.5, 4.5))  # stream busy with tile 1 until 4.5
    assert tl.exposed_comm_ms < simulate(round_robin(mlp_like(), 1), mlp_costs(1)).exposed_comm_ms


def test_k2_two_streams_by_hand():
    # compute0: fc1_0 .5-1.5, fc2_0 1.5-2.5; compute1: fc1_1 1-2, fc2_1 2-3 (after ag1 .5-1).
    # comm: ag0 0-.5, ag1 .5-1, rs0 2.5-3, rs1 3-3.5. Exposed: 0-.5 and 3-3.5.
    tl = simulate(round_robin(mlp_like(), 2), mlp_costs(2, num_streams=2))
    assert tl.makespan_ms == pytest.approx(3.5)
    assert tl.exposed_comm_ms == pytest.approx(1.0)
    assert tl.stream_busy_ms == pytest.approx({"compute0": 2.0, "compute1": 2.0, "comm": 2.0})


def test_interference_slows_overlapped_compute():
    # interference 2: fc1_0 starts at .5 under ag1 (until 1): .25 ms of work done, .75 left -> 1.75.
    # fc2_0 1.75-2.75, rs0 2.75-3.25; fc1_1 starts 2.75 under rs0: .25 done by 3.25 -> ends 4;
    # fc2_1 4-5, rs1 5-5.5.
    tl = simulate(round_robin(mlp_like(), 2), mlp_costs(2, interference=2.0))
    assert spans(tl)["fc1[0]"] == pytest.approx((0.5, 1.75))
    assert tl.makespan_ms == pytest.approx(5.5)
    # K=1 has no overlap, so interference does not touch it.
    assert simulate(round_robin(mlp_like(), 1), mlp_costs(1, interference=2.0)).makespan_ms == 6.0


def test_interference_and_alpha_make_k2_lose():
    # alpha .5: a collective of 1 ms is .5 latency + .5 bandwidth, so a half tile costs .75 ms.
    # interference 4: ag0 0-.75, ag1 .75-1.5; fc1_0 from .75 does .75/4 = .1875 under ag1, the
    # remaining .8125 ends at 2.3125; fc2_0 -3.3125; rs0 -4.0625; fc1_1 from 3.3125 does .1875
    # under rs0 and ends at 4.875; fc2_1 -5.875; rs1 -6.625 > 6 ms of K=1.
    kw = dict(comm_alpha_ms=0.5, interference=4.0)
    k1 = simulate(round_robin(mlp_like(), 1), mlp_costs(1, **kw)).makespan_ms
    k2 = simulate(round_robin(mlp_like(), 2), mlp_costs(2, comm_ms=0.75, **kw)).makespan_ms
    assert k1 == pytest.approx(6.0)
    assert k2 == pytest.approx(6.625)
    # Without interference the same K=2 wins: 5.5 ms.
    no_slow = mlp_costs(2, comm_ms=0.75, comm_alpha_ms=0.5)
    assert simulate(round_robin(mlp_like(), 2), no_slow).makespan_ms == pytest.approx(5.5)


def test_bucketing_saves_one_alpha():
    # Bucket ag of tiles 0 and 1: .5 + 2 * (.75 - .5) = 1 ms instead of 2 * .75 = 1.5 ms.
    # ag[0,1] 0-1; fc1_0 1-2, fc2_0 2-3, rs0 3-3.75; fc1_1 3-4, fc2_1 4-5, rs1 5-5.75.
    costs = mlp_costs(2, comm_ms=0.75, comm_alpha_ms=0.5)
    plain = simulate(round_robin(mlp_like(), 2), costs)
    bucketed = simulate(round_robin(mlp_like(), 2, buckets={"ag": ((0, 1),)}), costs)
    assert plain.stream_busy_ms["comm"] - bucketed.stream_busy_ms["comm"] == pytest.approx(0.5)
    assert spans(bucketed)["ag[(0, 1)]"] == pytest.approx((0.0, 1.0))
    assert bucketed.makespan_ms == pytest.approx(5.75)
    assert plain.makespan_ms == pytest.approx(5.5)  # the lost overlap costs more than alpha here


def test_bucket_waits_for_every_members_compute():
    # p -> c -> wait: tile 0's p is 1 ms, tile 1's 3 ms on its own stream; the bucket of c
    # is issued from tile 1 but must also wait for tile 0's p: it runs 3-5 (2 * 1 ms, alpha 0).
    prog = TileProgram("pc", (compute("p", _noop), comm("c", "all_reduce", src="x"),
                              wait("c", dst="y")))
    costs = Costs(compute_ms=lambda t, op: 1.0 + 2.0 * t, comm_ms={"c": 1.0}, num_streams=2)
    tl = simulate(round_robin(prog, 2, buckets={"c": ((0, 1),)}, order=[1, 0]), costs)
    assert spans(tl)["c[(0, 1)]"] == pytest.approx((3.0, 5.0))
    tl = simulate(round_robin(prog, 2, buckets={"c": ((0, 1),)}, order=[0, 1]), costs)
    assert spans(tl)["c[(0, 1)]"] == pytest.approx((3.0, 5.0))


def test_peak_memory_by_hand():
    # Per tile (K=2; K=1 has twice the bytes): ag's gathered input 50, freed after fc1; fc1's
    # activation 20, saved for backward; fc2's output 15, freed after wait_rs; rs's 5, freed at
    # its own end. Timeline as in test_k2_one_stream_by_hand:
    #   0: +50 (ag0) = 50;  .5: +50 (ag1) +20 (fc1_0) = 120;  1.5: -50 (ag0) +15 (fc2_0) = 85;
    #   2.5: +5 (rs0) +20 (fc1_1) = 110;  3: -5 = 105;  3.5: -50 (ag1) +15 (fc2_1) = 70;
    #   4.5: -15 (fc2_0 at wait_rs0) +5 (rs1) = 60;  5: -15 -5 = 40 (the saved activations).
    # K=1: 100 + 40 during fc1 (1-3) = 140.
    frees = {"ag": "fc1", "fc1": None, "fc2": "wait_rs"}
    b2 = {"ag": 50, "fc1": 20, "fc2": 15, "rs": 5}
    k2 = simulate(round_robin(mlp_like(), 2), mlp_costs(2, bytes=b2, frees=frees, base_bytes=7))
    assert k2.peak_bytes == 120 + 7
    k1 = simulate(round_robin(mlp_like(), 1),
                  mlp_costs(1, bytes={n: 2 * b for n, b in b2.items()}, frees=frees))
    assert k1.peak_bytes == 140
    # Saved-for-backward buffers stay to the end: with only fc1 counted, the peak is both tiles'.
    saved = simulate(round_robin(mlp_like(), 2), mlp_costs(2, bytes={"fc1": 20}, frees=frees))
    assert saved.peak_bytes == 40


def test_frees_must_name_later_ops():
    with pytest.raises(ValueError, match="frees"):
        simulate(round_robin(mlp_like(), 1), mlp_costs(1, bytes={"fc2": 1}, frees={"fc2": "ag"}))
    with pytest.raises(ValueError, match="frees"):
        simulate(round_robin(mlp_like(), 1), mlp_costs(1, frees={"fc2": "nope"}))


def test_launch_cost_delays_ops():
    # launch_ms .5: the k-th launch is ready at .5k; the host runs ahead of the streams, so only
    # the first op is late: ag .5-1.5, fc1 1.5-3.5, fc2 3.5-5.5, rs 5.5-6.5.
    tl = simulate(round_robin(mlp_like(), 1), mlp_costs(1, launch_ms=0.5))
    assert tl.makespan_ms == pytest.approx(6.5)
    # launch_ms 3: launches at 3, 6, 9, 12, 15, 18; ag 3-4, fc1 9-11, fc2 12-14, rs 15-16, and the
    # last wait is launched at 18. Deferred bucket members are free: K=2 with one ag bucket has
    # 11 launches, the last at 33.
    tl = simulate(round_robin(mlp_like(), 1), mlp_costs(1, launch_ms=3.0))
    assert spans(tl) == {"ag[0]": (3, 4), "wait_ag[0]": (6, 6), "fc1[0]": (9, 11),
                         "fc2[0]": (12, 14), "rs[0]": (15, 16), "wait_rs[0]": (18, 18)}
    sched = round_robin(mlp_like(), 2, buckets={"ag": ((0, 1),)})
    assert simulate(sched, mlp_costs(2, launch_ms=3.0)).makespan_ms == pytest.approx(33.0)


def test_chain_orders_across_streams():
    prog = TileProgram("acc", (compute("acc", _noop, chain="grad"),))
    free = TileProgram("acc", (compute("acc", _noop),))
    costs = Costs(compute_ms={"acc": 1.0}, comm_ms={}, num_streams=2)
    assert simulate(round_robin(free, 2), costs).makespan_ms == pytest.approx(1.0)
    assert simulate(round_robin(prog, 2), costs).makespan_ms == pytest.approx(2.0)


def test_chrome_trace_one_x_event_per_launched_op():
    sched = round_robin(mlp_like(), 2, buckets={"ag": ((0, 1),)})
    trace = simulate(sched, mlp_costs(2)).to_chrome_trace()
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(1 for ln in sched.launches if ln.bucket != ()) == 11
    ag = next(e for e in xs if e["name"] == "ag[0,1]")
    assert (ag["ts"], ag["dur"]) == (0.0, pytest.approx(1000.0))  # microseconds
    json.dumps(trace)


def test_missing_cost_and_bad_arguments_raise():
    with pytest.raises(ValueError, match="compute_ms"):
        simulate(round_robin(mlp_like(), 1),
                 Costs(compute_ms={"fc1": 1}, comm_ms={"ag": 1, "rs": 1}))
    for bad in (dict(num_streams=0), dict(interference=0.5), dict(launch_ms=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            mlp_costs(1, **bad)


def test_simulator_is_pure_python():
    tree = ast.parse(open(simulator_module.__file__).read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.split(".")[0] == "torch" for m in imported), imported


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 4), s=st.integers(1, 3), slow=st.sampled_from([1.0, 1.5, 3.0]),
       alpha=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 10_000),
       bucket=st.booleans())
def test_timeline_invariants(k, s, slow, alpha, seed, bucket):
    def cost(t, op):  # deterministic, varied per tile and op
        return 0.2 + ((seed * 31 + t * 7 + len(op.name) * 3) % 10) / 10

    buckets = {"rs": ((tuple(range(k))),)} if bucket else None
    sched = round_robin(mlp_like(), k, buckets=buckets)
    tl = simulate(sched, Costs(compute_ms=cost, comm_ms=cost, comm_alpha_ms=alpha,
                               interference=slow, num_streams=s))
    assert all(b <= tl.makespan_ms + 1e-9 for b in tl.stream_busy_ms.values())
    assert -1e-9 <= tl.exposed_comm_ms <= tl.stream_busy_ms["comm"] + 1e-9
    comm_events = sorted((e for e in tl.events if e.stream == "comm"), key=lambda e: e.start_ms)
    assert all(a.end_ms <= b.start_ms + 1e-9 for a, b in zip(comm_events, comm_events[1:]))
    for e in tl.events:
        if e.stream != "comm" and not e.name.startswith("wait"):
            d = cost(e.tile, next(op for op in mlp_like().ops if op.name == e.name))
            assert d - 1e-9 <= e.end_ms - e.start_ms <= d * slow + 1e-9
    for t in range(k):  # each tile's ops run in program order
        s_t = {e.name: e for e in tl.events
               if e.tile == t or (isinstance(e.tile, tuple) and t in e.tile)}
        order = ["ag", "wait_ag", "fc1", "fc2", "rs", "wait_rs"]
        assert all(s_t[a].end_ms <= s_t[b].end_ms + 1e-9 for a, b in zip(order, order[1:]))
        assert s_t["fc2"].end_ms <= s_t["rs"].start_ms + 1e-9


# ------------------------------------------------------------------ the rank-chunk cost recurrence
def _rank_cm(peer_copy_ms: float, ws: int = 2, interference: float = 1.0):
    """An MLP cost model where every GEMM takes 1 ms and memory passes are free, so a forward
    piece (fc1, act, fc2) takes 2 ms; a chunk of 8 rows x 4 x 2 B = 64 B copies in ``peer_copy_ms``."""
    from overlap_layers.layers.common.cost import MLPCostModel
    from overlap_layers.sim import COMM_KINDS, HardwareModel
    hw = HardwareModel(gemm_tflops=1e12, gemm_fixed_ms=1.0, mem_gbps=1e12, launch_ms=0.0, interference=interference,
                       comm={k: (0.0, 1e12) for k in COMM_KINDS}, op_measured={"peer_copy:64": peer_copy_ms, "signal": 0.0})
    return MLPCostModel(rows=8, world_size=ws, hidden=4, n_in=8, f_local=4, elt=2, sequence_parallel=True, model=hw)


@pytest.mark.parametrize("copy_ms,makespan,exposed", [
    (1.0, 6.0, 0.0),   # pull (0-1) under own[:h] (0-2), peer 2-4, push (4-5) under own[h:] (4-6), sum at 6
    (5.0, 12.0, 6.0),  # pull 0-5 (3 exposed), peer 5-7, own[h:] 7-9, push 7-12 (3 exposed), sum at 12
])
def test_rank_chunk_recurrence_by_hand(copy_ms, makespan, exposed):
    tl = _rank_cm(copy_ms).rank_chunk_timeline(backward=False, transport="copy_engine", sources=1)
    assert tl.makespan_ms == pytest.approx(makespan, abs=1e-6)
    assert tl.exposed_comm_ms == pytest.approx(exposed, abs=1e-6)
    # by start time ("comm" before "compute0" at a tie): the push starts with the own second half
    names = [(e.name, e.tile) for e in sorted(tl.events, key=lambda e: (round(e.start_ms, 6), e.stream))]
    assert [n for n in names if n[0] != "to_symmetric" and n != ("sum", "early")] == \
        [("pull", 1), ("fwd", "own[:h]"), ("fwd", "1"), ("push", 1), ("fwd", "own[h:]"), ("sum", 0)]
    # the first half's rows are summed on compute1 as soon as the last push is in (free here)
    ev = {(e.name, e.tile): e for e in tl.events}
    push_end = ev[("push", 1)].end_ms
    assert (ev[("sum", "early")].stream, ev[("sum", "early")].start_ms) == ("compute1", pytest.approx(push_end))
    assert ev[("sum", 0)].start_ms == pytest.approx(max(push_end, ev[("fwd", "own[h:]")].end_ms))


@pytest.mark.parametrize("copy_ms,makespan,exposed,push_at", [
    (1.0, 6.0, 0.0, 4.0),    # pull 0-1 under own 0-2; peer 2-4, its push 4-5 under the weight gradients 4-6
    (5.0, 12.0, 6.0, 7.0),   # pull 0-5 (3 exposed); peer 5-7, push 7-12 (3 exposed past the wgrads 7-9); sum at 12
])
def test_rank_chunk_recurrence_backward_by_hand(copy_ms, makespan, exposed, push_at):
    """Backward over the copy engine: a piece is its dgrads (2 ms); own rows whole first; then the
    weight gradients over every row (2 ms, the tail); the push leaves after the piece; the sum
    (free here) runs on compute1 right after the last push, beside the weight gradients."""
    tl = _rank_cm(copy_ms).rank_chunk_timeline(backward=True, transport="copy_engine", sources=1)
    assert tl.makespan_ms == pytest.approx(makespan, abs=1e-6)
    assert tl.exposed_comm_ms == pytest.approx(exposed, abs=1e-6)
    ev = {(e.name, e.tile): e for e in tl.events}
    assert [ev[("bwd", "own")].start_ms, ev[("bwd", "1")].start_ms] == pytest.approx([0.0, max(2.0, copy_ms)])
    assert ev[("wgrad", "all")].start_ms == pytest.approx(ev[("bwd", "1")].end_ms)
    assert ev[("push", 1)].start_ms == pytest.approx(push_at)
    early = ev[("sum", "early")]
    assert (early.stream, early.start_ms) == ("compute1", pytest.approx(push_at + copy_ms))
    assert ("sum", 0) not in ev  # every row summed early
    # over NCCL the sum stays on the compute stream, after the last piece
    tl = _rank_cm(copy_ms).rank_chunk_timeline(backward=True, transport="nccl", sources=1)
    s = next(e for e in tl.events if e.name == "sum")
    assert (s.stream, s.start_ms) == ("compute0", pytest.approx(6.0))


def test_rank_chunk_recurrence_four_ranks_pulls_in_a_row():
    # ws=4, copy 3 ms: pulls end at 3, 6, 9; pieces own[:h] 0-2, peer1 3-5, peer2 6-8, peer3 9-11,
    # own[h:] 11-13; pushes 5-8, 8-11, 11-14; sum at 14
    tl = _rank_cm(3.0, ws=4).rank_chunk_timeline(backward=False, transport="copy_engine", sources=1)
    assert tl.makespan_ms == pytest.approx(14.0, abs=1e-6)
    starts = {(e.name, e.tile): e.start_ms for e in tl.events}
    assert [starts[("fwd", str(j))] for j in (1, 2, 3)] == pytest.approx([3.0, 6.0, 9.0], abs=1e-6)



def test_rank_chunk_recurrence_attention_in_two_tiles():
    """[Note: rank-chunk cost] with batch tiles (the attention's): ws=2, two sequences in K=2 tiles,
    GEMMs 1 ms, a tile's core 2 ms, a tile's block copies in 3 ms (pulls at 0-3 and 3-6, queued
    at the start). Tile 0: own qkv 0-1, peer qkv 3-4 (after its pull), core 4-6, peer proj 6-7
    (push 7-10), own proj 7-8; tile 1: own qkv 8-9, peer qkv 9-10 (pulled under tile 0), core
    10-12, the last peer proj in halves ([Note: halved last push]) 12-13 (push 13-14.5) and 13-14
    (push 14.5-16, exposed past own proj 14-15), sum at 16; exposed: the first pull's 2 ms and
    the last push's 1 ms."""
    from overlap_layers.layers.attention.cost import AttentionCostModel
    from overlap_layers.sim import COMM_KINDS, HardwareModel
    hw = HardwareModel(gemm_tflops=1e12, gemm_fixed_ms=1.0, mem_gbps=1e12, launch_ms=0.0, interference=1.0,
                       comm={k: (0.0, 1e12) for k in COMM_KINDS},
                       op_measured={"peer_copy:64": 6.0, "signal": 0.0, "core:1x4:q1kv1d4:causal": 2.0})
    cm = AttentionCostModel(batch=2, seq_local=2, world_size=2, hidden=8, heads=1, kv_heads=1, head_dim=4, elt=2,
                            sequence_parallel=True, causal=True, model=hw)
    tl = cm.rank_chunk_timeline(backward=False, transport="copy_engine", sources=1, tiles=2)
    assert tl.makespan_ms == pytest.approx(16.0, abs=1e-6)
    assert tl.exposed_comm_ms == pytest.approx(3.0, abs=1e-6)
    spans = {(e.name, e.tile): tuple(round(t, 6) for t in (e.start_ms, e.end_ms)) for e in tl.events}
    want = {("qkv", "0.own"): (0, 1), ("qkv", "0.1"): (3, 4), ("core", "0.all"): (4, 6), ("push", "0.1"): (7, 10),
            ("pull", "1.1"): (3, 6), ("qkv", "1.1"): (9, 10), ("core", "1.all"): (10, 12),
            ("proj", "1.1[:h]"): (12, 13), ("push", "1.1[:h]"): (13, 14.5), ("proj", "1.1[h:]"): (13, 14),
            ("push", "1.1[h:]"): (14.5, 16), ("proj", "1.own"): (14, 15)}
    assert {k: spans[k] for k in want} == want
    assert cm.rank_tiles() == (1, 2)


def test_attention_rank_tiles_run_the_core_heads_step_chunk_by_chunk():
    """Without qk-norm the rank-chunk forward RoPEs each pulled chunk into the core's buffers, so
    each qkv piece carries 1/ws of the measured heads step and the core the rest (by hand): the
    previous test's shapes with heads 1 ms a tile (0.5 a chunk), core 2 ms (1 ms left). Tile 0:
    own qkv 0-1.5, peer qkv 3-4.5 (after its pull), core 4.5-5.5, peer proj 5.5-6.5 (push
    6.5-9.5), own proj 6.5-7.5; tile 1: own qkv 7.5-9, peer qkv 9-10.5, core 10.5-11.5, peer proj
    halves 11.5-12.5 and 12.5-13.5 (pushes 12.5-14 and 14-15.5), own proj 13.5-14.5; exposed:
    1.5 ms of the first pull, 1 ms of the last push. The backward's pieces do not change."""
    from overlap_layers.layers.attention.cost import AttentionCostModel
    from overlap_layers.sim import COMM_KINDS, HardwareModel
    hw = HardwareModel(gemm_tflops=1e12, gemm_fixed_ms=1.0, mem_gbps=1e12, launch_ms=0.0, interference=1.0,
                       comm={k: (0.0, 1e12) for k in COMM_KINDS},
                       op_measured={"peer_copy:64": 6.0, "signal": 0.0, "core:1x4:q1kv1d4:causal": 2.0,
                                    "heads:1x4:q1kv1d4:causal": 1.0})
    shape = dict(batch=2, seq_local=2, world_size=2, hidden=8, heads=1, kv_heads=1, head_dim=4, elt=2,
                 sequence_parallel=True, causal=True, model=hw)
    cm = AttentionCostModel(chunked_heads=True, **shape)
    tl = cm.rank_chunk_timeline(backward=False, transport="copy_engine", sources=1, tiles=2)
    assert tl.makespan_ms == pytest.approx(15.5, abs=1e-6)
    assert tl.exposed_comm_ms == pytest.approx(2.5, abs=1e-6)
    spans = {(e.name, e.tile): tuple(round(t, 6) for t in (e.start_ms, e.end_ms)) for e in tl.events}
    want = {("qkv", "0.own"): (0, 1.5), ("qkv", "0.1"): (3, 4.5), ("core", "0.all"): (4.5, 5.5),
            ("push", "0.1"): (6.5, 9.5), ("qkv", "1.own"): (7.5, 9), ("qkv", "1.1"): (9, 10.5),
            ("core", "1.all"): (10.5, 11.5), ("push", "1.1[:h]"): (12.5, 14), ("push", "1.1[h:]"): (14, 15.5)}
    assert {k: spans[k] for k in want} == want
    assert "heads:1x4:q1kv1d4:causal" in cm.core_ops()
    plain = AttentionCostModel(**shape)  # qk-norm: the whole core runs after the pulls
    assert all(not k.startswith("heads") for k in plain.core_ops())
    assert cm.rank_pieces(backward=True, tiles=2) == plain.rank_pieces(backward=True, tiles=2)


def test_attention_rank_forward_by_query_chunks_projects_each_chunk_after_its_core():
    """[Note: query-chunk core] by hand: ws=2, one sequence, GEMMs 1 ms, a chunk's copy 2 ms,
    rank 0's query chunks 0.5 ms (its own rows: the diagonal piece alone) and 1.5 ms (rank 1's).
    Each QKV piece runs its chunk's diagonal piece (0.5): own qkv 0-1.5, peer qkv 2-3.5 (after its
    pull), the peer chunk's rest + its first half's projection 3.5-5.5 (push 5.5-6.5), the second
    half's 5.5-6.5 (push 6.5-7.5), own projection 6.5-7.5, sum at 7.5; no core piece. With a copy
    of 0.5 ms, shorter than the QKV projection, the diagonal pieces stay with the projections: own
    qkv 0-1, peer qkv 1-2, peer chunk + first half's projection 2-4.5, second half's 4.5-5.5, own
    chunk + projection 5.5-7. The whole core (2 ms) after the pulls instead: peer projection
    halves 5-6 and 6-7, pushes 6-7 and 7-8. The backward's pieces do not change; unmeasured chunks take the
    causal core's share (2c+1)/ws^2 of its FLOPs."""
    from overlap_layers.layers.attention.cost import AttentionCostModel
    from overlap_layers.sim import COMM_KINDS, HardwareModel
    measured = {"peer_copy:32": 2.0, "signal": 0.0, "core:1x4:q1kv1d4:causal": 2.0, "heads:1x4:q1kv1d4:causal": 0.0,
                "chunk0:1x4:q1kv1d4:causal": 0.5, "chunk1:1x4:q1kv1d4:causal": 1.5}
    hw = HardwareModel(gemm_tflops=1e12, gemm_fixed_ms=1.0, mem_gbps=1e12, launch_ms=0.0, interference=1.0,
                       comm={k: (0.0, 1e12) for k in COMM_KINDS}, op_measured=measured)
    shape = dict(batch=1, seq_local=2, world_size=2, hidden=8, heads=1, kv_heads=1, head_dim=4, elt=2,
                 sequence_parallel=True, causal=True, model=hw, chunked_heads=True)
    cm = AttentionCostModel(query_chunks=True, **shape)
    tl = cm.rank_chunk_timeline(backward=False, transport="copy_engine", sources=1)
    spans = {(e.name, e.tile): tuple(round(t, 6) for t in (e.start_ms, e.end_ms)) for e in tl.events}
    want = {("qkv", "own"): (0, 1.5), ("qkv", "1"): (2, 3.5), ("proj", "1[:h]"): (3.5, 5.5),
            ("push", "1[:h]"): (5.5, 6.5), ("proj", "1[h:]"): (5.5, 6.5), ("push", "1[h:]"): (6.5, 7.5), ("proj", "own"): (6.5, 7.5)}
    assert {k: spans[k] for k in want} == want
    assert tl.makespan_ms == pytest.approx(7.5) and all(e.name != "core" for e in tl.events)
    whole = AttentionCostModel(**shape).rank_chunk_timeline(backward=False, transport="copy_engine", sources=1)
    assert whole.makespan_ms == pytest.approx(8.0)
    assert {"chunk0:1x4:q1kv1d4:causal", "chunk1:1x4:q1kv1d4:causal"} <= set(cm.core_ops())
    assert cm.rank_pieces(backward=True) == AttentionCostModel(**shape).rank_pieces(backward=True)
    assert cm.diagonal_first("copy_engine")  # the copy (2 ms) outlasts the QKV projection (1 ms)
    fast = AttentionCostModel(query_chunks=True, **dict(shape, model=dataclasses.replace(
        hw, op_measured=dict(measured, **{"peer_copy:32": 0.5}))))
    assert not fast.diagonal_first("copy_engine")  # then the diagonal piece stays with its projection
    tl = fast.rank_chunk_timeline(backward=False, transport="copy_engine", sources=1)
    spans = {(e.name, e.tile): tuple(round(t, 6) for t in (e.start_ms, e.end_ms)) for e in tl.events}
    want = {("qkv", "own"): (0, 1), ("qkv", "1"): (1, 2), ("proj", "1[:h]"): (2, 4.5), ("proj", "1[h:]"): (4.5, 5.5),
            ("proj", "own"): (5.5, 7)}
    assert {k: spans[k] for k in want} == want
    cm.model = dataclasses.replace(hw, op_measured={})
    core = cm.op_ms(4, "core")
    assert [cm.op_ms(4, f"chunk{c}") for c in (0, 1)] == pytest.approx([(core - 1) / 4 + 1, 3 * (core - 1) / 4 + 1])


def test_attention_rank_backward_sums_beside_the_last_weight_gradient():
    """Over the copy engine the attention backward sums the slots on a second stream once the last
    own piece has written its rows, beside the QKV weight gradient, which with one tile runs once
    over every row after the own piece (by hand): GEMMs 1 ms, core backward 4 ms, a chunk's copy
    0.5 ms, the sum 2 ms. dgrad_o own 0-2, peer 2-4, core 4-8, peer dgrad_qkv in halves 8-9 and
    9-10 (their pushes 9-9.25 and 10-10.25), own dgrad_qkv 10-11, the weight gradient 11-12: the
    sum runs 11-13. Over NCCL the sum follows everything: 12-14."""
    from overlap_layers.layers.attention.cost import AttentionCostModel
    from overlap_layers.sim import COMM_KINDS, HardwareModel
    hw = HardwareModel(gemm_tflops=1e12, gemm_fixed_ms=1.0, mem_gbps=9.6e-5, launch_ms=0.0, interference=1.0,
                       comm={k: (0.0, 1e12) for k in COMM_KINDS},
                       op_measured={"peer_copy:64": 0.5, "signal": 0.0, "core_bwd:2x4:q1kv1d4:causal": 4.0})
    assert hw.mem_ms(3 * 64) == pytest.approx(2.0)  # the sum reads ws slots and writes one: (ws+1)*T*H*e
    cm = AttentionCostModel(batch=2, seq_local=2, world_size=2, hidden=8, heads=1, kv_heads=1, head_dim=4, elt=2,
                            sequence_parallel=True, causal=True, model=hw)
    ce = cm.rank_chunk_timeline(backward=True, transport="copy_engine", sources=1, tiles=1)
    spans = {(e.name, e.tile, e.stream): (round(e.start_ms, 6), round(e.end_ms, 6)) for e in ce.events}
    assert spans[("dgrad_qkv", "own", "compute0")] == (10, 11) and spans[("push", "1[:h]", "comm")] == (9, 9.25)
    assert spans[("push", "1[h:]", "comm")] == (10, 10.25) and spans[("wgrad_qkv", "all", "compute0")] == (11, 12)
    assert spans[("sum", "early", "compute1")] == (11, 13) and ce.makespan_ms == pytest.approx(13.0)
    nccl = cm.rank_chunk_timeline(backward=True, transport="nccl", sources=1, tiles=1)
    assert [(e.start_ms, e.end_ms) for e in nccl.events if e.name == "sum"] == [(12.0, 14.0)]
    assert cm.rank_chunk_timeline(backward=False, transport="copy_engine", sources=1, tiles=1).events[-1].stream \
        == "compute0"  # the forward's last piece is the own projection: nothing to sum beside


def test_attention_core_keys_name_everything_the_core_time_depends_on():
    """The calibration cache holds every layer's measured ops under their keys, so two layers
    whose cores differ (heads, KV heads, head dim, causal) must not share one: a llama3-70b
    attention once planned with the 8b core's time (both B=2, S=8192)."""
    from overlap_layers.layers.attention.cost import AttentionCostModel
    from overlap_layers.layers.attention.ulysses_cost import UlyssesCostModel
    from overlap_layers.sim import analytic_model

    def key(cls, name="core", **kw):
        shape = dict(batch=2, seq_local=2048, world_size=4, hidden=4096, heads=8, kv_heads=2, head_dim=128, elt=2,
                     causal=True, model=analytic_model("cpu"))
        shape.update(kw)
        if cls is AttentionCostModel:
            return cls(sequence_parallel=True, **shape).core_key(name, 2)
        return cls(**shape).core_key(name, 2)
    for cls in (AttentionCostModel, UlyssesCostModel):
        base = key(cls)
        assert key(cls) == base and key(cls, "core_bwd") != base
        for change in (dict(heads=16), dict(kv_heads=1), dict(head_dim=64), dict(causal=False), dict(seq_local=1024)):
            if cls is UlyssesCostModel and "heads" in change:  # global heads: 8 q, 2 kv -> 2 q and 1 kv a rank
                change = dict(heads=16, hidden=8192)
            elif cls is UlyssesCostModel and "kv_heads" in change:
                change = dict(kv_heads=8)  # 2 kv a rank (kv_heads=1 leaves 1, the same core)
            assert key(cls, **change) != base, (cls.__name__, change)
