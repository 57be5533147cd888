"""The MoE planner on synthetic hardware: tiling pays when the all-to-alls are slow and the
experts are heavy, and loses when NCCL slows the expert GEMMs (no process group needed)."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from overlap_layers.layers.moe.routing import tile_index
from overlap_layers.layers.moe.tiles import TileCall as _Call
from overlap_layers.layers.moe.tiles import backward_program as _backward_program
from overlap_layers.layers.moe.tiles import forward_program as _forward_program
from overlap_layers.layers.moe.tiles import regroup_index
from overlap_layers.planning.tiling import tile_bounds
from overlap_layers.layers.moe.cost import MoECostModel
from overlap_layers.planning.candidates import plan_candidates
from overlap_layers.planning.plan import TilePlan
from overlap_layers.layers.common.tp_program import Accumulator
from overlap_layers.sim import COMM_KINDS, HardwareModel, choose


def programs(k, save, regather):
    layer = SimpleNamespace(group=None, activation="swiglu", launch_log=None)
    call = _Call(layer, TilePlan(k), save, None, [])
    return _forward_program(call, None, None), _backward_program(call, None, None, Accumulator({}))


def mixtral_ep4(interference, gbps, grouped=False):
    hw = HardwareModel(gemm_tflops=600.0, gemm_fixed_ms=0.01, mem_gbps=3000.0, launch_ms=0.005,
                       interference=interference, comm={k: (0.02, gbps) for k in COMM_KINDS})
    return MoECostModel(tokens=8192, world_size=4, hidden=4096, n_in=2 * 14336, ffn=14336, experts=8, top_k=2,
                        elt=2, model=hw, grouped=grouped)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_slow_all_to_all_makes_tiling_pay(training, grouped):
    choice = choose(plan_candidates(mixtral_ep4(1.0, 20.0, grouped), programs, training=training))
    assert choice.candidate.num_tiles > 1, choice.reason


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_interference_keeps_the_serial_layer(training, grouped):
    choice = choose(plan_candidates(mixtral_ep4(3.0, 400.0, grouped), programs, training=training))
    assert choice.candidate.num_tiles == 1, choice.reason


def test_candidates_count_every_assignment_row():
    cm = mixtral_ep4(1.0, 100.0)
    (one,) = [c for c in plan_candidates(cm, programs, training=False) if c.num_tiles == 1]
    a = 8192 * 2  # assignment rows
    comm_ms = 2 * cm.model.comm_ms("all_to_all", a * 4096 * 2)
    assert one.predicted_ms > comm_ms  # serial: both exchanges plus the experts, nothing hidden


def test_grouped_gemm_experts_equal_the_per_expert_loop():
    """The experts' grouped-GEMM path (float32, 16-byte aligned rows) against the per-expert loop
    (float64, which never takes the grouped path), with an empty expert, forward and gradients."""
    import torch
    from overlap_layers.layers.moe.experts import grouped_gemm_ok
    layer = SimpleNamespace(group=None, activation="swiglu", launch_log=None)
    call = _Call(layer, TilePlan(1), True, None, [])
    torch.manual_seed(0)
    counts = torch.tensor([[2, 0, 3], [1, 0, 4]])  # [source, local expert]; expert 1 gets nothing
    sizes = counts.sum(0).tolist()
    offs = torch.cumsum(counts.sum(0), 0).to(torch.int32)
    x = torch.randn(sum(sizes), 16)
    w_in, w_out = torch.randn(3, 16, 16) * 0.3, torch.randn(3, 16, 8) * 0.3
    dy = torch.randn(sum(sizes), 16)
    got_leaves = [t.clone().requires_grad_() for t in (x, w_in, w_out)]
    want_leaves = [t.double().requires_grad_() for t in (x, w_in, w_out)]
    assert grouped_gemm_ok(*got_leaves) and not grouped_gemm_ok(*want_leaves)
    got = call.experts(got_leaves[0], sizes, offs, got_leaves[1], got_leaves[2])
    want = call.experts(want_leaves[0], sizes, offs, want_leaves[1], want_leaves[2])
    got.backward(dy)
    want.backward(dy.double())
    for g, w in [(got, want)] + [(a.grad, b.grad) for a, b in zip(got_leaves, want_leaves)]:
        assert torch.allclose(g.double(), w, rtol=1e-4, atol=1e-5)


def test_grouped_experts_cost_one_gemm_per_projection():
    """Grouped, the experts of a tile cost one GEMM per projection over all its rows, plus a read of
    the other local expert's weights; per expert, El GEMMs of r rows each (more fixed costs)."""
    per_expert, grouped = mixtral_ep4(1.0, 100.0), mixtral_ep4(1.0, 100.0, grouped=True)
    md, a = grouped.model, 4096
    gathers = md.mem_ms(4 * a * 4096 * 2) + md.mem_ms(a * (2 * 14336 + 14336) * 2)
    other_weights = (2 * 14336 * 4096 + 4096 * 14336) * 2 / 3e9  # the second local expert's, at 3000 GB/s
    assert grouped.op_ms(a, "experts") == pytest.approx(md.gemm_ms(a, 2 * 14336, 4096) + md.gemm_ms(a, 4096, 14336)
                                                        + other_weights + gathers)
    assert per_expert.op_ms(a, "experts") - grouped.op_ms(a, "experts") == pytest.approx(2 * 0.01 - other_weights)


