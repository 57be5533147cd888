"""Tier 2: OverlapMLP on 2 and 4 gloo ranks against an independent dense float64 reference.

The reference lives here (plain formulas, one process, float64, torch autograd); the workers run
the layer on their shard and return local outputs and gradients, which are compared with the
reference's matching slices (slicing written out here, not taken from the layer).
"""
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

from overlap_layers import OverlapConfig, OverlapMLP, reduce_replicated_grads
from overlap_layers.layers.mlp.layer import MLPPlan
from pool import RankFailure, all_reduce_ranks, expect_value_error_on_every_rank

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


# ------------------------------------------------------------------ reference
def dense_mlp(x, w_in, w_out, b_in, b_out, activation):
    pre = x @ w_in.T + (b_in if b_in is not None else 0)
    if activation == "swiglu":
        f = w_out.shape[1]
        g, u = pre[..., :f], pre[..., f:]
        h = g * torch.sigmoid(g) * u
    elif activation == "gelu":
        h = 0.5 * pre * (1 + torch.erf(pre / math.sqrt(2)))
    else:
        h = pre.clamp(min=0)
    return h @ w_out.T + (b_out if b_out is not None else 0)


def make_case(seed, B, S, H, F, activation, bias):
    g = torch.Generator().manual_seed(seed)
    n_in = 2 * F if activation == "swiglu" else F
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(x=r(B, S, H), dy=r(B, S, H), w_in=r(n_in, H) / math.sqrt(H), w_out=r(H, F) / math.sqrt(F),
                b_in=r(n_in) if bias else None, b_out=r(H) if bias else None)


def reference(case, activation):
    leaves = {k: (v.clone().requires_grad_() if v is not None else None) for k, v in case.items() if k != "dy"}
    y = dense_mlp(leaves["x"], leaves["w_in"], leaves["w_out"], leaves["b_in"], leaves["b_out"], activation)
    y.backward(case["dy"])
    return y.detach(), {k: (v.grad if v is not None else None) for k, v in leaves.items()}


def shard_in(t, rank, ws, F, activation):
    """Rank's rows of a dense fc1 weight/bias: its gate rows then its up rows for swiglu."""
    fl = F // ws
    if activation == "swiglu":
        return torch.cat([t[rank * fl:(rank + 1) * fl], t[F + rank * fl:F + (rank + 1) * fl]])
    return t[rank * fl:(rank + 1) * fl]


def local_rows(t, rank, ws, sp):
    return t.chunk(ws, dim=1)[rank] if sp else t


# ------------------------------------------------------------------ worker side
def run_layer(rank, ws, case, opts, dtype, plan=None, reduce_bias=False):
    sp = opts.get("sequence_parallel", True)
    cast = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
    layer = OverlapMLP.from_dense(cast(case["w_in"]), cast(case["w_out"]), b_in=cast(case["b_in"]),
                                  b_out=cast(case["b_out"]), group=dist.group.WORLD, **opts)
    if plan is not None:
        layer.pin_plan(plan)
    x = local_rows(case["x"], rank, ws, sp).to(dtype).requires_grad_()
    y = layer(x)
    y.backward(local_rows(case["dy"], rank, ws, sp).to(dtype))
    if reduce_bias:
        reduce_replicated_grads(layer)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return dict(y=y.detach(), dx=x.grad, grads=grads, k=layer.plan.num_tiles if layer.plan else None, dtype=y.dtype)


def check(results, case, opts, dtype):
    activation = opts.get("activation", "swiglu")
    sp = opts.get("sequence_parallel", True)
    ws = len(results)
    F = case["w_out"].shape[1]
    y_ref, g_ref = reference(case, activation)
    tol = TOL[dtype]

    def close(name, got, want):
        got = got.double()
        err = (got - want).norm() / max(want.norm().item(), 1e-30)
        assert err < tol, f"{name}: relative error {err:.3g} > {tol} ({opts}, {dtype})"

    for rank, res in enumerate(results):
        assert res["dtype"] == dtype
        close("y", res["y"], local_rows(y_ref, rank, ws, sp))
        close("dx", res["dx"], local_rows(g_ref["x"], rank, ws, sp))
        close("w_in.grad", res["grads"]["w_in"], shard_in(g_ref["w_in"], rank, ws, F, activation))
        fl = F // ws
        close("w_out.grad", res["grads"]["w_out"], g_ref["w_out"][:, rank * fl:(rank + 1) * fl])
        if case["b_in"] is not None:
            close("b_in.grad", res["grads"]["b_in"], shard_in(g_ref["b_in"], rank, ws, F, activation))
            # complete when backward returns, also under sequence parallelism (summed inside backward)
            close("b_out.grad", res["grads"]["b_out"], g_ref["b_out"])


