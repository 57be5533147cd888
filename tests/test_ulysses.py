"""Tier 2: UlyssesAttention on 2 and 4 gloo ranks against the independent dense float64 reference.

The reference is ``tests/attention_reference.py`` (one process, explicit softmax, float64, torch
autograd) on the full sequence. Every rank holds the whole weights and positions
``r*S/ws .. (r+1)*S/ws - 1``; its output and input gradient are compared with the reference's
slice, and every parameter gradient, which each rank holds as its partial (only its own tokens
contribute), is summed over the ranks here, in the test process.
"""
import math

import pytest
import torch
import torch.distributed as dist

import overlap_layers
from attention_reference import bad_call_input, dense_attention
from overlap_layers import OverlapConfig, UlyssesAttention
from pool import all_reduce_ranks, expect_value_error_on_every_rank

TOL = {torch.float64: 1e-10, torch.float32: 5e-5}
PARAMS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm")


# ------------------------------------------------------------------ cases and the reference
def make_case(seed, *, B, S, H, nq, nkv, d, bias="none", qk_norm=False, pos="default"):
    """Dense weights in nn.Linear layouts, x / dy over the full sequence, optional positions.
    ``bias``: "none", "all" or "qkv" (Qwen2: no bo)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    case = dict(nq=nq, nkv=nkv, d=d, x=r(B, S, H), dy=r(B, S, H),
                wq=r(nq * d, H) / math.sqrt(H), wk=r(nkv * d, H) / math.sqrt(H),
                wv=r(nkv * d, H) / math.sqrt(H), wo=r(H, nq * d) / math.sqrt(nq * d),
                bq=None, bk=None, bv=None, bo=None, q_norm=None, k_norm=None,
                position_ids=None, position_embeddings=None)
    if bias in ("all", "qkv"):
        case.update(bq=r(nq * d), bk=r(nkv * d), bv=r(nkv * d))
    if bias == "all":
        case["bo"] = r(H)
    if qk_norm:
        case.update(q_norm=1 + 0.3 * r(d), k_norm=1 + 0.3 * r(d))
    if pos == "ids":  # a random permutation of the global positions per batch row
        case["position_ids"] = torch.stack([torch.randperm(S, generator=g) for _ in range(B)])
    elif pos == "ids1":  # one permutation shared by the batch: [1, S]
        case["position_ids"] = torch.randperm(S, generator=g)[None]
    elif pos == "emb":  # arbitrary tables: the formula is linear in cos and sin
        case["position_embeddings"] = (r(B, S, d), r(B, S, d))
    return case


def reference(case, opts):
    leaves = {k: (case[k].clone().requires_grad_() if case[k] is not None else None) for k in ("x",) + PARAMS}
    y = dense_attention(leaves["x"], *(leaves[k] for k in ("wq", "wk", "wv", "wo")),
                        num_heads=case["nq"], num_kv_heads=case["nkv"], **{k: leaves[k] for k in PARAMS[4:]},
                        rope_theta=opts.get("rope_theta", 10000.0), position_ids=case["position_ids"],
                        position_embeddings=case["position_embeddings"], causal=opts.get("causal", True),
                        softmax_scale=opts.get("softmax_scale"))
    y.backward(case["dy"])
    return y.detach(), {k: (v.grad if v is not None else None) for k, v in leaves.items()}


def local_seq(t, rank, ws):
    return t.chunk(ws, dim=1)[rank]


# ------------------------------------------------------------------ worker side
def build_from_dense(case, dtype, opts):
    cast = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
    return UlyssesAttention.from_dense(*(cast(case[k]) for k in ("wq", "wk", "wv", "wo")),
                                       num_heads=case["nq"], num_kv_heads=case["nkv"],
                                       **{k: cast(case[k]) for k in PARAMS[4:]}, group=dist.group.WORLD, **opts)


def forward_kwargs(case, dtype):
    kw = {}
    if case["position_ids"] is not None:
        kw["position_ids"] = case["position_ids"]
    if case["position_embeddings"] is not None:
        kw["position_embeddings"] = tuple(t.to(dtype) for t in case["position_embeddings"])
    return kw


def run_layer(rank, ws, case, opts, dtype):
    layer = build_from_dense(case, dtype, opts)
    x = local_seq(case["x"], rank, ws).to(dtype).requires_grad_()
    y = layer(x, **forward_kwargs(case, dtype))
    y.backward(local_seq(case["dy"], rank, ws).to(dtype))
    return dict(y=y.detach(), dx=x.grad, grads={n: p.grad for n, p in layer.named_parameters()},
                names=sorted(n for n, _ in layer.named_parameters()), k=layer.plan.num_tiles,
                tile_by=layer.tile_by, reason=layer.plan.reason, dtype=y.dtype)


# ------------------------------------------------------------------ checks in the test process
def close(name, got, want, tol):
    assert got is not None, f"{name} is None"
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.double() - want).norm() / max(want.norm().item(), 1e-30)
    assert err < tol, f"{name}: relative error {err:.3g} > {tol}"


def check(results, case, opts, dtype):
    ws = len(results)
    y_ref, g_ref = reference(case, opts)
    tol = TOL[dtype]
    for rank, res in enumerate(results):
        assert res["dtype"] == dtype
        assert res["names"] == sorted(k for k in PARAMS if case[k] is not None)
        close(f"y[{rank}]", res["y"], local_seq(y_ref, rank, ws), tol)
        close(f"dx[{rank}]", res["dx"], local_seq(g_ref["x"], rank, ws), tol)
    for name in PARAMS:  # each rank holds its partial: the layer's gradient is the sum
        if case[name] is not None:
            close(f"{name}.grad (sum over ranks)", sum(r["grads"][name].double() for r in results), g_ref[name], tol)


# ------------------------------------------------------------------ numerics
GRID = [
    # ws, K, B, S(global), H, nq, nkv, d, rope, causal, bias, qk_norm, pos, dtype       tiles
    (2, 1, 2, 8, 16, 4, 4, 4, True, True, "none", False, "default", torch.float64),   # MHA, K=1
    (2, 2, 3, 8, 16, 4, 2, 4, True, True, "all", False, "ids", torch.float64),        # batch 2+1
    (2, 3, 3, 6, 12, 2, 1, 6, True, False, "none", True, "default", torch.float64),   # nkv=1 < ws
    (2, 4, 4, 4, 16, 4, 4, 4, False, True, "all", True, "default", torch.float32),    # no RoPE, fp32
    (2, 2, 2, 10, 8, 2, 2, 4, True, True, "qkv", False, "emb", torch.float64),        # Qwen2 biases
    (2, 2, 1, 8, 12, 4, 1, 4, True, True, "all", True, "ids", torch.float64),         # heads 1+1, d != H/nq
    (2, 3, 2, 4, 12, 6, 3, 2, True, True, "none", False, "ids1", torch.float64),      # nkv=3 at ws=2
    (2, 4, 1, 6, 16, 8, 4, 2, True, False, "none", True, "default", torch.float64),   # heads 1+1+1+1
    (4, 1, 1, 8, 16, 4, 1, 4, True, True, "none", False, "default", torch.float64),   # 1 KV head, ws=4
    (4, 2, 3, 8, 16, 4, 2, 4, True, False, "all", True, "ids", torch.float64),        # 2 KV heads, ws=4
    (4, 2, 1, 8, 16, 8, 2, 2, True, True, "all", False, "default", torch.float64),    # KV head in 2 tiles
    (4, 2, 1, 4, 24, 12, 6, 2, True, True, "qkv", True, "ids", torch.float64),        # heads 2+1, nkv=6
    (4, 3, 3, 4, 24, 12, 6, 2, False, True, "none", False, "default", torch.float64), # nkv=6 at ws=4
    (4, 4, 2, 8, 16, 8, 4, 2, True, True, "all", True, "emb", torch.float32),
]


@pytest.mark.parametrize("ws,k,B,S,H,nq,nkv,d,rope,causal,bias,qk_norm,pos,dtype", GRID)
def test_matches_dense_reference(pools, ws, k, B, S, H, nq, nkv, d, rope, causal, bias, qk_norm, pos, dtype):
    case = make_case(ws * 100 + k * 10 + B, B=B, S=S, H=H, nq=nq, nkv=nkv, d=d, bias=bias, qk_norm=qk_norm,
                     pos=pos)
    opts = dict(num_tiles=k, causal=causal, rope_theta=10000.0 if rope else None)
    results = pools(ws).run(run_layer, case, opts, dtype)
    want_k = min(k, B) if B > 1 else min(k, nq // ws)
    assert all(r["k"] == want_k for r in results), [r["k"] for r in results]
    assert all(r["tile_by"] == ("heads" if B == 1 and want_k > 1 else "batch") for r in results)
    check(results, case, opts, dtype)


def test_softmax_scale_and_rope_theta(pool2):
    case = make_case(7, B=2, S=8, H=16, nq=4, nkv=2, d=4, pos="ids")
    opts = dict(num_tiles=2, softmax_scale=0.3, rope_theta=100.0)
    check(pool2.run(run_layer, case, opts, torch.float64), case, opts, torch.float64)


def test_position_embeddings_override_rope_theta(pool2):
    case = make_case(8, B=2, S=6, H=8, nq=2, nkv=2, d=4, pos="emb")
    opts = dict(num_tiles=2, rope_theta=500.0)
    check(pool2.run(run_layer, case, opts, torch.float64), case, opts, torch.float64)


def test_auto_plans_and_matches_the_reference(pool2):
    case = make_case(9, B=4, S=8, H=16, nq=4, nkv=2, d=4, bias="all")
    opts = dict(num_tiles="auto")
    results = pool2.run(run_layer, case, opts, torch.float64)
    assert all(1 <= r["k"] <= 4 and "K=" in r["reason"] for r in results)
    assert len({r["k"] for r in results}) == 1
    check(results, case, opts, torch.float64)


def planned_ulysses(rank, ws, B, training):
    layer = UlyssesAttention(16, 4, 2, group=dist.group.WORLD)
    x = torch.randn(B, 8, 16, requires_grad=training)
    ks = []
    for _ in range(60):  # until verification settles (14 calls for two contenders, 26 if a trial was disturbed)
        y = layer(x)
        if training:
            y.sum().backward()
        ks.append(layer.plan.num_tiles)
        if len(ks) >= 20 and not layer.verifying:
            break
    cands = sorted({c.num_tiles for c in layer.plan.candidates})
    return ks, layer.plan.digest(), cands, layer.tile_by, layer.verifying, layer.explain()


@pytest.mark.parametrize("B,training", [(4, True), (1, False)])
def test_planner_candidates_cover_batch_or_head_tiles(pool2, B, training):
    res = pool2.run(planned_ulysses, B, training)
    (ks, digest, cands, tile_by, verifying, text), other = res[0], res[1]
    assert other[1] == digest and not verifying and "pred ms" in text
    units = B if B > 1 else 2  # 4 heads over 2 ranks: head groups of a rank's 2 heads
    assert cands == list(range(1, units + 1))
    assert all(1 <= k <= units for k in ks)
    assert tile_by == ("heads" if B == 1 and ks[-1] > 1 else "batch")


def test_exported_from_package():
    assert overlap_layers.UlyssesAttention is UlyssesAttention
    assert "UlyssesAttention" in overlap_layers.__all__


def _empty_run(rank, ws, case, opts):
    layer = build_from_dense(case, torch.float64, opts)
    x = local_seq(case["x"], rank, ws).requires_grad_()
    y = layer(x, **forward_kwargs(case, torch.float64))
    y.backward(local_seq(case["dy"], rank, ws))
    return dict(y=y.detach(), dx=x.grad, grads={n: p.grad for n, p in layer.named_parameters()},
                names=sorted(n for n, _ in layer.named_parameters()), dtype=y.dtype, planned=layer.plan is not None)


@pytest.mark.parametrize("ws,empty_dim", [(2, 0), (2, 1), (4, 0)])
def test_empty_batch_or_sequence_matches_dense_reference(pools, ws, empty_dim):
    """No batch rows or no positions: the reference's empty output and dx, and zero (not
    missing) parameter gradients; no plan runs."""
    case = make_case(44, B=2, S=8, H=16, nq=4, nkv=2, d=4, bias="all", qk_norm=True)
    case.update(x=case["x"].narrow(empty_dim, 0, 0), dy=case["dy"].narrow(empty_dim, 0, 0))
    results = pools(ws).run(_empty_run, case, dict(num_tiles=2))
    assert not any(r["planned"] for r in results)
    assert all(r["y"].numel() == 0 for r in results)
    check(results, case, {}, torch.float64)  # the gradients must be exact zeros: the reference's are


# ------------------------------------------------------------------ grad modes, dropout, autocast
def _no_grad_run(rank, ws, case):
    layer = build_from_dense(case, torch.float64, dict(num_tiles=2))
    packed = []
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = layer(local_seq(case["x"], rank, ws))
    return y, y.grad_fn is None, len(packed)


def test_no_grad_forward_saves_nothing(pool2):
    case = make_case(10, B=2, S=8, H=16, nq=4, nkv=2, d=4, bias="all", qk_norm=True)
    y_ref, _ = reference(case, {})
    for rank, (y, no_graph, n_saved) in enumerate(pool2.run(_no_grad_run, case)):
        assert no_graph and n_saved == 0
        close(f"y[{rank}]", y, local_seq(y_ref, rank, 2), TOL[torch.float64])


def _dropout_run(rank, ws, case):
    layer = build_from_dense(case, torch.float64, dict(num_tiles=2, dropout_p=0.5))
    x = local_seq(case["x"], rank, ws)
    layer.eval()
    y_eval = layer(x)
    layer.train()
    xg = x.clone().requires_grad_()
    y_train = layer(xg)
    y_train.backward(local_seq(case["dy"], rank, ws))
    return y_eval.detach(), y_train.detach(), bool(torch.isfinite(xg.grad).all() and torch.isfinite(layer.wq.grad).all())


def test_dropout_only_in_training(pool2):
    case = make_case(11, B=2, S=8, H=16, nq=4, nkv=2, d=4)
    y_ref, _ = reference(case, {})
    for rank, (y_eval, y_train, finite) in enumerate(pool2.run(_dropout_run, case)):
        close(f"y_eval[{rank}]", y_eval, local_seq(y_ref, rank, 2), TOL[torch.float64])
        assert finite and not torch.allclose(y_train, y_eval)


def _autocast_run(rank, ws, case):
    layer = build_from_dense(case, torch.float32, dict(num_tiles=2))
    x = local_seq(case["x"], rank, ws).float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().backward(local_seq(case["dy"], rank, ws).float())
    return dict(y=y.detach(), dx=x.grad, g=layer.wq.grad, dtype=y.dtype, gdtype=layer.wq.grad.dtype)


def test_autocast_bf16_compute_fp32_weights(pool2):
    case = make_case(12, B=2, S=8, H=16, nq=4, nkv=2, d=4)
    y_ref, g_ref = reference(case, {})
    results = pool2.run(_autocast_run, case)
    for rank, r in enumerate(results):
        assert r["dtype"] == torch.bfloat16 and r["gdtype"] == torch.float32
        close(f"y[{rank}]", r["y"], local_seq(y_ref, rank, 2), 3e-2)
        close(f"dx[{rank}]", r["dx"], local_seq(g_ref["x"], rank, 2), 3e-2)
    close("wq.grad", sum(r["g"].double() for r in results), g_ref["wq"], 3e-2)


# ------------------------------------------------------------------ launch order
def _launch_order(rank, ws, B, k):
    layer = UlyssesAttention(16, 4, 2, group=dist.group.WORLD, num_tiles=k)
    layer.launch_log = []
    y = layer(torch.randn(B, 4, 16, requires_grad=True))
    n_fwd = len(layer.launch_log)
    y.sum().backward()
    fmt = lambda log: [f"{name}[{t}]" for t, name, _ in log]  # noqa: E731
    return fmt(layer.launch_log[:n_fwd]), fmt(layer.launch_log[n_fwd:]), layer.tile_by


def _rr(k, segs):
    """Segmented round-robin written out: every tile's segment 0, then every tile's segment 1..."""
    return [f"{op}[{t}]" for seg in segs for t in range(k) for op in seg]


@pytest.mark.parametrize("B,k,tile_by", [(3, 3, "batch"), (1, 2, "heads")])
def test_launch_order_is_segmented_round_robin(pool2, B, k, tile_by):
    fwd, bwd, got_by = pool2.run(_launch_order, B, k)[0]
    assert got_by == tile_by
    assert fwd == _rr(k, [["qkv", "a2a_qkv"], ["wait_a2a_qkv", "core", "a2a_o"], ["wait_a2a_o", "out_proj"]])
    assert bwd == _rr(k, [["dgrad_o", "a2a_do", "wgrad_o"], ["wait_a2a_do", "core_bwd", "a2a_dqkv"],
                          ["wait_a2a_dqkv", "dgrad_x", "wgrad_qkv"]])


# ------------------------------------------------------------------ init, round trip
def _init_run(rank, ws, seed, bias, qk_norm, on_meta):
    torch.manual_seed(seed)
    kw = dict(group=dist.group.WORLD, bias=bias, qk_norm=qk_norm)
    if on_meta:
        layer = UlyssesAttention(12, 4, 2, head_dim=4, device="meta", **kw)
        layer.to_empty(device="cpu")
        torch.manual_seed(seed)
        layer.reset_parameters()
    else:
        layer = UlyssesAttention(12, 4, 2, head_dim=4, **kw)
    dense = layer.to_dense()
    again = UlyssesAttention.from_dense(dense["wq"], dense["wk"], dense["wv"], dense["wo"], num_heads=4,
                                        num_kv_heads=2, **{k: dense[k] for k in PARAMS[4:]},
                                        group=dist.group.WORLD)
    same = [n for n, p in layer.named_parameters()] == [n for n, p in again.named_parameters()] and all(
        torch.equal(a, b) for a, b in zip(layer.parameters(), again.parameters()))
    return dense, same


@pytest.mark.parametrize("on_meta", [False, True])
@pytest.mark.parametrize("bias,qk_norm", [(False, False), (True, True)])
def test_init_matches_nn_linear_and_round_trips(pool2, bias, qk_norm, on_meta):
    torch.manual_seed(5)
    lin = [torch.nn.Linear(12, 16, bias=bias), torch.nn.Linear(12, 8, bias=bias), torch.nn.Linear(12, 8, bias=bias),
           torch.nn.Linear(16, 12, bias=bias)]
    for dense, same in pool2.run(_init_run, 5, bias, qk_norm, on_meta):
        assert same
        for (w, b), m in zip((("wq", "bq"), ("wk", "bk"), ("wv", "bv"), ("wo", "bo")), lin):
            assert torch.equal(dense[w], m.weight.detach())
            assert (dense[b] is None) if not bias else torch.equal(dense[b], m.bias.detach())
        for n in ("q_norm", "k_norm"):
            assert (dense[n] is None) if not qk_norm else torch.equal(dense[n], torch.ones(4))


# ------------------------------------------------------------------ bad input
def _build_kw(rank, ws, kw):
    args = dict(hidden_size=16, num_heads=4, group=dist.group.WORLD)
    args.update(kw)
    UlyssesAttention(**args)


@pytest.mark.parametrize("ws,kw,match", [
    (2, dict(num_heads=3, hidden_size=12), "num_heads"),                      # nq % ws
    (4, dict(num_heads=2, hidden_size=16), "num_heads"),
    (2, dict(num_heads=6, num_kv_heads=4, hidden_size=12), "num_kv_heads"),   # nq % nkv
    (2, dict(num_heads=4, hidden_size=18), "head_dim"),                       # H % nq without head_dim
    (2, dict(head_dim=3), "head_dim"),                                        # odd with RoPE
    (2, dict(num_tiles=0), "num_tiles"),
    (2, dict(num_tiles="many"), "num_tiles"),
    (2, dict(group=None), "exactly one of group"),
    (2, dict(config="fast"), "config"),
    (2, dict(dropout_p=1.0), "dropout_p"),
    (2, dict(dtype=torch.int8), "dtype=torch.int8"),
])
def test_bad_constructor_arguments(pools, ws, kw, match):
    expect_value_error_on_every_rank(pools(ws), _build_kw, kw, match=match)


def _odd_head_dim_without_rope(rank, ws):
    layer = UlyssesAttention(12, 2, group=dist.group.WORLD, head_dim=3, rope_theta=None)
    return tuple(layer(torch.randn(1, 2, 12)).shape)


def test_odd_head_dim_without_rope_is_fine(pool2):
    assert pool2.run(_odd_head_dim_without_rope) == [(1, 2, 12)] * 2


def _from_dense_bad(rank, ws, which):
    H, nq, nkv, d = 16, 4, 2, 4
    t = dict(wq=torch.randn(nq * d, H), wk=torch.randn(nkv * d, H), wv=torch.randn(nkv * d, H),
             wo=torch.randn(H, nq * d))
    kw = {}
    if which == "wq":
        t["wq"] = torch.randn(nq * d + 1, H)
    elif which == "wk":
        t["wk"] = torch.randn(nkv * d + d, H)
    elif which == "wo":
        t["wo"] = torch.randn(H, nq * d - 1)
    elif which == "q_norm":
        kw = dict(q_norm=torch.ones(d + 1), k_norm=torch.ones(d))
    elif which == "bq":
        kw = dict(bq=torch.randn(3), bk=torch.randn(nkv * d), bv=torch.randn(nkv * d))
    elif which == "bk":
        kw = dict(bq=torch.randn(nq * d))
    UlyssesAttention.from_dense(t["wq"], t["wk"], t["wv"], t["wo"], num_heads=nq, num_kv_heads=nkv,
                                group=dist.group.WORLD, **kw)


@pytest.mark.parametrize("which,match", [("wq", "wq"), ("wk", "wk"), ("wo", "wo"), ("q_norm", "q_norm"),
                                         ("bq", "bq"), ("bk", "bk")])
def test_from_dense_bad_shapes(pool2, which, match):
    expect_value_error_on_every_rank(pool2, _from_dense_bad, which, match=match)


def _call_with(rank, ws, name):
    layer = UlyssesAttention(8, 2, group=dist.group.WORLD, num_tiles=2)
    x, kw = bad_call_input(rank, ws, name)
    if name == "num_tiles":
        layer = UlyssesAttention(8, 2, group=dist.group.WORLD, num_tiles=1 + rank)
    elif name == "layer_config":
        layer = UlyssesAttention(8, 2, group=dist.group.WORLD, num_tiles=2, causal=rank == 0)
    layer(x, **kw)


@pytest.mark.parametrize("name,match", [
    ("seq", "seq_local differs"),
    ("batch", "batch differs"),
    ("rank0_2d", "3-D"),
    ("hidden", "hidden"),
    ("dtype", "dtype"),
    ("dtype_rank1", "dtype"),
    ("device", "device"),
    ("attention_mask", "attention_mask must be None"),
    ("attention_mask_rank1", "attention_mask must be None"),
    ("position_ids", "position_ids must"),
    ("position_ids_float", "position_ids must"),
    ("position_embeddings", "position_embeddings must"),
    ("position_embeddings_grad_rank1", "must not require grad"),
    ("num_tiles", "num_tiles differs"),
    ("layer_config", "causal differs: rank 0: True, rank 1: False"),
])
def test_bad_input_raises_on_every_rank(pool2, name, match):
    expect_value_error_on_every_rank(pool2, _call_with, name, match=match)


def _build_warnings(rank, ws, kw):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _build_kw(rank, ws, kw)
    return [str(w.message) for w in caught]


def test_config_transport_copy_engine_warns_and_runs_nccl(pool2):
    for msgs in pool2.run(_build_warnings, dict(config=OverlapConfig(transport="copy_engine"))):
        assert any("UlyssesAttention has no copy-engine path" in m for m in msgs), msgs


def test_pool_survives_errors(pool2):
    assert pool2.run(all_reduce_ranks) == [3, 3]


def _pin_rank_plan(rank, ws, kind, tiles):
    from overlap_layers import OverlapMoE
    from overlap_layers.layers import TilePlan
    layer = UlyssesAttention(16, 4, group=dist.group.WORLD) if kind == "ulysses" else \
        OverlapMoE(16, 32, 4, 2, group=dist.group.WORLD)
    layer.pin_plan(TilePlan(tiles, decomposition="rank", transport="copy_engine"))


@pytest.mark.parametrize("kind,tiles,match", [("ulysses", 1, "runs batch tiles over NCCL only"),
                                              ("moe", 2, "plan.num_tiles=2")])
def test_rank_chunk_plans_refused_where_absent(pool2, kind, tiles, match):
    """Ulysses has no rank-chunk plan; the MoE's runs on all rows at once (one tile)."""
    expect_value_error_on_every_rank(pool2, _pin_rank_plan, kind, tiles, match=match)