@given(n=st.integers(0, 50), k=st.integers(1, 9))
def test_tile_index_matches_tile_bounds(n, k):
    want = [t for t, (a, b) in enumerate(tile_bounds(n, k)) for _ in range(a, b)]
    assert tile_index(n, k, "cpu").tolist() == want


@given(counts=st.lists(st.integers(0, 3), min_size=1, max_size=24), shape=st.sampled_from([(1, 2, 3), (2, 3, 2),
                                                                                          (3, 2, 2), (2, 1, 4)]))
def test_regroup_index_groups_by_the_second_key_and_inverts(counts, shape):
    K, A, B = shape
    c = torch.tensor((counts * 24)[:K * A * B]).view(K, A, B)
    # label every row by (tile, a, b, i) in the a-then-b layout, then regroup: b-then-a within each tile
    rows = [(t, a, b, i) for t in range(K) for a in range(A) for b in range(B) for i in range(int(c[t, a, b]))]
    starts = [0]
    for t in range(K):
        starts.append(starts[-1] + int(c[t].sum()))
    bound = len(rows) + 5  # any bound: the positions past the rows are never read
    idx, inv = regroup_index(c, bound).tolist(), regroup_index(c.transpose(1, 2), bound).tolist()
    got = [rows[starts[t] + idx[p]] for t in range(K) for p in range(starts[t], starts[t + 1])]
    assert got == sorted(rows, key=lambda r: (r[0], r[2], r[1], r[3]))
    assert [got[starts[t] + inv[p]] for t in range(K) for p in range(starts[t], starts[t + 1])] == rows


def test_count_table_by_hand():
    """The gathered counts, flat in (source, tile, destination, local expert) order, as nested
    lists indexed the same way: 2 ranks, 3 tiles, 2 local experts, every count distinct."""
    from overlap_layers.layers.moe.tiles import count_table
    ws, K, El = 2, 3, 2
    flat = list(range(ws * K * ws * El))
    table = count_table(flat, ws, K)
    for s in range(ws):
        for t in range(K):
            for d in range(ws):
                assert table[s][t][d] == [((s * K + t) * ws + d) * El + e for e in range(El)]


# ------------------------------------------------------------------ the rank-chunk plan's cost
def _rank_moe(peer_copy_ms: float, experts: int = 32) -> MoECostModel:
    """ws=2, 8 tokens, top-2: a source's chunk is 8 rows x 4 x 2 B = 64 B, copied in
    ``peer_copy_ms``; every (grouped) GEMM takes 1 ms and memory passes are free. 16 local
    experts: a piece's weight gradients are one grouped GEMM per projection."""
    hw = HardwareModel(gemm_tflops=1e12, gemm_fixed_ms=1.0, mem_gbps=1e12, launch_ms=0.0, interference=1.0,
                       comm={k: (0.0, 1e12) for k in COMM_KINDS}, op_measured={"peer_copy:64": peer_copy_ms, "signal": 0.0})
    return MoECostModel(tokens=8, world_size=2, hidden=4, n_in=8, ffn=4, experts=experts, top_k=2, elt=2, model=hw,
                        grouped=True)