# ------------------------------------------------------------------ numerics
GRID = [
    # (ws, sp, activation, bias, K, dtype, B, S)
    (2, True, "swiglu", False, 1, torch.float64, 2, 8),
    (2, True, "swiglu", True, 2, torch.float64, 2, 8),
    (2, True, "gelu", True, 3, torch.float64, 1, 10),
    (2, True, "relu", False, 4, torch.float32, 3, 6),
    (2, False, "swiglu", True, 2, torch.float64, 2, 5),
    (2, False, "gelu", False, 3, torch.float32, 1, 7),
    (2, False, "relu", True, 4, torch.float64, 2, 4),
    (2, True, "swiglu", False, 4, torch.float32, 1, 6),  # 6 local rows, K=4: tiles 2,2,1,1
    (4, True, "swiglu", True, 3, torch.float64, 1, 8),
    (4, True, "gelu", False, 2, torch.float32, 2, 4),
    (4, False, "swiglu", False, 4, torch.float64, 1, 5),
    (4, False, "relu", True, 1, torch.float32, 2, 3),
]


@pytest.mark.parametrize("ws,sp,activation,bias,k,dtype,B,S", GRID)
def test_matches_dense_reference(pools, ws, sp, activation, bias, k, dtype, B, S):
    case = make_case(k * 7 + ws, B, S * (ws if sp else 1), 12, 8 * ws, activation, bias)
    opts = dict(sequence_parallel=sp, activation=activation, num_tiles=k)
    results = pools(ws).run(run_layer, case, opts, dtype)
    assert all(r["k"] == min(k, B * S) for r in results)
    check(results, case, opts, dtype)


@pytest.mark.parametrize("ws,sp,k,plan,B,S", [(2, True, 2, None, 0, 8), (2, True, "auto", None, 2, 0),
                                              (4, False, 3, None, 0, 4), (2, True, 1, MLPPlan(1, decomposition="rank"), 0, 8)])
def test_no_tokens_match_dense_reference(pools, ws, sp, k, plan, B, S):
    """No batch rows or no positions, rank chunks pinned too: the reference's empty y and dx,
    and its zero gradients (a missing one fails); no plan runs."""
    case = make_case(45, B, S, 12, 8 * ws, "swiglu", True)
    opts = dict(sequence_parallel=sp, activation="swiglu", num_tiles=k)
    results = pools(ws).run(run_layer, case, opts, torch.float64, plan)
    assert all(r["k"] is None for r in results)
    check(results, case, opts, torch.float64)


@pytest.mark.parametrize("plan", [MLPPlan(3, regather=True),
                                  MLPPlan(4, buckets_fwd=(("ag", ((0, 1), (2, 3))), ("rs", ((0,), (1, 2, 3)))),
                                          buckets_bwd=(("ag_dy", ((0, 1, 2), (3,))), ("rs_dx", ((0, 1), (2, 3))))),
                                  MLPPlan(3, regather=True, num_streams=1,
                                          buckets_bwd=(("ag_x", ((0, 1), (2,))),))])
def test_plans_regather_and_buckets(pool2, plan):
    case = make_case(3, 2, 12, 12, 16, "swiglu", True)
    opts = dict(activation="swiglu")
    check(pool2.run(run_layer, case, opts, torch.float64, plan), case, opts, torch.float64)


