"""Tier 2: OverlapAttention on 2 and 4 gloo ranks against the independent dense float64 reference.

The reference is ``tests/attention_reference.py`` (one process, explicit softmax, float64, torch
autograd) on the full sequence; the workers run the layer on their shard and return local outputs,
parameters and gradients. The slicing of the dense tensors to a rank's shard is written out here
from the spec (query heads ``r*nq/ws ..``, query head h reads KV head ``h // (nq/nkv)``, KV heads
replicated when nkv < ws), not taken from the layer. Gradients of parameters replicated across
ranks (``bo``, ``q_norm``, ``k_norm``, replicated KV heads) are complete on every rank when
backward returns (the layer sums its ranks' partials inside backward).
"""
import math

import pytest
import torch
import torch.distributed as dist

import overlap_layers
from attention_reference import bad_call_input, dense_attention
from overlap_layers import reduce_replicated_grads
from overlap_layers.layers.attention.layer import OverlapAttention
from overlap_layers.layers.mlp.layer import MLPPlan
from pool import assert_dense_round_trip, all_reduce_ranks, expect_value_error_on_every_rank

TOL = {torch.float64: 1e-10, torch.float32: 5e-5}


# ------------------------------------------------------------------ cases and the reference
def make_case(seed, *, B, S, H, nq, nkv, d, bias=False, qk_norm=False, pos="default"):
    """Dense weights in nn.Linear layouts, x / dy over the full sequence, optional positions."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    case = dict(nq=nq, nkv=nkv, d=d, x=r(B, S, H), dy=r(B, S, H),
                wq=r(nq * d, H) / math.sqrt(H), wk=r(nkv * d, H) / math.sqrt(H),
                wv=r(nkv * d, H) / math.sqrt(H), wo=r(H, nq * d) / math.sqrt(nq * d),
                bq=None, bk=None, bv=None, bo=None, q_norm=None, k_norm=None,
                position_ids=None, position_embeddings=None)
    if bias:
        case.update(bq=r(nq * d), bk=r(nkv * d), bv=r(nkv * d), bo=r(H))
    if qk_norm:
        case.update(q_norm=1 + 0.3 * r(d), k_norm=1 + 0.3 * r(d))
    if pos == "ids":  # a random permutation of the global positions per batch row
        case["position_ids"] = torch.stack([torch.randperm(S, generator=g) for _ in range(B)])
    elif pos == "emb":  # arbitrary tables: the formula is linear in cos and sin
        case["position_embeddings"] = (r(B, S, d), r(B, S, d))
    return case


PARAMS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm")


def reference(case, opts):
    leaves = {k: (case[k].clone().requires_grad_() if case[k] is not None else None) for k in ("x",) + PARAMS}
    y = dense_attention(leaves["x"], *(leaves[k] for k in ("wq", "wk", "wv", "wo")),
                        num_heads=case["nq"], num_kv_heads=case["nkv"],
                        **{k: leaves[k] for k in PARAMS[4:]},
                        rope_theta=opts.get("rope_theta", 10000.0), position_ids=case["position_ids"],
                        position_embeddings=case["position_embeddings"], causal=opts.get("causal", True),
                        softmax_scale=opts.get("softmax_scale"))
    y.backward(case["dy"])
    return y.detach(), {k: (v.grad if v is not None else None) for k, v in leaves.items()}


def local_seq(t, rank, ws, sp):
    return t.chunk(ws, dim=1)[rank] if sp else t


def q_heads(rank, ws, nq):
    nl = nq // ws
    return range(rank * nl, (rank + 1) * nl)


def kv_heads(rank, ws, nkv):
    """The KV heads rank holds: its share when nkv >= ws, else the one head its query heads read."""
    if nkv >= ws:
        nl = nkv // ws
        return range(rank * nl, (rank + 1) * nl)
    return range(rank * nkv // ws, rank * nkv // ws + 1)


def rows_of(t, heads, d):
    return t[heads.start * d:heads.stop * d]


# ------------------------------------------------------------------ worker side
def build_from_dense(case, dtype, opts):
    cast = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
    return OverlapAttention.from_dense(*(cast(case[k]) for k in ("wq", "wk", "wv", "wo")),
                                       num_heads=case["nq"], num_kv_heads=case["nkv"],
                                       **{k: cast(case[k]) for k in PARAMS[4:]},
                                       group=dist.group.WORLD, **opts)


def forward_kwargs(case, dtype):
    kw = {}
    if case["position_ids"] is not None:
        kw["position_ids"] = case["position_ids"]
    if case["position_embeddings"] is not None:
        kw["position_embeddings"] = tuple(t.to(dtype) for t in case["position_embeddings"])
    return kw


def run_layer(rank, ws, case, opts, dtype, calls=1, plan=None, reduce=False):
    sp = opts.get("sequence_parallel", True)
    layer = build_from_dense(case, dtype, opts)
    if plan is not None:
        layer.pin_plan(plan)
    params = {n: p.detach().clone() for n, p in layer.named_parameters()}
    out = []
    for _ in range(calls):  # several calls: "auto" cycles through contenders while verifying
        layer.zero_grad(set_to_none=True)
        x = local_seq(case["x"], rank, ws, sp).to(dtype).requires_grad_()
        y = layer(x, **forward_kwargs(case, dtype))
        y.backward(local_seq(case["dy"], rank, ws, sp).to(dtype))
        if reduce:
            reduce_replicated_grads(layer)
        out.append(dict(y=y.detach(), dx=x.grad, grads={n: p.grad for n, p in layer.named_parameters()},
                        k=layer.plan.num_tiles, decomposition=layer.plan.decomposition, dtype=y.dtype))
    return dict(params=params, calls=out)


# ------------------------------------------------------------------ checks in the test process
def check(results, case, opts, dtype, call=0):
    """Every rank's output, input gradient and parameter gradients against the reference: complete
    when backward returns (the tensor-parallel partials are summed inside backward)."""
    sp = opts.get("sequence_parallel", True)
    ws, nq, nkv, d = len(results), case["nq"], case["nkv"], case["d"]
    y_ref, g_ref = reference(case, opts)
    tol = TOL[dtype]
    H = case["x"].shape[-1]

    def close(name, got, want):
        assert got is not None, f"{name} is None ({opts})"
        assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        got = got.double()
        err = (got - want).norm() / max(want.norm().item(), 1e-30)
        assert err < tol, f"{name}: relative error {err:.3g} > {tol} ({opts}, {dtype})"

    calls = [res["calls"][call] for res in results]
    # Parameters: shapes and values of this rank's shard.
    for rank, res in enumerate(results):
        p, qh, kh = res["params"], q_heads(rank, ws, nq), kv_heads(rank, ws, nkv)
        assert set(p) == {k for k in PARAMS if case[k] is not None}, sorted(p)
        assert tuple(p["wq"].shape) == (nq // ws * d, H)
        assert tuple(p["wk"].shape) == tuple(p["wv"].shape) == (max(nkv // ws, 1) * d, H)
        assert tuple(p["wo"].shape) == (H, nq // ws * d)
        want = dict(wq=rows_of(case["wq"], qh, d), wk=rows_of(case["wk"], kh, d), wv=rows_of(case["wv"], kh, d),
                    wo=rows_of(case["wo"].t(), qh, d).t(), bo=case["bo"], q_norm=case["q_norm"],
                    k_norm=case["k_norm"])
        if case["bq"] is not None:
            want.update(bq=rows_of(case["bq"], qh, d), bk=rows_of(case["bk"], kh, d), bv=rows_of(case["bv"], kh, d))
        for n, w in want.items():
            if w is not None:
                assert torch.equal(p[n].double(), w.to(p[n].dtype).double()), f"param {n} on rank {rank}"

    # Output, dx, and the sharded weight gradients.
    for rank, c in enumerate(calls):
        assert c["dtype"] == dtype
        assert c["k"] == min(opts["num_tiles"], case["x"].shape[0]) if isinstance(opts.get("num_tiles"), int) \
            else 1 <= c["k"] <= case["x"].shape[0], c["k"]
        qh, kh = q_heads(rank, ws, nq), kv_heads(rank, ws, nkv)
        close(f"y[{rank}]", c["y"], local_seq(y_ref, rank, ws, sp))
        close(f"dx[{rank}]", c["dx"], local_seq(g_ref["x"], rank, ws, sp))
        close(f"wq.grad[{rank}]", c["grads"]["wq"], rows_of(g_ref["wq"], qh, d))
        close(f"wo.grad[{rank}]", c["grads"]["wo"], rows_of(g_ref["wo"].t(), qh, d).t())
        if case["bq"] is not None:
            close(f"bq.grad[{rank}]", c["grads"]["bq"], rows_of(g_ref["bq"], qh, d))

    # KV heads (replicated over ws / nkv ranks when nkv < ws), q_norm, k_norm and bo (sequence
    # parallel): summed inside backward, so every rank holds its head's / the whole gradient.
    for name in ("wk", "wv", "bk", "bv"):
        if case[name] is None:
            continue
        for rank, c in enumerate(calls):
            kh = kv_heads(rank, ws, nkv)
            close(f"{name}.grad[{rank}] (heads {list(kh)})", c["grads"][name], rows_of(g_ref[name], kh, d))
    for name in ("q_norm", "k_norm", "bo"):
        if case[name] is None:
            continue
        for rank, c in enumerate(calls):
            close(f"{name}.grad[{rank}] (complete)", c["grads"][name], g_ref[name])


# ------------------------------------------------------------------ numerics
GRID = [
    # ws, sp, K, B, S(global), H, nq, nkv, d, rope, causal, bias, qk_norm, pos, dtype
    (2, True, 1, 2, 8, 16, 4, 4, 4, True, True, False, False, "default", torch.float64),   # MHA
    (2, True, 2, 3, 8, 16, 4, 2, 4, True, True, True, False, "ids", torch.float64),        # uneven 2+1
    (2, False, 3, 3, 6, 12, 2, 1, 6, True, False, False, True, "default", torch.float64),  # nkv=1 < ws
    (2, True, 4, 4, 4, 16, 4, 4, 4, False, True, True, True, "default", torch.float32),
    (2, False, 2, 2, 5, 8, 2, 2, 4, True, True, False, False, "emb", torch.float64),
    (2, True, 2, 2, 6, 12, 4, 1, 4, True, True, True, True, "ids", torch.float64),      # d != H/nq
    (4, True, 1, 1, 8, 16, 4, 1, 4, True, True, False, False, "default", torch.float64),   # 1 KV head, ws=4
    (4, True, 2, 3, 8, 16, 4, 2, 4, True, False, True, True, "ids", torch.float64),     # 2 KV heads, ws=4
    (4, False, 3, 3, 5, 16, 8, 8, 2, False, True, False, False, "default", torch.float64),
    (4, True, 4, 2, 8, 16, 8, 4, 4, True, True, True, False, "emb", torch.float32),
    (4, False, 2, 2, 4, 16, 4, 2, 4, True, True, True, True, "emb", torch.float64),
    (4, True, 3, 4, 4, 8, 4, 4, 2, True, True, False, True, "default", torch.float64),     # tiles 2,1,1
]


@pytest.mark.parametrize("ws,sp,k,B,S,H,nq,nkv,d,rope,causal,bias,qk_norm,pos,dtype", GRID)
def test_matches_dense_reference(pools, ws, sp, k, B, S, H, nq, nkv, d, rope, causal, bias, qk_norm, pos,
                                 dtype):
    case = make_case(ws * 100 + k * 10 + B, B=B, S=S, H=H, nq=nq, nkv=nkv, d=d, bias=bias, qk_norm=qk_norm,
                     pos=pos)
    opts = dict(sequence_parallel=sp, num_tiles=k, causal=causal, rope_theta=10000.0 if rope else None)
    check(pools(ws).run(run_layer, case, opts, dtype), case, opts, dtype)


def test_softmax_scale_and_rope_theta(pool2):
    case = make_case(7, B=2, S=8, H=16, nq=4, nkv=2, d=4, pos="ids")
    opts = dict(num_tiles=2, softmax_scale=0.3, rope_theta=100.0)
    check(pool2.run(run_layer, case, opts, torch.float64), case, opts, torch.float64)


def test_position_embeddings_override_rope_theta(pool2):
    """With position_embeddings given, rope_theta (and position_ids) play no part."""
    case = make_case(8, B=2, S=6, H=8, nq=2, nkv=2, d=4, pos="emb")
    opts = dict(num_tiles=2, rope_theta=500.0)
    res = pool2.run(run_layer, case, opts, torch.float64)
    check(res, case, opts, torch.float64)


def test_auto_num_tiles(pool2):
    """num_tiles="auto": every call (verification cycles plans) matches, and plan.num_tiles is a K."""
    case = make_case(9, B=4, S=8, H=16, nq=4, nkv=2, d=4, bias=True)
    opts = dict(num_tiles="auto")
    res = pool2.run(run_layer, case, opts, torch.float64, 3)
    for call in range(3):
        check(res, case, opts, torch.float64, call)


@pytest.mark.parametrize("ws,sp,nkv", [(2, True, 1), (4, True, 2), (4, False, 1), (2, True, 2)])
def test_partials_complete_and_finalize_is_a_no_op(pools, ws, sp, nkv):
    """bo (SP), q_norm, k_norm and replicated KV heads are complete when backward returns, and
    reduce_replicated_grads (finalize_grads) afterwards changes nothing."""
    case = make_case(21 + ws + nkv, B=2, S=8, H=16, nq=4, nkv=nkv, d=4, bias=True, qk_norm=True, pos="ids")
    opts = dict(num_tiles=2, sequence_parallel=sp)
    res = pools(ws).run(run_layer, case, opts, torch.float64, 1, None, True)
    check(res, case, opts, torch.float64)


@pytest.mark.parametrize("plan", [MLPPlan(3, regather=True),
                                  MLPPlan(4, buckets_fwd=(("ag", ((0, 1), (2, 3))), ("rs", ((0,), (1, 2, 3)))),
                                          buckets_bwd=(("ag_dy", ((0, 1, 2), (3,))), ("rs_dx", ((0, 1), (2, 3))))),
                                  MLPPlan(3, regather=True, num_streams=1, buckets_bwd=(("ag_x", ((0, 1), (2,))),)),
                                  MLPPlan(8)])  # capped to the batch: K=4
def test_pinned_plans(pool2, plan):
    case = make_case(31, B=4, S=6, H=16, nq=4, nkv=2, d=4, bias=True, qk_norm=True, pos="ids")
    opts = dict()
    res = pool2.run(run_layer, case, opts, torch.float64, 1, plan)
    assert all(r["calls"][0]["k"] == min(plan.num_tiles, 4) for r in res)
    check(res, case, dict(opts, num_tiles=plan.num_tiles), torch.float64)


RANK_GRID = [
    # ws, regather, K, B, S(global), H, nq, nkv, d, rope, causal, bias, qk_norm, pos, dtype
    (2, False, 1, 2, 8, 16, 4, 2, 4, True, True, True, True, "ids", torch.float64),
    (2, True, 1, 1, 6, 12, 4, 1, 4, True, True, False, False, "default", torch.float64),   # nkv < ws
    (2, False, 1, 3, 4, 16, 4, 4, 4, True, False, True, False, "emb", torch.float32),     # all rows at once
    (4, True, 1, 2, 8, 16, 8, 2, 2, True, True, True, True, "ids", torch.float64),
    (4, False, 1, 1, 8, 16, 4, 1, 4, True, True, False, True, "default", torch.float64),
    (2, False, 2, 3, 8, 16, 4, 2, 4, True, True, True, True, "ids", torch.float64),       # tiles of 2 and 1
    (4, True, 2, 2, 8, 16, 8, 4, 2, True, False, False, True, "emb", torch.float64),
    (4, False, 4, 4, 4, 8, 4, 4, 2, True, True, True, False, "default", torch.float32),  # MHA, 1 row per chunk
    (2, True, 3, 3, 4, 8, 2, 1, 4, True, False, True, False, "default", torch.float64),
    (2, False, 4, 2, 8, 16, 4, 2, 4, True, True, True, False, "ids", torch.float64),     # K=4 capped to the batch
    # no RoPE (no k bias: without RoPE or qk-norm a k bias shifts a query's scores alike, its gradient is 0)
    (2, False, 1, 2, 8, 16, 4, 2, 4, False, True, False, False, "default", torch.float64),
    (4, True, 2, 2, 8, 16, 8, 2, 2, False, False, False, False, "ids", torch.float32),
]


@pytest.mark.parametrize("ws,regather,k,B,S,H,nq,nkv,d,rope,causal,bias,qk_norm,pos,dtype", RANK_GRID)
def test_rank_chunks_match_dense_reference(pools, ws, regather, k, B, S, H, nq, nkv, d, rope, causal, bias, qk_norm,
                                           pos, dtype):
    """Split by source rank inside K batch tiles (over send/recv on gloo): forward, dx and every
    gradient, two calls."""
    case = make_case(ws * 31 + B * 7 + S + k, B=B, S=S, H=H, nq=nq, nkv=nkv, d=d, bias=bias, qk_norm=qk_norm,
                     pos=pos)
    opts = dict(causal=causal, rope_theta=10000.0 if rope else None)
    res = pools(ws).run(run_layer, case, opts, dtype, 2, MLPPlan(k, regather=regather, decomposition="rank"))
    for call in range(2):
        assert [(c["k"], c["decomposition"]) for r in res for c in [r["calls"][call]]] == [(min(k, B), "rank")] * ws
        check(res, case, opts, dtype, call)


def _run_diagonal_first(rank, ws, first, *args):
    """:func:`run_layer` with the layer's choice of diagonal pieces first forced to ``first``."""
    from overlap_layers import OverlapAttention
    chosen = OverlapAttention._diagonal_first
    OverlapAttention._diagonal_first = lambda self, *a: first
    try:
        return run_layer(rank, ws, *args)
    finally:
        OverlapAttention._diagonal_first = chosen


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("ws,k,B", [(2, 1, 2), (4, 2, 2)])
def test_rank_chunks_diagonal_pieces_first_or_last(pools, first, ws, k, B):
    """[Note: query-chunk core]: the causal query-chunk forward (no qk-norm) equals the dense layer
    whether each chunk's diagonal piece runs in its QKV piece or with its projection (the cost
    model's choice, AttentionCostModel.diagonal_first), forward, dx and every gradient."""
    case = make_case(ws * 13 + k, B=B, S=8, H=16, nq=4, nkv=2, d=4, bias=True, qk_norm=False, pos="ids")
    opts = dict(causal=True, rope_theta=10000.0)
    res = pools(ws).run(_run_diagonal_first, first, case, opts, torch.float64, 1, MLPPlan(k, decomposition="rank"))
    check(res, case, opts, torch.float64)