@pytest.mark.parametrize("copy_ms,fwd,fwd_exposed,bwd,bwd_exposed", [
    # fwd: own[:h] 0-2 beside the pull, peer 2-4, its push 4-5 under own[h:] 4-6; nothing summed
    # bwd: own rows 0-4 (dgrads and wgrads), peer dgrad 4-6, push 6-7 under its wgrads 6-8
    (1.0, 6.0, 0.0, 8.0, 0.0),
    # fwd: pull 0-5 (3 exposed), peer 5-7, push 7-12 (3 exposed past own[h:] 7-9)
    # bwd: pull 0-5 (1 exposed), peer dgrad 5-7, push 7-12 outlasts its wgrads (7-9) by 3
    (5.0, 12.0, 6.0, 12.0, 4.0),
])
def test_rank_chunk_recurrence_by_hand(copy_ms, fwd, fwd_exposed, bwd, bwd_exposed):
    cm = _rank_moe(copy_ms)
    assert cm.chunk_rows() == 8 and cm.chunk_bytes() == 64
    for backward, makespan, exposed in ((False, fwd, fwd_exposed), (True, bwd, bwd_exposed)):
        tl = cm.rank_chunk_timeline(backward=backward, transport="copy_engine", sources=1)
        assert tl.makespan_ms == pytest.approx(makespan, abs=1e-6), backward
        assert tl.exposed_comm_ms == pytest.approx(exposed, abs=1e-6), backward
        names = {e.name for e in tl.events}
        assert "to_symmetric" not in names  # the dispatch gathers straight into the buffer
        assert "sum" not in names  # results come back in place: finish only waits for the last push
        (finish,) = [e for e in tl.events if e.name == "finish"]
        assert finish.end_ms == pytest.approx(finish.start_ms) and finish.end_ms == pytest.approx(makespan)
    # 2 local experts: weight gradients as one accumulating GEMM per expert and projection (4 ms a
    # piece): own 0-6, peer dgrad 6-8, its push under the tail 8-12
    assert _rank_moe(1.0, experts=4).rank_chunk_ms(backward=True, transport="copy_engine", sources=1) == \
        pytest.approx((12.0, 0.0), abs=1e-6)


def test_rank_chunks_over_send_recv_cost_all_to_all_steps():
    """Over send/recv a source's rows cost one step of the all-to-all (NCCL runs it as send/recv),
    not of the all-gather: with the all-to-all moving a 64-byte chunk per step in 1 ms and the
    all-gather five times slower, the recurrence is the copy engine's first row above."""
    cm = _rank_moe(99.0)  # the copy engine's time, which send/recv must not use
    a2a_gbps, ag_gbps = 2 * 64 / 1e6, 2 * 64 / 5e6  # ws * 64 bytes in 1 ms / in 5 ms
    cm.model = HardwareModel(**{**vars(cm.model), "comm": {**{k: (0.0, ag_gbps) for k in COMM_KINDS},
                                                           "all_to_all": (0.0, a2a_gbps)}})
    assert cm.rank_chunk_ms(backward=False, transport="nccl", sources=1) == pytest.approx((6.0, 0.0), abs=1e-6)
    assert cm.rank_chunk_ms(backward=True, transport="nccl", sources=1) == pytest.approx((8.0, 0.0), abs=1e-6)


def test_rank_chunks_skip_the_regrouping_gathers():
    """A rank piece costs the experts without the gathers that group a tile's received rows by
    expert (each source's rows arrive grouped), so with free communication the rank-chunk
    forward beats K=1's experts by exactly those gathers."""
    hw = HardwareModel(gemm_tflops=600.0, gemm_fixed_ms=0.01, mem_gbps=3000.0, launch_ms=0.0, interference=1.0,
                       comm={k: (0.0, 1e12) for k in COMM_KINDS}, op_measured={"peer_copy:33554432": 0.0, "signal": 0.0})
    cm = MoECostModel(tokens=8192, world_size=4, hidden=4096, n_in=2 * 2048, ffn=2048, experts=16, top_k=2, elt=2,
                      model=hw, grouped=True)
    a = cm.rows * cm.k
    serial = cm.op_ms(a, "experts")
    ranked = cm.rank_chunk_ms(backward=False, transport="copy_engine", sources=1)[0]
    assert cm.chunk_bytes() == 33554432
    # five pieces (own halves, three peers): five grouped GEMM pairs, each with its fixed cost and a
    # read of the three other local experts' weights, against one
    reads = 3 * (2 * 2048 * 4096 + 4096 * 2048) * 2 / 3e9
    assert ranked == pytest.approx(serial - cm.model.mem_ms(4 * a * cm.H * cm.e) + 4 * (2 * 0.01 + reads), rel=1e-6)