RANK_GRID = [
    # (ws, activation, bias, regather, dtype, B, S per rank): rows split by source rank, over NCCL/gloo send/recv
    (2, "swiglu", False, False, torch.float64, 2, 4),
    (2, "gelu", True, True, torch.float64, 1, 5),  # odd rows: own halves of 2 and 3
    (2, "relu", True, False, torch.float32, 1, 1),  # one row: no first half
    (4, "swiglu", True, False, torch.float64, 1, 3),
    (4, "swiglu", False, True, torch.float32, 2, 2),
]


@pytest.mark.parametrize("ws,activation,bias,regather,dtype,B,S", RANK_GRID)
def test_rank_chunks_match_dense_reference(pools, ws, activation, bias, regather, dtype, B, S):
    case = make_case(ws * 11 + S, B, S * ws, 12, 8 * ws, activation, bias)
    opts = dict(activation=activation)
    plan = MLPPlan(1, regather=regather, decomposition="rank")
    check(pools(ws).run(run_layer, case, opts, dtype, plan), case, opts, dtype)


def run_no_grad(rank, ws, case, opts, dtype, plan):
    layer = OverlapMLP.from_dense(*(case[k].to(dtype) for k in ("w_in", "w_out")), b_in=case["b_in"].to(dtype),
                                  b_out=case["b_out"].to(dtype), group=dist.group.WORLD, **opts)
    layer.pin_plan(plan)
    with torch.no_grad():
        return layer(local_rows(case["x"], rank, ws, True).to(dtype))


@pytest.mark.parametrize("ws,activation", [(2, "gelu"), (4, "swiglu")])
def test_rank_chunks_without_grad_match_dense_reference(pools, ws, activation):
    """A no-grad call holds one piece's pre-activation at a time (rank_chunks.forward with
    pre_all=None) and still equals the dense MLP on every rank."""
    case = make_case(ws * 7, 2, 3 * ws, 12, 8 * ws, activation, True)
    y_ref = reference(case, activation)[0]
    plan = MLPPlan(1, decomposition="rank")
    for rank, y in enumerate(pools(ws).run(run_no_grad, case, dict(activation=activation), torch.float64, plan)):
        torch.testing.assert_close(y, local_rows(y_ref, rank, ws, True), rtol=1e-10, atol=1e-10)