def _rank_log(rank, ws, k):
    from overlap_layers import OverlapAttention
    layer = OverlapAttention(16, 4 * ws // 2 if ws > 2 else 4, group=dist.group.WORLD, dtype=torch.float64)
    layer.pin_plan(MLPPlan(k, decomposition="rank"))
    layer.launch_log = []
    layer(torch.randn(2, 4, 16, dtype=torch.float64, requires_grad=True)).sum().backward()
    return layer.launch_log


@pytest.mark.parametrize("ws,k", [(2, 1), (4, 1), (4, 2)])
def test_rank_chunks_launch_order(pools, ws, k):
    """Per batch tile: own rows' projection first, then the peers' in step order; the output
    projection of the peers first and the own rows last; backward with one tile, then the QKV
    weight gradient over every row; alike on every rank (written out here)."""
    peers = list(range(1, ws))
    out = []
    for fwd in (True, False):
        first, last = ("qkv", "proj") if fwd else ("dgrad_o", "dgrad_qkv")
        for i in range(k):
            name = (lambda j: f"step{j}") if k == 1 else (lambda j, i=i: f"tile{i}.step{j}")
            d = "fwd" if fwd else "bwd"
            out += [(name(j), first, d) for j in [0] + peers] + [(name(j), last, d) for j in peers + [0]]
            if k == 1 and not fwd:
                out.append(("all", "wgrad_qkv", "bwd"))
    assert pools(ws).run(_rank_log, k) == [out] * ws


def _tiled_log(rank, ws):
    from overlap_layers import OverlapAttention
    layer = OverlapAttention(16, 4, group=dist.group.WORLD, dtype=torch.float64, num_tiles=2)
    layer.launch_log = []
    layer(torch.randn(2, 4, 16, dtype=torch.float64, requires_grad=True)).sum().backward()
    planned = OverlapAttention(16, 4, group=dist.group.WORLD, dtype=torch.float64)
    planned(torch.randn(2, 4, 16, dtype=torch.float64))
    return [(t, name) for t, name, kind in layer.launch_log if kind == "compute"], planned.plan.num_streams


def test_tiled_backward_runs_weight_gradients_last(pool2):
    """[Note: attention weight gradients last]: the backward launches every tile's data gradients
    (and dx reduce-scatter) before any tile's weight gradients; the planner's plans run on one stream."""
    for log, streams in pool2.run(_tiled_log):
        bwd = log[log.index((0, "dgrad_o")):]
        assert bwd == [(0, "dgrad_o"), (0, "core_bwd"), (0, "dgrad_qkv"), (1, "dgrad_o"), (1, "core_bwd"),
                       (1, "dgrad_qkv"), (0, "wgrad_o"), (0, "wgrad_qkv"), (1, "wgrad_o"), (1, "wgrad_qkv")], bwd
        assert streams == 1


def _no_grad_run(rank, ws, case, sp):
    layer = build_from_dense(case, torch.float64, dict(num_tiles=2, sequence_parallel=sp))
    x = local_seq(case["x"], rank, ws, sp)
    with torch.no_grad():
        y = layer(x, **forward_kwargs(case, torch.float64))
    return y, y.grad_fn is None


@pytest.mark.parametrize("sp", [True, False])
def test_no_grad_forward(pool2, sp):
    case = make_case(41, B=3, S=8, H=16, nq=4, nkv=2, d=4, bias=True, qk_norm=True)
    y_ref, _ = reference(case, {})
    for rank, (y, no_graph) in enumerate(pool2.run(_no_grad_run, case, sp)):
        assert no_graph
        err = (y - local_seq(y_ref, rank, 2, sp)).norm() / y_ref.norm()
        assert err < TOL[torch.float64], err


def _empty_then_full(rank, ws, case, empty, opts):
    """A call of ``empty`` (no batch rows or no positions) then one of ``case``, same layer."""
    sp = opts.get("sequence_parallel", True)
    layer = build_from_dense(case, torch.float64, opts)
    params = {n: p.detach().clone() for n, p in layer.named_parameters()}
    calls = []
    for c in (empty, case):
        layer.zero_grad(set_to_none=True)
        x = local_seq(c["x"], rank, ws, sp).requires_grad_()
        y = layer(x, **forward_kwargs(c, torch.float64))
        y.backward(local_seq(c["dy"], rank, ws, sp))
        calls.append(dict(y=y.detach(), dx=x.grad, grads={n: p.grad for n, p in layer.named_parameters()},
                          k=layer.plan.num_tiles if layer.plan else None, dtype=y.dtype))
    return dict(params=params, calls=calls)


@pytest.mark.parametrize("ws,sp,empty_dim", [(2, True, 0), (2, True, 1), (2, False, 1), (4, True, 0)])
def test_empty_batch_or_sequence_matches_dense_reference(pools, ws, sp, empty_dim):
    """No batch rows or no positions: the dense reference's empty output, an empty dx and zero
    (not missing) parameter gradients on every rank; the next call of a real shape is unaffected."""
    case = make_case(43, B=2, S=8, H=16, nq=4, nkv=2, d=4, bias=True, qk_norm=True)
    empty = dict(case, x=case["x"].narrow(empty_dim, 0, 0), dy=case["dy"].narrow(empty_dim, 0, 0))
    opts = dict(sequence_parallel=sp, num_tiles=2)
    y_ref, g_ref = reference(empty, opts)
    results = pools(ws).run(_empty_then_full, case, empty, opts)
    for rank, res in enumerate(results):
        c = res["calls"][0]
        assert c["dtype"] == torch.float64
        assert tuple(c["y"].shape) == tuple(local_seq(y_ref, rank, ws, sp).shape) and c["y"].numel() == 0
        assert tuple(c["dx"].shape) == tuple(local_seq(g_ref["x"], rank, ws, sp).shape)
        assert c["k"] is None  # no plan ran
        for name, grad in c["grads"].items():
            assert grad is not None and torch.equal(grad, torch.zeros_like(res["params"][name])), name
    assert all(torch.equal(g_ref[n], torch.zeros_like(g_ref[n])) for n in PARAMS if g_ref[n] is not None)
    check(results, case, opts, torch.float64, call=1)


def test_exported_from_package():
    assert overlap_layers.OverlapAttention is OverlapAttention
    assert "OverlapAttention" in overlap_layers.__all__


# ------------------------------------------------------------------ round trip and init
def round_trip(rank, ws, case):
    layer = build_from_dense(case, torch.float64, {})
    dense = layer.to_dense()
    again = OverlapAttention.from_dense(**dense, num_heads=case["nq"], num_kv_heads=case["nkv"],
                                        group=dist.group.WORLD)
    same = {n: torch.equal(p, q) for (n, p), (_, q) in zip(layer.named_parameters(), again.named_parameters())}
    return dense, same


@pytest.mark.parametrize("ws,nq,nkv,bias,qk_norm", [(2, 4, 2, True, True), (2, 2, 1, False, False),
                                                      (4, 4, 1, True, False), (4, 8, 8, False, True)])
def test_from_dense_to_dense_round_trip(pools, ws, nq, nkv, bias, qk_norm):
    case = make_case(11 + nq, B=1, S=4, H=12, nq=nq, nkv=nkv, d=4, bias=bias, qk_norm=qk_norm)
    for dense, same in pools(ws).run(round_trip, case):
        assert_dense_round_trip(dense, same, case, PARAMS)


def _init_run(rank, ws, seed, kw):
    return _init_run2(rank, ws, seed, 2, kw, False)


@pytest.mark.parametrize("ws,nkv", [(2, 2), (4, 1)])
@pytest.mark.parametrize("on_meta", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_init_matches_nn_linear(pools, ws, nkv, bias, on_meta):
    """reset_parameters documents: as nn.Linear q, k, v, o (weight then bias each) under the same
    seed, norms to ones."""
    H, nq, d = 16, 4, 4
    torch.manual_seed(123)
    lin = [torch.nn.Linear(H, nq * d, bias=bias), torch.nn.Linear(H, nkv * d, bias=bias),
           torch.nn.Linear(H, nkv * d, bias=bias), torch.nn.Linear(nq * d, H, bias=bias)]
    for dense in pools(ws).run(_init_run2, 123, nkv, dict(bias=bias, qk_norm=True), on_meta):
        for name, l in zip("qkvo", lin):
            assert torch.equal(dense["w" + name], l.weight.detach()), "w" + name
            if bias:
                assert torch.equal(dense["b" + name], l.bias.detach()), "b" + name
            else:
                assert dense["b" + name] is None
        assert torch.equal(dense["q_norm"], torch.ones(d)) and torch.equal(dense["k_norm"], torch.ones(d))


def _init_run2(rank, ws, seed, nkv, kw, on_meta):
    torch.manual_seed(seed)
    if on_meta:
        layer = OverlapAttention(16, 4, nkv, group=dist.group.WORLD, device="meta", **kw)
        layer.to_empty(device="cpu")
        torch.manual_seed(seed)
        layer.reset_parameters()
    else:
        layer = OverlapAttention(16, 4, nkv, group=dist.group.WORLD, **kw)
    return layer.to_dense()


def test_constructor_shapes_and_round_trip(pool2):
    for dense in pool2.run(_init_run, 5, dict(bias=True, qk_norm=True)):
        assert tuple(dense["wq"].shape) == (16, 16) and tuple(dense["wk"].shape) == (8, 16)
        assert tuple(dense["wv"].shape) == (8, 16) and tuple(dense["wo"].shape) == (16, 16)
        assert tuple(dense["bq"].shape) == (16,) and tuple(dense["bo"].shape) == (16,)
        assert tuple(dense["q_norm"].shape) == (4,) and tuple(dense["k_norm"].shape) == (4,)
    a, b = pool2.run(_init_run, 5, {})
    assert all(torch.equal(a[n], b[n]) for n in ("wq", "wk", "wv", "wo")), "ranks disagree on the dense weights"
    assert a["bq"] is None and a["q_norm"] is None


# ------------------------------------------------------------------ bad input
def _build_kw(rank, ws, kw):
    args = dict(hidden_size=16, num_heads=4, group=dist.group.WORLD)
    args.update(kw)
    OverlapAttention(**args)


@pytest.mark.parametrize("ws,kw,match", [
    (2, dict(num_heads=3, hidden_size=12), "num_heads"),                      # nq % ws
    (2, dict(num_heads=6, num_kv_heads=3, hidden_size=12), "num_kv_heads"),   # neither nkv % ws nor ws % nkv
    (2, dict(num_heads=6, num_kv_heads=4, hidden_size=12), "num_kv_heads"),   # nq % nkv
    (4, dict(num_heads=12, num_kv_heads=6, hidden_size=24), "num_kv_heads"),
    (4, dict(num_heads=2, hidden_size=16), "num_heads"),
    (2, dict(num_tiles=0), "num_tiles"),
    (2, dict(num_tiles="many"), "num_tiles"),
    (2, dict(group=None), "exactly one of group"),
    (2, dict(config="fast"), "config"),
    (2, dict(head_dim=3), "head_dim"),                                        # RoPE needs an even head_dim
    (2, dict(rope_theta=float("nan")), "rope_theta=nan"),                      # NaN passes a "<= 0" test
    (2, dict(rope_theta=float("inf")), "rope_theta=inf"),
    (2, dict(softmax_scale=float("inf")), "softmax_scale=inf"),
    (2, dict(dtype=torch.int32), "dtype=torch.int32"),
])
def test_bad_constructor_arguments(pools, ws, kw, match):
    expect_value_error_on_every_rank(pools(ws), _build_kw, kw, match=match)


def _from_dense_bad(rank, ws, which):
    H, nq, nkv, d = 16, 4, 2, 4
    t = dict(wq=torch.randn(nq * d, H), wk=torch.randn(nkv * d, H), wv=torch.randn(nkv * d, H),
             wo=torch.randn(H, nq * d))
    kw = {}
    if which == "wq":
        t["wq"] = torch.randn(nq * d + 1, H)
    elif which == "wk":
        t["wk"] = torch.randn(nkv * d + d, H)
    elif which == "wv":
        t["wv"] = torch.randn(nkv * d, H + 1)
    elif which == "wo":
        t["wo"] = torch.randn(H, nq * d - 1)
    elif which == "q_norm":
        kw = dict(q_norm=torch.ones(d + 1), k_norm=torch.ones(d))
    elif which == "bq":
        kw = dict(bq=torch.randn(3), bk=torch.randn(nkv * d), bv=torch.randn(nkv * d), bo=torch.randn(H))
    OverlapAttention.from_dense(t["wq"], t["wk"], t["wv"], t["wo"], num_heads=nq, num_kv_heads=nkv,
                                group=dist.group.WORLD, **kw)


@pytest.mark.parametrize("which", ["wq", "wk", "wv", "wo", "q_norm", "bq"])
def test_from_dense_bad_shapes(pool2, which):
    expect_value_error_on_every_rank(pool2, _from_dense_bad, which, match=which)


def _call_with(rank, ws, name, sp=True):
    layer = OverlapAttention(8, 2, group=dist.group.WORLD, num_tiles=2, sequence_parallel=sp)
    x, kw = bad_call_input(rank, ws, name)
    layer(x, **kw)


@pytest.mark.parametrize("name,match", [
    ("seq", "seq"),
    ("batch", "batch"),
    ("rank0_2d", "3-D"),
    ("rank0_none", "3-D"),
    ("hidden", "hidden"),
    ("dtype", "dtype"),
    ("dtype_rank1", "dtype"),
    ("device", "device"),
    ("attention_mask", "attention_mask"),
    ("attention_mask_rank1", "attention_mask"),
    ("position_ids", "position_ids must"),
    ("position_embeddings", "position_embeddings must"),
    ("position_embeddings_grad_rank1", "must not require grad"),
])
def test_bad_input_raises_on_every_rank(pool2, name, match):
    expect_value_error_on_every_rank(pool2, _call_with, name, match=match)


def test_bad_input_without_sp_raises_on_every_rank(pool2):
    expect_value_error_on_every_rank(pool2, _call_with, "seq", False, match="seq")


def _different_num_tiles(rank, ws):
    layer = OverlapAttention(8, 2, group=dist.group.WORLD, num_tiles=1 + rank)
    layer(torch.randn(2, 4, 8))


def test_different_num_tiles_per_rank_raises(pool2):
    expect_value_error_on_every_rank(pool2, _different_num_tiles, match="num_tiles differs")


def _bad_pin(rank, ws, plan):
    OverlapAttention(8, 2, group=dist.group.WORLD).pin_plan(plan)


@pytest.mark.parametrize("plan,match", [(MLPPlan(0), "num_tiles"), (MLPPlan(2, num_streams=0), "num_streams"),
                                        ("K=2", "plan")])
def test_pin_plan_rejects_bad_plans(pool2, plan, match):
    expect_value_error_on_every_rank(pool2, _bad_pin, plan, match=match)


def test_pool_survives_errors(pool2):
    assert pool2.run(all_reduce_ranks) == [3, 3]


def causal_mask_run(rank, ws):
    """A mask equal to the causal one (boolean, additive float, 2-D without padding) is accepted
    and changes nothing; the output equals the unmasked call's."""
    torch.manual_seed(0)
    layer = OverlapAttention(16, 4, 2, group=dist.group.WORLD, num_tiles=2, dtype=torch.float64)
    S = 4 * ws
    x = torch.randn(2, S // ws, 16, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    tril = torch.ones(S, S, dtype=torch.bool).tril()
    additive = torch.zeros(S, S, dtype=torch.float64).masked_fill(~tril, torch.finfo(torch.float64).min)
    ref = layer(x)
    return [torch.equal(layer(x, attention_mask=m), ref)
            for m in (tril.expand(2, 1, S, S), additive.expand(2, 1, S, S), torch.ones(2, S, dtype=torch.long))]


def test_mask_equal_to_causal_is_accepted(pool2):
    assert pool2.run(causal_mask_run) == [[True] * 3] * 2



def _rank_candidates(rank, ws, training):
    """The rank-chunk candidates of an attention and an MLP with the copy engine faked usable (as
    on a GPU), from the analytic model: (K, regather, label, peak) per candidate."""
    from overlap_layers import OverlapMLP
    from overlap_layers.planning.candidates import plan_candidates
    from overlap_layers.sim import analytic_model
    out = {}
    for name, layer, key in [
            ("attention", OverlapAttention(16, 4, 2, group=dist.group.WORLD), (4, 4, torch.float32, training)),
            ("mlp", OverlapMLP(16, 32, group=dist.group.WORLD), (64, torch.float32, training))]:
        layer._rank_transports = lambda: ("copy_engine",)
        cm = layer._cost_model(key, analytic_model("cuda"))
        batch = plan_candidates(cm, layer._programs, training=training)
        out[name] = [(c.num_tiles, c.regather, c.label) for c in layer._rank_candidates(cm, batch, training=training)]
    return out


@pytest.mark.parametrize("training", [False, True])
def test_rank_candidates_in_batch_tiles(pool2, training):
    """The planner tries the attention's rank chunks in K = 1, 2 and 4 batch tiles (batch 4), each
    with and without re-gather when training; the MLP's on all rows only."""
    got = pool2.run(_rank_candidates, training)[0]
    regathers = (False, True) if training else (False,)
    assert got["attention"] == [(k, rg, "rank chunks over copy_engine" + (f", K={k}" if k > 1 else ""))
                                for rg in regathers for k in (1, 2, 4)]
    assert got["mlp"] == [(1, rg, "rank chunks over copy_engine") for rg in regathers]