def _qwen3_ep4(**model) -> MoECostModel:
    hw = HardwareModel(**{**dict(gemm_tflops=700.0, gemm_fixed_ms=0.01, mem_gbps=4000.0, launch_ms=0.005,
                                 interference=1.0, comm={k: (0.02, 150.0) for k in COMM_KINDS}), **model})
    return MoECostModel(tokens=8192, world_size=4, hidden=2048, n_in=2 * 768, ffn=768, experts=128, top_k=8,
                        elt=2, model=hw, grouped=True)


def test_unmeasured_grouped_gemms_add_a_read_of_the_weights():
    """[Note: grouped GEMMs cost more than dense ones]: unmeasured, a grouped GEMM of one tile
    costs the dense GEMM of its shape plus a read of the other 31 local experts' weights, whatever
    its rows; so K tiles pay K reads, which moves the best K down (all-to-alls at 600 GB/s)."""
    cm = _qwen3_ep4(comm={k: (0.02, 600.0) for k in COMM_KINDS})
    md, a = cm.model, 16384
    gate_up = md.gemm_ms(a, 1536, 2048) + 31 * 1536 * 2048 * 2 / 4e9
    down = md.gemm_ms(a, 2048, 768) + 31 * 2048 * 768 * 2 / 4e9
    assert cm.op_ms(a, "experts") == pytest.approx(gate_up + down + md.mem_ms(4 * a * 2048 * 2)
                                                   + md.mem_ms(a * (1536 + 768) * 2), rel=1e-9)
    free = _qwen3_ep4(comm={k: (0.02, 600.0) for k in COMM_KINDS})  # as if measured at the dense GEMMs' times
    free.model = HardwareModel(**{**vars(md), "op_measured": {
        key: md.gemm_ms(m, n, k) for key, (m, n, k, _) in free.grouped_ops().items()}})
    for training in (False, True):
        slow = choose(plan_candidates(cm, programs, training=training)).candidate.num_tiles
        fast = choose(plan_candidates(free, programs, training=training)).candidate.num_tiles
        assert slow < fast, (training, slow, fast)


def test_measured_grouped_gemms_replace_the_estimate():
    """A grouped GEMM the layer timed (``op_measured`` under ``grouped_mm:m,n,k,El,w``, ``w`` t for
    the forward's transposed weights, c for the data gradient's) costs what was measured."""
    cm = _qwen3_ep4(op_measured={"grouped_mm:16384,1536,2048,32,t": 0.195, "grouped_mm:16384,2048,768,32,t": 0.112,
                                 "grouped_mm:16384,768,2048,32,c": 0.104, "grouped_mm:16384,2048,1536,32,c": 0.188})
    md, a = cm.model, 16384
    assert cm.op_ms(a, "experts") == pytest.approx(0.195 + 0.112 + md.mem_ms(4 * a * 2048 * 2)
                                                   + md.mem_ms(a * (1536 + 768) * 2), rel=1e-9)
    dgrads = cm.op_ms(a, "experts_bwd") - cm._wgrad_ms(a) - md.mem_ms(4 * a * 2048 * 2)
    assert dgrads == pytest.approx(0.104 + 0.188 + md.mem_ms(a * (2 * 1536 + 768) * 2), rel=1e-9)


class _Reads(dict):
    """A dict that records the keys looked up."""

    def __init__(self, *a):
        super().__init__(*a)
        self.asked = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)