def rank_chunk_log(rank, ws, rows):
    layer = OverlapMLP(12, 8 * ws, group=dist.group.WORLD, dtype=torch.float64)
    layer.pin_plan(MLPPlan(1, decomposition="rank"))
    layer.launch_log = []
    x = torch.randn(1, rows, 12, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()
    return layer.launch_log


@pytest.mark.parametrize("ws", [2, 4])
def test_rank_chunks_own_rows_first_and_last(pools, ws):
    """Forward: own first half (step 0), the peers' chunks in step order (step j: rank + j), the
    own second half; backward: own rows whole, then the peers', then the weight gradients over
    every row; alike on every rank (written out here, not derived from the layer's pieces())."""
    peers = [(j, 0, 5) for j in range(1, ws)]
    fwd, bwd = [(0, 0, 2)] + peers + [(0, 2, 5)], [(0, 0, 5)] + peers
    for log in pools(ws).run(rank_chunk_log, 5):
        assert log == [(f"step{j}[{a}:{b}]", "rank_chunk", d) for d, order in (("fwd", fwd), ("bwd", bwd))
                       for j, a, b in order] + [("wgrad[all]", "rank_chunk", "bwd")]


def bad_pin(rank, ws, plan, sp):
    OverlapMLP(12, 8 * ws, group=dist.group.WORLD, sequence_parallel=sp).pin_plan(plan)


@pytest.mark.parametrize("plan,sp,match", [
    (MLPPlan(1, decomposition="rank"), False, "sequence_parallel=True"),
    (MLPPlan(1, decomposition="rows"), True, "decomposition='rows'"),
    (MLPPlan(2, transport="copy_engine"), True, "needs plan.decomposition='rank'"),
    (MLPPlan(1, transport="nvlink", decomposition="rank"), True, "transport='nvlink'"),
    (MLPPlan(2, decomposition="rank"), True, "plan.num_tiles=2"),  # batch tiles of rank chunks: attention only
])
def test_bad_rank_plans(pool2, plan, sp, match):
    expect_value_error_on_every_rank(pool2, bad_pin, plan, sp, match=match)


def copy_engine_fallback(rank, ws, case):
    import warnings
    layer = OverlapMLP.from_dense(case["w_in"], case["w_out"], group=dist.group.WORLD,
                                  config=OverlapConfig(transport="copy_engine"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            x = local_rows(case["x"], rank, ws, True).requires_grad_()
            y = layer(x)
            y.backward(local_rows(case["dy"], rank, ws, True))
    msgs = [str(w.message) for w in caught if "copy-engine" in str(w.message)]
    grads = {n: p.grad / 2 for n, p in layer.named_parameters()}  # two calls accumulated
    return dict(y=y.detach(), dx=x.grad, grads=grads, dtype=y.dtype, msgs=msgs, transport=layer.plan.transport)


def test_copy_engine_config_falls_back_to_nccl_with_one_warning(pool2):
    """On CPU (gloo) the copy engine is unavailable: one warning per layer says why, NCCL/gloo
    plans run, and the numerics are the dense reference's."""
    case = make_case(8, 1, 8, 12, 16, "swiglu", False)
    results = pool2.run(copy_engine_fallback, case)
    for r in results:
        assert len(r["msgs"]) == 1 and "device is cpu" in r["msgs"][0], r["msgs"]
        assert r["transport"] == "nccl"
    check(results, case, dict(), torch.float64)


def pinned_copy_engine_on_cpu(rank, ws):
    import warnings
    layer = OverlapMLP(12, 8 * ws, group=dist.group.WORLD, dtype=torch.float64)
    layer.pin_plan(MLPPlan(1, decomposition="rank", transport="copy_engine"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(1, 4, 12, dtype=torch.float64))
    return layer.plan.label, [str(w.message) for w in caught]


def test_pinned_copy_engine_plan_without_it_runs_and_shows_send_recv(pool2):
    for label, msgs in pool2.run(pinned_copy_engine_on_cpu):
        assert label == "rank chunks over nccl"
        assert len(msgs) == 1 and "copy-engine transport unavailable (the device is cpu" in msgs[0]


def test_no_sp_buckets(pool2):
    plan = MLPPlan(3, buckets_fwd=(("ar", ((0, 1, 2),)),), buckets_bwd=(("ar_dx", ((0,), (1, 2))),))
    case = make_case(4, 1, 9, 12, 16, "gelu", True)
    opts = dict(activation="gelu", sequence_parallel=False)
    check(pool2.run(run_layer, case, opts, torch.float64, plan), case, opts, torch.float64)


def test_b_out_grad_complete_and_finalize_is_a_no_op(pool2):
    """Under sequence parallelism ``b_out``'s gradient is summed over the group inside backward;
    ``reduce_replicated_grads`` (``finalize_grads``) afterwards changes nothing."""
    case = make_case(5, 2, 8, 12, 16, "swiglu", True)
    opts = dict(num_tiles=2)
    check(pool2.run(run_layer, case, opts, torch.float64, None, True), case, opts, torch.float64)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(B=st.integers(1, 3), S=st.integers(1, 5), H=st.integers(1, 9), f_mult=st.integers(1, 3),
       k=st.integers(1, 5), act=st.sampled_from(["swiglu", "gelu", "relu"]), sp=st.booleans(),
       bias=st.booleans())
def test_property_shapes(pool2, B, S, H, f_mult, k, act, sp, bias):
    case = make_case(B * 100 + S, B, S * (2 if sp else 1), H, 2 * f_mult, act, bias)
    opts = dict(sequence_parallel=sp, activation=act, num_tiles=k)
    check(pool2.run(run_layer, case, opts, torch.float64), case, opts, torch.float64)


def autocast_run(rank, ws, case):
    layer = OverlapMLP.from_dense(case["w_in"].float(), case["w_out"].float(), group=dist.group.WORLD,
                                  num_tiles=2)
    x = case["x"].chunk(ws, 1)[rank].float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().backward(case["dy"].chunk(ws, 1)[rank].float())
    return dict(y=y.detach(), dx=x.grad, g=layer.w_in.grad, dtype=y.dtype, gdtype=layer.w_in.grad.dtype)


def test_autocast_bf16_compute_fp32_weights(pool2):
    case = make_case(11, 2, 8, 16, 16, "swiglu", False)
    y_ref, g_ref = reference(case, "swiglu")
    for rank, r in enumerate(pool2.run(autocast_run, case)):
        assert r["dtype"] == torch.bfloat16 and r["gdtype"] == torch.float32
        for got, want in ((r["y"], y_ref.chunk(2, 1)[rank]), (r["dx"], g_ref["x"].chunk(2, 1)[rank]),
                          (r["g"], shard_in(g_ref["w_in"], rank, 2, 16, "swiglu"))):
            err = (got.double() - want).norm() / want.norm()
            assert err < 3e-2, err


# ------------------------------------------------------------------ init, round trip, saving
def init_run(rank, ws, seed, bias, on_meta):
    torch.manual_seed(seed)
    if on_meta:
        layer = OverlapMLP(12, 16, group=dist.group.WORLD, bias=bias, activation="swiglu", device="meta")
        layer.to_empty(device="cpu")
        torch.manual_seed(seed)
        layer.reset_parameters()
    else:
        layer = OverlapMLP(12, 16, group=dist.group.WORLD, bias=bias, activation="swiglu")
    dense = layer.to_dense()
    again = OverlapMLP.from_dense(**dense, group=dist.group.WORLD)
    same = all(torch.equal(a, b) for a, b in zip(layer.parameters(), again.parameters()))
    return dense, same


@pytest.mark.parametrize("on_meta", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_init_matches_nn_linear_and_round_trips(pool2, bias, on_meta):
    torch.manual_seed(123)
    fc1, fc2 = torch.nn.Linear(12, 32, bias=bias), torch.nn.Linear(16, 12, bias=bias)
    for dense, same in pool2.run(init_run, 123, bias, on_meta):
        assert same
        assert torch.equal(dense["w_in"], fc1.weight.detach()) and torch.equal(dense["w_out"], fc2.weight.detach())
        if bias:
            assert torch.equal(dense["b_in"], fc1.bias.detach()) and torch.equal(dense["b_out"], fc2.bias.detach())


def saved_count(rank, ws, grad):
    layer = OverlapMLP(8, 8, group=dist.group.WORLD, num_tiles=2)
    x = torch.randn(2, 4, 8)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
        if grad:
            y = layer(x)
        else:
            with torch.no_grad():
                y = layer(x)
    return len(packed), y.grad_fn is None


def test_no_grad_saves_nothing(pool2):
    assert all(r == (0, True) for r in pool2.run(saved_count, False))
    assert all(r[0] > 0 and not r[1] for r in pool2.run(saved_count, True))


# ------------------------------------------------------------------ launch order
def launch_order(rank, ws, k, sp):
    layer = OverlapMLP(8, 8, group=dist.group.WORLD, num_tiles=k, sequence_parallel=sp)
    layer.launch_log = []
    y = layer(torch.randn(1, 6, 8, requires_grad=True))
    n_fwd = len(layer.launch_log)
    y.sum().backward()
    return [f"{name}[{t}]" for t, name, _ in layer.launch_log[:n_fwd]], \
        [f"{name}[{t}]" for t, name, _ in layer.launch_log[n_fwd:]]


def _rr(k, segs):
    """Segmented round-robin written out: every tile's segment 0, then every tile's segment 1..."""
    return [f"{op}[{t}]" for seg in segs for t in range(k) for op in seg]


@pytest.mark.parametrize("k", [2, 3])
def test_launch_order_is_segmented_round_robin(pool2, k):
    fwd, bwd = pool2.run(launch_order, k, True)[0]
    assert fwd == _rr(k, [["ag"], ["wait_ag", "fc1", "act", "fc2", "rs"], ["wait_rs"]])
    assert bwd == _rr(k, [["ag_dy"], ["wait_ag_dy", "dgrad2", "act_bwd", "dgrad1", "rs_dx", "wgrad2", "wgrad1"],
                          ["wait_rs_dx"]])
    fwd, bwd = pool2.run(launch_order, k, False)[0]
    assert fwd == _rr(k, [["fc1", "act", "fc2", "ar"], ["wait_ar"]])
    assert bwd == _rr(k, [["dgrad2", "act_bwd", "dgrad1", "ar_dx", "wgrad2", "wgrad1"], ["wait_ar_dx"]])


# ------------------------------------------------------------------ bad input
def build(rank, ws, **kw):
    args = dict(hidden_size=8, ffn_hidden_size=8, group=dist.group.WORLD)
    args.update(kw)
    OverlapMLP(**args)


def call_with(rank, ws, make_x, **kw):
    layer = OverlapMLP(8, 8, group=dist.group.WORLD, **kw)
    layer(make_x(rank))


def _x_mismatched_seq(rank):
    return torch.randn(2, 4 + rank, 8)


def _x_2d_on_rank0(rank):
    return torch.randn(8, 8) if rank == 0 else torch.randn(2, 4, 8)


def _x_wrong_hidden(rank):
    return torch.randn(2, 4, 6)


def _x_wrong_dtype(rank):
    return torch.randn(2, 4, 8, dtype=torch.float64)


def _x_wrong_dtype_rank1(rank):
    return torch.randn(2, 4, 8, dtype=torch.float64 if rank == 1 else torch.float32)


def _x_meta(rank):
    return torch.randn(2, 4, 8, device="meta")


def _x_batch_mismatch(rank):
    return torch.randn(1 + rank, 4, 8)


def _x_ok(rank):
    return torch.randn(2, 4, 8)


@pytest.mark.parametrize("kw,match", [
    (dict(ffn_hidden_size=7), "ffn_hidden_size"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(activation="tanh"), "activation"),
    (dict(num_tiles=0), "num_tiles"),
    (dict(num_tiles=2.5), "num_tiles"),
    (dict(num_tiles="many"), "num_tiles"),
    (dict(group=None), "exactly one of group"),
    (dict(config="fast"), "config"),
    (dict(dtype=torch.int64), "dtype=torch.int64"),
    (dict(dtype="float32"), "dtype='float32'"),
])
def test_bad_constructor_arguments(pool2, kw, match):
    expect_value_error_on_every_rank(pool2, _build_kw, kw, match=match)


def _build_kw(rank, ws, kw):
    build(rank, ws, **kw)


def _both_group_and_mesh(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (ws,))
    OverlapMLP(8, 8, group=dist.group.WORLD, mesh=mesh)


def test_both_group_and_mesh(pool2):
    expect_value_error_on_every_rank(pool2, _both_group_and_mesh, match="exactly one")


def _from_dense_bad(rank, ws, which):
    w_in, w_out = torch.randn(16, 8), torch.randn(8, 8)
    if which == "w_in":
        w_in = torch.randn(15, 8)
    elif which == "w_out":
        w_out = torch.randn(8)
    elif which == "b_in":
        return OverlapMLP.from_dense(w_in, w_out, b_in=torch.randn(3), b_out=torch.randn(8), group=dist.group.WORLD)
    OverlapMLP.from_dense(w_in, w_out, group=dist.group.WORLD)


@pytest.mark.parametrize("which", ["w_in", "w_out", "b_in"])
def test_from_dense_bad_shapes(pool2, which):
    expect_value_error_on_every_rank(pool2, _from_dense_bad, which, match=which)


@pytest.mark.parametrize("make_x,match", [
    (_x_mismatched_seq, "seq differs"),
    (_x_batch_mismatch, "batch differs"),
    (_x_2d_on_rank0, "3-D"),
    (_x_wrong_hidden, "hidden"),
    (_x_wrong_dtype, "dtype"),
    (_x_wrong_dtype_rank1, "dtype"),
    (_x_meta, "device"),
])
def test_bad_input_raises_on_every_rank(pool2, make_x, match):
    expect_value_error_on_every_rank(pool2, call_with, make_x, match=match)


def _different_num_tiles(rank, ws):
    call_with(rank, ws, _x_ok, num_tiles=1 + rank)


def test_different_num_tiles_per_rank_raises(pool2):
    expect_value_error_on_every_rank(pool2, _different_num_tiles, match="num_tiles differs: rank 0: 1, rank 1: 2")


def _different_graph_calls(rank, ws):
    call_with(rank, ws, _x_ok, config=OverlapConfig(graph_calls=rank == 0))


def test_different_graph_calls_per_rank_raises(pool2):
    """config.graph_calls decides which calls capture ([Note: graph calls]): it is agreed."""
    expect_value_error_on_every_rank(pool2, _different_graph_calls, match="config.graph_calls differs")


def _graph_calls_off_cuda(rank, ws):
    torch.manual_seed(3)
    layers = [OverlapMLP(8, 8, group=dist.group.WORLD, config=OverlapConfig(graph_calls=g)) for g in (True, False)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).float()
    with torch.no_grad():
        ys = [layer(x) for layer in layers for _ in range(2)]
    return [torch.equal(ys[0], y) for y in ys[1:]], len(layers[0].planner.call_graphs)


def test_graph_calls_off_cuda_run_eagerly(pool2):
    """Off CUDA, config.graph_calls changes nothing: the same outputs as without it, no graph
    (the CUDA tier checks the replays: tests/cuda_worker.py check_graph_calls)."""
    assert pool2.run(_graph_calls_off_cuda) == [([True, True, True], 0)] * 2


def test_pool_survives_errors(pool2):
    assert pool2.run(all_reduce_ranks) == [3, 3]


def copy_engine_agreement(rank, ws, same_host):
    import socket
    import warnings
    from unittest import mock
    import overlap_layers.planning.rank_plans as rank_plans
    host = "node0" if same_host or rank == 0 else "node1"
    with mock.patch.object(rank_plans, "symmetric_memory_status", lambda group, device: ""), \
            mock.patch.object(socket, "gethostname", lambda: host), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = OverlapMLP(12, 8 * ws, group=dist.group.WORLD, config=OverlapConfig(transport="copy_engine"))
        layer.planner.agree(torch.randn(1, 4, 12), 0, {}, "x")
        ok = layer._copy_engine_available()
    return ok, [str(w.message) for w in caught]


@pytest.mark.parametrize("same_host", [True, False])
def test_copy_engine_needs_every_rank_on_one_host(pool2, same_host):
    """Availability is agreed in the call's agreement: usable on every rank of one host, else
    one warning naming why (here with the symmetric-memory check forced to pass on CPU)."""
    for ok, msgs in pool2.run(copy_engine_agreement, same_host):
        assert ok == same_host
        assert msgs == ([] if same_host else [
            "overlap_layers: copy-engine transport unavailable (the group spans several hosts); using NCCL"])


def held_workspaces(rank, ws, held, capturing):
    """One agreement of an MLP whose ranks hold ``held[rank]`` symmetric bytes (faked on CPU);
    returns how many times this rank released its workspace."""
    from unittest import mock
    import overlap_layers.planning.call_agreement as call_agreement
    import overlap_layers.planning.rank_plans as rank_plans
    released = []

    class Workspace:
        def release(self):
            released.append(rank)
    with mock.patch.object(rank_plans, "held_workspace_bytes", lambda group, device, purpose: held[rank]), \
            mock.patch.object(rank_plans, "shared_workspace", lambda group, device, purpose: Workspace()), \
            mock.patch.object(call_agreement, "capturing_graph", lambda x: capturing):
        layer = OverlapMLP(12, 8 * ws, group=dist.group.WORLD)
        layer.planner.agree(torch.randn(1, 4, 12), 0, {}, "x")
        layer.warmup([(1, 4)])
    return len(released)


def test_ranks_holding_different_workspaces_release_them_together(pool2):
    """The workspace bytes each rank holds are agreed; when they differ every rank releases its
    workspace (a collective) at the call and at warm-up, and never when they are equal."""
    assert pool2.run(held_workspaces, (0, 1 << 20), False) == [2, 2]
    assert pool2.run(held_workspaces, (1 << 20, 1 << 20), False) == [0, 0]
    with pytest.raises(RankFailure) as info:
        pool2.run(held_workspaces, (0, 1 << 20), True, timeout=60)
    assert all(e is not None and e[0] == "RuntimeError" and "different symmetric workspaces" in e[1]
               for e in info.value.errors())