@pytest.mark.parametrize("grouped", [False, True])
def test_the_layer_measures_every_gemm_the_planner_prices(grouped):
    """Every GEMM the candidates are priced by (batch tiles and rank pieces, forward and
    backward) is one the layer times at its first call: dense ones by shape
    (``gemm_shapes``), grouped ones by key (``grouped_ops``); none of the grouped forward or
    data-gradient GEMMs is timed as a dense GEMM."""
    cm = _qwen3_ep4()
    cm.grouped = grouped
    timed = _Reads({key: 1.0 for key in cm.grouped_ops()})  # as the layer's first call leaves them
    cm.model = HardwareModel(**{**vars(cm.model), "gemm_measured": _Reads(), "op_measured": timed})
    plan_candidates(cm, programs, training=True)
    for backward in (False, True):
        cm.rank_chunk_ms(backward=backward, transport="copy_engine", sources=1)
    grouped_asked = {k for k in cm.model.op_measured.asked if k.startswith("grouped_mm:")}
    assert grouped_asked == set(cm.grouped_ops()) and bool(grouped_asked) == grouped
    assert cm.model.gemm_measured.asked == cm.gemm_shapes()
    assert grouped == ((cm.rows * cm.k, 1536, 2048, 0) in set(cm.grouped_ops().values()) and
                       not any(s[1:] in ((1536, 2048), (2048, 768)) for s in cm.gemm_shapes()))


def test_rank_piece_offsets_by_hand():
    """The grouped-GEMM offsets of the rank pieces (moe_ranks.RankCall.pieces order): own first
    part (own rows [0, m)), own second part, own whole, then the peers in step order, each
    cumulative per local expert; rank 1 of 3, own rows [3, 0, 2], m = 2; and m past the own rows
    (the first part takes them all) or 0 (the second does)."""
    from overlap_layers.layers.moe.ranks import RankCall, piece_offsets
    sizes = [[1, 4, 0], [3, 0, 2], [0, 0, 5]]  # rows from source s per local expert
    offsets = piece_offsets(torch.tensor(sizes), 1, 2)
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [[2, 2, 2], [1, 1, 3], [3, 3, 5], [0, 0, 5], [1, 5, 5]]
    assert piece_offsets(torch.tensor(sizes), 1, 7).tolist()[:2] == [[3, 3, 5], [0, 0, 0]]
    assert piece_offsets(torch.tensor(sizes), 1, 0).tolist()[:2] == [[0, 0, 0], [3, 3, 5]]
    gathered = torch.zeros(3, 2, 3, 3, dtype=torch.int64)  # [source, tile, destination, expert], as the MoE's
    gathered[:, 0, 1] = torch.tensor(sizes)
    assert piece_offsets(gathered[:, 0, 1], 1, 2).tolist() == offsets.tolist()  # a strided view
    call = RankCall(rank=1, world_size=3, activation="swiglu", grouped=False, save=False, table=None, sizes=sizes,
                    first_rows=2, offsets=offsets, keys=None, pos=None, kept=0, top_k=1, capacity_rows=0,
                    exchange=None, sent=None)
    assert call.pieces(backward=False) == [(0, 0, 0, 2, [2, 0, 0]), (3, 1, 0, 5, [0, 0, 5]), (4, 2, 0, 5, [1, 4, 0]),
                                           (1, 0, 2, 5, [1, 0, 2])]
    assert call.pieces(backward=True) == [(2, 0, 0, 5, [3, 0, 2]), (3, 1, 0, 5, [0, 0, 5]), (4, 2, 0, 5, [1, 4, 0])]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5).flatmap(lambda ws: st.tuples(
    st.integers(0, ws - 1), st.lists(st.lists(st.integers(0, 9), min_size=3, max_size=3), min_size=ws, max_size=ws),
    st.integers(0, 30))))
def test_rank_piece_offsets_match_the_host_sizes(case):
    """The device offsets (launched before the host has the counts) are the cumulative sums of the
    host's piece sizes, for any counts (zeros, odd own totals), any rank and any first part."""
    from overlap_layers.layers.moe.ranks import piece_offsets, piece_sizes
    rank, sizes, m = case
    want = [[sum(r[:e + 1]) for e in range(len(r))] for r in piece_sizes(sizes, rank, m)]
    assert piece_offsets(torch.tensor(sizes), rank, m).tolist() == want
