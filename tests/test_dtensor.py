"""Tier 2: layers built with ``mesh=`` hold DTensor parameters (overlap_layers.integrations.dtensor).

For OverlapMLP (swiglu, gelu), OverlapAttention (sharded and replicated KV heads) and OverlapMoE on
2 and 4 gloo ranks, each built from the same dense weights with ``mesh=`` and with ``group=``:

* every parameter of the mesh layer is a DTensor whose ``full_tensor()`` is ``to_dense()`` (viewed
  as the DTensor's global shape);
* forward and backward equal the group layer's bit for bit (the compute is the same, on the
  DTensors' local views);
* gradients are DTensors with the parameters' placements, whose local views equal the group
  layer's gradients, and after ``finalize_grads`` their ``full_tensor()`` is the dense gradient
  (the group layer's finalized gradients, gathered by its ``to_dense``; the group path itself is
  checked against independent dense references in test_mlp / test_attention / test_moe).
"""
import math

import pytest
import torch
import torch.distributed as dist

from overlap_layers import (OverlapAttention, OverlapMLP, OverlapMoE, OverlapTransformerBlock, UlyssesAttention,
                            finalize_grads)


def _mesh(ws, two_d):
    from torch.distributed.device_mesh import init_device_mesh
    if two_d:
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
        return mesh, "tp", mesh.get_group("tp")
    return init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)), None, dist.group.WORLD


def _dense_grads(layer):
    """The dense gradients of a ``group=`` layer after finalize_grads: its gradients written into
    its parameters, gathered by ``to_dense`` (destroys the layer's weights)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(p.grad)
    return layer.to_dense()


def _check_pair(mesh_layer, group_layer, x, dy, call_kw=None, data_parallel=False):
    """Every property of the module docstring, asserted on this rank."""
    from torch.distributed.tensor import DTensor
    call_kw = call_kw or {}
    dense = group_layer.to_dense()
    dense_m = mesh_layer.to_dense()
    assert all(torch.equal(dense_m[n], dense[n]) for n in dense if dense[n] is not None), "to_dense differs"
    for n, p in mesh_layer.named_parameters():
        assert isinstance(p, DTensor), n
        full = p.full_tensor()
        assert full.numel() == dense[n].numel() and torch.equal(full.reshape(dense[n].shape), dense[n]), n
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ym, yg = mesh_layer(xs[0], **call_kw), group_layer(xs[1], **call_kw)
    assert not isinstance(ym, DTensor)
    assert torch.equal(ym, yg), "forward differs"
    ym.backward(dy)
    yg.backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad), "dx differs"
    group_params = dict(group_layer.named_parameters())
    for n, p in mesh_layer.named_parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, (n, type(p.grad))
        assert torch.equal(mesh_layer._local_views[n](p.grad), group_params[n].grad), n
    finalize_grads(mesh_layer, data_parallel=data_parallel)
    finalize_grads(group_layer, data_parallel=data_parallel)
    dense_grads = _dense_grads(group_layer)
    bad = []
    for n, p in mesh_layer.named_parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, n
        full = p.grad.full_tensor()
        if not torch.equal(full.reshape(dense_grads[n].shape), dense_grads[n]):
            bad.append(n)
    return bad


# ------------------------------------------------------------------ MLP
def _mlp_run(rank, ws, activation, bias, sp, two_d, build):
    mesh, axis, tp = _mesh(ws, two_d)
    tws, trank = dist.get_world_size(tp), dist.get_rank(tp)
    g = torch.Generator().manual_seed(3)
    H, F, B, S = 8, 4 * tws, 2, 4 * tws
    n_in = 2 * F if activation == "swiglu" else F
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w_in, w_out, b_in, b_out, x, dy = r(n_in, H), r(H, F), r(n_in), r(H), r(B, S, H), r(B, S, H)
    opts = dict(activation=activation, sequence_parallel=sp, num_tiles=2)
    if build == "init":
        torch.manual_seed(7)
        ml = OverlapMLP(H, F, mesh=mesh, axis=axis, bias=bias, dtype=torch.float64, **opts)
        torch.manual_seed(7)
        gl = OverlapMLP(H, F, group=tp, bias=bias, dtype=torch.float64, **opts)
    else:
        kw = dict(b_in=b_in, b_out=b_out) if bias else {}
        ml = OverlapMLP.from_dense(w_in, w_out, mesh=mesh, axis=axis, **kw, **opts)
        gl = OverlapMLP.from_dense(w_in, w_out, group=tp, **kw, **opts)
    if activation == "swiglu":
        assert tuple(ml.w_in.shape) == (2, F, H) and tuple(ml.w_in.to_local().shape) == (2, F // tws, H)
    xl = x.chunk(tws, 1)[trank] if sp else x
    dyl = dy.chunk(tws, 1)[trank] if sp else dy
    return _check_pair(ml, gl, xl, dyl)


@pytest.mark.parametrize("ws,activation,bias,sp,two_d,build", [
    (2, "swiglu", True, True, False, "dense"),
    (2, "gelu", True, False, False, "dense"),
    (2, "swiglu", False, True, False, "init"),
    (4, "swiglu", True, True, False, "dense"),
    (4, "gelu", False, True, False, "init"),
    (4, "swiglu", True, True, True, "dense"),  # 2-D (dp, tp) mesh, axis="tp"
])
def test_mlp_dtensor_params(pools, ws, activation, bias, sp, two_d, build):
    for bad in pools(ws).run(_mlp_run, activation, bias, sp, two_d, build):
        assert bad == [], f"full_tensor() of the finalized gradient differs from the dense one: {bad}"


# ------------------------------------------------------------------ attention
def _attn_case(seed, ws, nq, nkv, bias, qk_norm, H=16, d=4, B=2):
    """Dense attention weights (from_dense keywords) and x, dy for a global sequence of 4*ws."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / math.sqrt(H)  # noqa: E731
    dense = dict(wq=r(nq * d, H), wk=r(nkv * d, H), wv=r(nkv * d, H), wo=r(H, nq * d))
    if bias:
        dense.update(bq=r(nq * d), bk=r(nkv * d), bv=r(nkv * d), bo=r(H))
    if qk_norm:
        dense.update(q_norm=1 + r(d), k_norm=1 + r(d))
    return dense, r(B, 4 * ws, H), r(B, 4 * ws, H)


def _attn_run(rank, ws, nq, nkv, bias, qk_norm, sp, build):
    mesh, axis, tp = _mesh(ws, False)
    H = 16
    dense, x, dy = _attn_case(5, ws, nq, nkv, bias, qk_norm, H=H)
    opts = dict(sequence_parallel=sp, num_tiles=2)
    if build == "init":
        torch.manual_seed(9)
        ml = OverlapAttention(H, nq, nkv, mesh=mesh, bias=bias, qk_norm=qk_norm, dtype=torch.float64, **opts)
        torch.manual_seed(9)
        gl = OverlapAttention(H, nq, nkv, group=tp, bias=bias, qk_norm=qk_norm, dtype=torch.float64, **opts)
    else:
        ml = OverlapAttention.from_dense(**dense, num_heads=nq, num_kv_heads=nkv, mesh=mesh, **opts)
        gl = OverlapAttention.from_dense(**dense, num_heads=nq, num_kv_heads=nkv, group=tp, **opts)
    if nkv < ws:
        assert tuple(ml.wk.to_local().shape) == (nkv * ml.head_dim, H)  # every rank holds every KV head
    xl = x.chunk(ws, 1)[rank] if sp else x
    dyl = dy.chunk(ws, 1)[rank] if sp else dy
    return _check_pair(ml, gl, xl, dyl)


@pytest.mark.parametrize("ws,nq,nkv,bias,qk_norm,sp,build", [
    (2, 4, 2, True, True, True, "dense"),
    (2, 4, 1, True, False, True, "dense"),   # replicated KV heads
    (2, 2, 1, False, True, False, "init"),   # replicated KV heads, no SP
    (4, 4, 4, False, True, True, "init"),
    (4, 8, 2, True, True, True, "dense"),   # replicated KV heads, 2 ranks per head, 2 heads
])
def test_attention_dtensor_params(pools, ws, nq, nkv, bias, qk_norm, sp, build):
    for bad in pools(ws).run(_attn_run, nq, nkv, bias, qk_norm, sp, build):
        assert bad == [], f"full_tensor() of the finalized gradient differs from the dense one: {bad}"


# ------------------------------------------------------------------ Ulysses
def _ulysses_run(rank, ws, nq, nkv, bias, qk_norm, build):
    mesh, axis, tp = _mesh(ws, False)
    H = 16
    dense, x, dy = _attn_case(6, ws, nq, nkv, bias, qk_norm, H=H)
    if build == "init":
        torch.manual_seed(9)
        ml = UlyssesAttention(H, nq, nkv, mesh=mesh, bias=bias, qk_norm=qk_norm, num_tiles=2, dtype=torch.float64)
        torch.manual_seed(9)
        gl = UlyssesAttention(H, nq, nkv, group=tp, bias=bias, qk_norm=qk_norm, num_tiles=2, dtype=torch.float64)
    else:
        ml = UlyssesAttention.from_dense(**dense, num_heads=nq, num_kv_heads=nkv, mesh=mesh, num_tiles=2)
        gl = UlyssesAttention.from_dense(**dense, num_heads=nq, num_kv_heads=nkv, group=tp, num_tiles=2)
    # Ulysses' gradients are data-parallel style partials: summed with data_parallel=True
    return _check_pair(ml, gl, x.chunk(ws, 1)[rank], dy.chunk(ws, 1)[rank], data_parallel=True)


@pytest.mark.parametrize("ws,nq,nkv,bias,qk_norm,build", [(2, 4, 2, True, True, "dense"),
                                                         (4, 4, 4, False, False, "init")])
def test_ulysses_dtensor_params(pools, ws, nq, nkv, bias, qk_norm, build):
    for bad in pools(ws).run(_ulysses_run, nq, nkv, bias, qk_norm, build):
        assert bad == [], f"full_tensor() of the finalized gradient differs from the dense one: {bad}"


# ------------------------------------------------------------------ MoE
def _moe_run(rank, ws, activation, shared, build):
    mesh, axis, tp = _mesh(ws, False)
    g = torch.Generator().manual_seed(11)
    H, F, E, k = 8, 6, 2 * ws, 2
    n_in = 2 * F if activation == "swiglu" else F
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / math.sqrt(H)  # noqa: E731
    dense = dict(router_weight=r(E, H), w_in=r(E, n_in, H), w_out=r(E, H, F))
    if shared:
        dense.update(shared_w_in=r(n_in, H), shared_w_out=r(H, F))
    xr = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 3 + rank, H, generator=xr, dtype=torch.float64)  # each rank's own tokens
    dy = torch.randn(x.shape, generator=xr, dtype=torch.float64)
    opts = dict(activation=activation, num_tiles=2)
    if build == "init":
        torch.manual_seed(13)
        ml = OverlapMoE(H, F, E, k, mesh=mesh, shared_expert_ffn=F if shared else None, dtype=torch.float64, **opts)
        torch.manual_seed(13)
        gl = OverlapMoE(H, F, E, k, group=tp, shared_expert_ffn=F if shared else None, dtype=torch.float64, **opts)
    else:
        ml = OverlapMoE.from_dense(**dense, top_k=k, mesh=mesh, **opts)
        gl = OverlapMoE.from_dense(**dense, top_k=k, group=tp, **opts)
    return _check_pair(ml, gl, x, dy, data_parallel=True)


@pytest.mark.parametrize("ws,activation,shared,build", [
    (2, "swiglu", True, "dense"),
    (2, "gelu", False, "init"),
    (4, "swiglu", False, "dense"),
])
def test_moe_dtensor_params(pools, ws, activation, shared, build):
    for bad in pools(ws).run(_moe_run, activation, shared, build):
        assert bad == [], f"full_tensor() of the finalized gradient differs from the dense one: {bad}"


# ------------------------------------------------------------------ group= stays plain
def _group_plain(rank, ws):
    layers = [OverlapMLP(8, 8, group=dist.group.WORLD), OverlapAttention(8, 2, 1, group=dist.group.WORLD),
              OverlapMoE(8, 4, 2, 1, group=dist.group.WORLD)]
    return [type(p).__name__ for layer in layers for p in layer.parameters()]


def test_group_parameters_stay_plain(pool2):
    for names in pool2.run(_group_plain):
        assert set(names) == {"Parameter"}, names


# ------------------------------------------------------------------ DCP: save at 2 ranks, load at 4
def _gather_seq(y, group):
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y.contiguous(), group=group)
    return torch.cat(parts, 1)


def _dcp_layer(kind, ws, seed, nkv=None):
    """A mesh= layer of ``kind`` on a 1-D mesh of every rank, initialised from ``seed``."""
    mesh, _, _ = _mesh(ws, False)
    torch.manual_seed(seed)
    kw = dict(mesh=mesh, num_tiles=2, dtype=torch.float64)
    if kind == "mlp":
        return OverlapMLP(8, 8, activation="swiglu", bias=True, **kw)
    if kind == "moe":
        return OverlapMoE(16, 8, 4, 2, shared_expert_ffn=8, **kw)
    if kind == "ulysses":
        return UlyssesAttention(16, 4, nkv, bias=True, qk_norm=True, **kw)
    if kind == "block":
        return OverlapTransformerBlock(16, 4, 8, num_kv_heads=nkv, moe=dict(num_experts=4, top_k=2),
                                       norm="layernorm", **kw)
    return OverlapAttention(16, 4, nkv, bias=True, qk_norm=True, **kw)


def _flat_dense(layer) -> dict:
    """``to_dense()`` flattened to name -> tensor (the block's is nested by sublayer)."""
    out = {}
    for k, v in layer.to_dense().items():
        out.update({f"{k}.{k2}": v2 for k2, v2 in v.items()} if isinstance(v, dict) else {k: v})
    return out


def _dcp_save(rank, ws, kind, nkv, path):
    import torch.distributed.checkpoint as dcp
    layer = _dcp_layer(kind, ws, seed=1, nkv=nkv)
    x = torch.randn(2, 8, layer.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y = _gather_seq(layer(x.chunk(ws, 1)[rank]), dist.group.WORLD)
    dcp.save({"model": layer.state_dict()}, checkpoint_id=path)
    return _flat_dense(layer), y


def _dcp_load(rank, ws, kind, nkv, path):
    import torch.distributed.checkpoint as dcp
    layer = _dcp_layer(kind, ws, seed=99, nkv=nkv)  # other weights, overwritten by the load
    state = {"model": layer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    layer.load_state_dict(state["model"])
    x = torch.randn(2, 8, layer.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y = _gather_seq(layer(x.chunk(ws, 1)[rank]), dist.group.WORLD)
    placements = {n: str(p.placements) for n, p in layer.named_parameters()}
    return _flat_dense(layer), y, placements


@pytest.mark.parametrize("kind,nkv", [("mlp", None), ("attention", 1), ("attention", 2), ("moe", None),
                                     ("ulysses", 2), ("block", 2)])
def test_dcp_save_at_2_load_at_4(pools, tmp_path, kind, nkv):
    """Saved by 2 ranks, loaded (resharded) by 4: the same dense weights and outputs. Attention with
    nkv=2 goes from Shard(0) KV heads at 2 ranks to replicated KV heads at 4; nkv=1 is replicated
    at both. The MoE's experts go from 2 to 1 per rank; the block holds attention (nkv=2), an MoE
    and LayerNorms."""
    path = str(tmp_path / "ckpt")
    saved = pools(2).run(_dcp_save, kind, nkv, path)
    loaded = pools(4).run(_dcp_load, kind, nkv, path)
    dense, y = saved[0]
    for dense4, y4, placements in loaded:
        for n, t in dense.items():
            assert (t is None and dense4[n] is None) or torch.equal(t, dense4[n]), n
        assert torch.allclose(y4, y, rtol=1e-12, atol=1e-12), (y4 - y).abs().max()
    if kind == "attention":
        assert "Replicate" in loaded[0][2]["wk"]


# ------------------------------------------------------------------ FSDP2 over dp of a 2-D (dp, tp) mesh
def _fsdp_run(rank, ws, steps, bias):
    """OverlapMLP on a (dp=2, tp=2) mesh, fully_shard over dp, AdamW(foreach=False), against the
    same dense MLP in one process (every rank computes the reference itself)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    mesh, _, tp = _mesh(ws, True)
    dp_i, tp_i = mesh.get_coordinate()
    g = torch.Generator().manual_seed(21)
    H, F, B, S = 8, 8, 4, 8
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    dense = dict(w_in=r(2 * F, H) / math.sqrt(H), w_out=r(H, F) / math.sqrt(F))
    if bias:
        dense.update(b_in=r(2 * F), b_out=r(H))
    xs, ts = [r(B, S, H) for _ in range(steps)], [r(B, S, H) for _ in range(steps)]
    layer = OverlapMLP.from_dense(**dense, mesh=mesh, axis="tp", activation="swiglu", num_tiles=2)
    fully_shard(layer, mesh=mesh["dp"])
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=False)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in dense.items()}
    ref_opt = torch.optim.AdamW(ref.values(), lr=1e-2, foreach=False)
    dp = mesh["dp"].size()
    for x, t in zip(xs, ts):
        # rank (dp_i, tp_i): batch rows of dp_i, sequence positions of tp_i
        xl = x.chunk(dp, 0)[dp_i].chunk(2, 1)[tp_i]
        tl = t.chunk(dp, 0)[dp_i].chunk(2, 1)[tp_i]
        loss = ((layer(xl) - tl) ** 2).sum() * (dp / B)  # FSDP averages over dp: mean over the batch
        loss.backward()
        finalize_grads(layer)  # b_out under sequence parallelism: the tp partials
        opt.step()
        opt.zero_grad()
        pre = x @ ref["w_in"].T + (ref["b_in"] if bias else 0)
        h = torch.nn.functional.silu(pre[..., :F]) * pre[..., F:]
        y = h @ ref["w_out"].T + (ref["b_out"] if bias else 0)
        (((y - t) ** 2).sum() / B).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    errs = {}
    for n, p in layer.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.ndim == 2, (n, type(p))
        full = p.full_tensor().reshape(ref[n].shape)
        errs[n] = (full - ref[n].detach()).abs().max().item()
    moved = max((ref[n].detach() - dense[n]).abs().max().item() for n in ref)
    return errs, moved


@pytest.mark.parametrize("bias", [False, True])
def test_fsdp2_over_dp_with_tp_mlp_matches_dense(pool4, bias):
    for errs, moved in pool4.run(_fsdp_run, 3, bias):
        assert moved > 1e-3  # the optimizer did move the weights
        assert max(errs.values()) < 1e-10, errs


# ------------------------------------------------------------------ meta device (deferred init)
def _meta_run(rank, ws):
    mesh, _, _ = _mesh(ws, False)
    layers = [OverlapMLP(8, 8, mesh=mesh, bias=True, device="meta"),
              OverlapAttention(16, 4, 1, mesh=mesh, bias=True, device="meta"),
              OverlapMoE(8, 4, 4, 2, mesh=mesh, shared_expert_ffn=4, device="meta")]
    out = {}
    for layer in layers:
        layer.to_empty(device="cpu")
        for n, p in layer.named_parameters():
            out[f"{type(layer).__name__}.{n}"] = (tuple(p.shape), str(p.placements), p.device.type)
    y = layers[0](torch.randn(1, 4, 8))  # runs (uninitialised weights) on the DTensors' local views
    return out, tuple(y.shape)


def test_meta_construction_has_global_shapes(pool2):
    for out, yshape in pool2.run(_meta_run):
        assert yshape == (1, 4, 8)
        assert out["OverlapMLP.w_in"] == ((2, 8, 8), "(Shard(dim=1),)", "cpu")
        assert out["OverlapMLP.b_out"] == ((8,), "(Replicate(),)", "cpu")
        assert out["OverlapAttention.wk"] == ((4, 16), "(Replicate(),)", "cpu")  # 1 KV head, dense
        assert out["OverlapAttention.wo"] == ((16, 16), "(Shard(dim=1),)", "cpu")
        assert out["OverlapMoE.w_in"] == ((4, 8, 8), "(Shard(dim=0),)", "cpu")


# ------------------------------------------------------------------ DTensor inputs ([Note: DTensor inputs])
def _dt_layer(kind, mesh, axis, sp, nkv=1):
    """A mesh= layer of ``kind`` (float64, K=2) built from seed 17."""
    torch.manual_seed(17)
    kw = dict(mesh=mesh, axis=axis, num_tiles=2, dtype=torch.float64)
    if kind == "mlp":
        return OverlapMLP(8, 8, activation="swiglu", bias=True, sequence_parallel=sp, **kw)
    if kind == "attention":
        return OverlapAttention(16, 4, nkv, bias=True, qk_norm=True, sequence_parallel=sp, **kw)
    if kind == "ulysses":
        return UlyssesAttention(16, 4, nkv, bias=True, qk_norm=True, **kw)
    if kind == "block":
        return OverlapTransformerBlock(16, 4, 16, num_kv_heads=nkv, norm="layernorm", sequence_parallel=sp, **kw)
    return OverlapMoE(8, 6, 4, 2, shared_expert_ffn=6, **kw)


def _dt_input_run(rank, ws, kind, sp, two_d, placement, nkv=1):
    """The layer on a DTensor x equals the layer on x's local tensor: output (a DTensor with x's
    placement and global shape), dx (a DTensor) and every parameter gradient, bit for bit."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh, axis, tp = _mesh(ws, two_d)
    tp_mesh = mesh["tp"] if two_d else mesh
    tws, trank = dist.get_world_size(tp), dist.get_rank(tp)
    layer = _dt_layer(kind, mesh, axis, sp, nkv)
    H = layer.hidden_size
    g = torch.Generator().manual_seed(23)
    B, S = 3, 4 * tws
    x, dy = (torch.randn(B, S, H, generator=g, dtype=torch.float64) for _ in range(2))
    pl = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[placement]
    loc = (lambda t: t) if placement == "replicate" else (lambda t: t.chunk(tws, pl.dim)[trank])  # noqa: E731
    xl, dyl = loc(x), loc(dy)
    # plain local tensors
    xp = xl.clone().requires_grad_()
    yp = layer(xp)
    yp.backward(dyl)
    grads = {n: p.grad.to_local().clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    # the same as DTensors (uneven Shard(0): B=3 rows on 2 ranks, torch.chunk's split)
    xd = DTensor.from_local(xl.clone(), tp_mesh, [pl], shape=x.shape, stride=x.stride()).requires_grad_()
    yd = layer(xd)
    assert isinstance(yd, DTensor) and yd.placements == (pl,) and yd.device_mesh == tp_mesh
    assert yd.shape == x.shape and torch.equal(yd.to_local(), yp.detach()), "forward differs"
    yd.backward(DTensor.from_local(dyl, tp_mesh, [pl], shape=dy.shape, stride=dy.stride()))
    assert isinstance(xd.grad, DTensor) and xd.grad.placements == (pl,)
    assert torch.equal(xd.grad.to_local(), xp.grad), "dx differs"
    for n, p in layer.named_parameters():
        assert torch.equal(p.grad.to_local(), grads[n]), n
    y_full = yd.full_tensor()  # the global output: every rank's local output, in place
    return y_full.shape == x.shape and torch.equal(loc(y_full), yp.detach())


@pytest.mark.parametrize("ws,kind,sp,two_d,placement,nkv", [
    (2, "mlp", True, False, "shard1", 1),
    (2, "mlp", False, False, "replicate", 1),
    (4, "mlp", True, True, "shard1", 1),        # 2-D (dp, tp) mesh: x on mesh["tp"]
    (2, "attention", True, False, "shard1", 1),  # replicated KV heads
    (2, "attention", False, False, "replicate", 2),
    (2, "moe", None, False, "shard0", 1),        # uneven: 3 batch rows on 2 ranks
    (2, "moe", None, False, "shard1", 1),
    (2, "ulysses", True, False, "shard1", 2),
    (2, "block", True, False, "shard1", 2),
    (4, "block", False, True, "replicate", 2),    # 2-D (dp, tp) mesh, no sequence parallelism
])
def test_dtensor_input_matches_local_input(pools, ws, kind, sp, two_d, placement, nkv):
    assert all(pools(ws).run(_dt_input_run, kind, sp, two_d, placement, nkv))


def _dt_bad_run(rank, ws, case):
    """A bad DTensor x: the ValueError message on this rank (None if none); then a good call on the
    same layer still works (no rank left inside a collective)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    two_d = case == "mesh"
    mesh, axis, tp = _mesh(ws, two_d)
    tp_mesh = mesh["tp"] if two_d else mesh
    kind = {"moe_replicate": "moe", "nosp_shard": "attention"}.get(case, "mlp")
    sp = case != "nosp_shard"
    if case == "group":
        torch.manual_seed(17)
        layer = OverlapMLP(8, 8, group=tp, num_tiles=2, dtype=torch.float64)
    else:
        layer = _dt_layer(kind, mesh, axis, sp)
    xl = torch.randn(2, 4, layer.hidden_size, dtype=torch.float64)
    if case == "mesh":
        x = DTensor.from_local(xl, mesh["dp"], [Shard(1)])
    elif case in ("placement", "moe_replicate"):
        x = DTensor.from_local(xl, tp_mesh, [Replicate()])
    elif case == "mixed":  # a DTensor on rank 0, a plain tensor elsewhere
        x = DTensor.from_local(xl, tp_mesh, [Shard(1)]) if rank == 0 else xl
    else:
        x = DTensor.from_local(xl, tp_mesh, [Shard(1)])
    try:
        layer(x)
        msg = None
    except ValueError as e:
        msg = str(e)
    y = layer(xl)  # the group still works
    return msg, tuple(y.shape)


@pytest.mark.parametrize("case,match", [
    ("placement", r"x: placement \(Replicate\(\),\).*takes Shard\(dim=1\)"),
    ("nosp_shard", r"x: placement \(Shard\(dim=1\),\).*sequence_parallel=False\) takes Replicate\(\)"),
    ("moe_replicate", r"x: placement \(Replicate\(\),\).*takes Shard\(dim=0\) or Shard\(dim=1\)"),
    ("mesh", r"x: a DTensor on .*not on this OverlapMLP's mesh axis.*Shard\(dim=1\)"),
    ("group", r"x: a DTensor, but this OverlapMLP was built with group=.*Shard\(dim=1\)"),
    ("mixed", r"DTensor or plain x.*x a DTensor differs across ranks"),
])
def test_bad_dtensor_input_raises_on_every_rank(pools, case, match):
    import re
    ws = 4 if case == "mesh" else 2
    for msg, shape in pools(ws).run(_dt_bad_run, case):
        assert msg is not None and re.search(match, msg), msg
        assert shape == (2, 4, 16 if case == "nosp_shard" else 8)


# ------------------------------------------------------------------ FSDP2 (dp) x tp: attention and MoE
def _fsdp_layer_run(rank, ws, kind, nkv, steps):
    """OverlapAttention (TP over heads, SP) or OverlapMoE (EP over tp) on a (dp=2, tp=2) mesh,
    fully_shard over dp, AdamW(foreach=False), against the dense float64 model in one process.
    Rank (dp_i, tp_i) holds the batch rows of dp_i and the sequence positions of tp_i; the loss is
    the mean over the batch of the summed squared error."""
    from attention_reference import dense_attention
    from moe_reference import dense_moe
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    mesh, _, tp = _mesh(ws, True)
    dp_i, tp_i = mesh.get_coordinate()
    dp = mesh["dp"].size()
    g = torch.Generator().manual_seed(31)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    if kind == "attention":
        H, nq, d = 16, 4, 4
        dense = dict(wq=r(nq * d, H) / 4, wk=r(nkv * d, H) / 4, wv=r(nkv * d, H) / 4, wo=r(H, nq * d) / 4,
                     bq=r(nq * d), bk=r(nkv * d), bv=r(nkv * d), bo=r(H), q_norm=1 + 0.3 * r(d),
                     k_norm=1 + 0.3 * r(d))
        layer = OverlapAttention.from_dense(**dense, num_heads=nq, num_kv_heads=nkv, mesh=mesh, axis="tp",
                                            num_tiles=2)
        ref_fn = lambda x, p: dense_attention(x, p["wq"], p["wk"], p["wv"], p["wo"], num_heads=nq,  # noqa: E731
                                              num_kv_heads=nkv, **{k: p[k] for k in ("bq", "bk", "bv", "bo",
                                                                                     "q_norm", "k_norm")})
    else:
        H, F, E, k = 8, 6, 4, 2
        dense = dict(router_weight=r(E, H), w_in=r(E, 2 * F, H) / 3, w_out=r(E, H, F) / 3,
                     shared_w_in=r(2 * F, H) / 3, shared_w_out=r(H, F) / 3)
        layer = OverlapMoE.from_dense(**dense, top_k=k, mesh=mesh, axis="tp", num_tiles=2)
        ref_fn = lambda x, p: dense_moe(x, p["router_weight"], p["w_in"], p["w_out"], top_k=k,  # noqa: E731
                                        shared_w_in=p["shared_w_in"], shared_w_out=p["shared_w_out"])[0]
    B, S = 4, 8
    xs, ts = [r(B, S, H) for _ in range(steps)], [r(B, S, H) for _ in range(steps)]
    fully_shard(layer, mesh=mesh["dp"])
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=False)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in dense.items()}
    ref_opt = torch.optim.AdamW(ref.values(), lr=1e-2, foreach=False)
    for x, t in zip(xs, ts):
        xl = x.chunk(dp, 0)[dp_i].chunk(2, 1)[tp_i]
        tl = t.chunk(dp, 0)[dp_i].chunk(2, 1)[tp_i]
        loss = ((layer(xl) - tl) ** 2).sum() * (dp / B)  # FSDP averages over dp: mean over the batch
        loss.backward()
        # attention: the tp partials (bo under SP, q_norm / k_norm, replicated KV heads); MoE: the
        # router and shared expert hold this rank's tokens' partial, summed over the EP (tp) group
        finalize_grads(layer, data_parallel=kind == "moe")
        opt.step()
        opt.zero_grad()
        (((ref_fn(x, ref) - t) ** 2).sum() / B).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    errs = {}
    for n, p in layer.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.ndim == 2, (n, type(p))
        errs[n] = (p.full_tensor().reshape(ref[n].shape) - ref[n].detach()).abs().max().item()
    moved = min((ref[n].detach() - dense[n]).abs().max().item() for n in ref)
    placements = {n: str(p.placements) for n, p in layer.named_parameters()}
    return errs, moved, placements


@pytest.mark.parametrize("kind,nkv", [("attention", 1), ("attention", 2), ("moe", None)])
def test_fsdp2_over_dp_with_tp_attention_and_moe_match_dense(pool4, kind, nkv):
    """nkv=1 on tp=2: replicated KV heads (Replicate on tp); nkv=2: Shard(0); MoE: experts Shard(0)
    over tp (expert parallel), router and shared expert Replicate."""
    for errs, moved, placements in pool4.run(_fsdp_layer_run, kind, nkv, 3):
        assert moved > 1e-3  # every parameter moved
        assert max(errs.values()) < 1e-10, errs
    if kind == "attention":
        assert "Replicate" in placements["wk"] if nkv == 1 else "Replicate" not in placements["wk"], placements


# ------------------------------------------------------------------ FSDP2 mixed precision (bf16 params, fp32 reduce)
def _fsdp_mp_run(rank, ws, steps):
    """OverlapMLP (swiglu, SP) on a (dp=2, tp=2) mesh, fully_shard over dp with
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), against the dense fp32 MLP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh, _, tp = _mesh(ws, True)
    dp_i, tp_i = mesh.get_coordinate()
    dp = mesh["dp"].size()
    g = torch.Generator().manual_seed(41)
    H, F, B, S = 16, 16, 4, 8
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)  # noqa: E731
    dense = dict(w_in=r(2 * F, H) / math.sqrt(H), w_out=r(H, F) / math.sqrt(F), b_in=r(2 * F), b_out=r(H))
    xs, ts = [r(B, S, H) for _ in range(steps)], [r(B, S, H) for _ in range(steps)]
    layer = OverlapMLP.from_dense(**dense, mesh=mesh, axis="tp", activation="swiglu", num_tiles=2)
    fully_shard(layer, mesh=mesh["dp"],
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=False)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in dense.items()}
    ref_opt = torch.optim.AdamW(ref.values(), lr=1e-2, foreach=False)
    out = dict(y_dtype=set(), grad_dtypes=set(), param_dtypes=set(), y_err=[], loss=[], grad_err=[])
    for x, t in zip(xs, ts):
        xl = x.chunk(dp, 0)[dp_i].chunk(2, 1)[tp_i]  # fp32: FSDP casts the input to bf16
        tl = t.chunk(dp, 0)[dp_i].chunk(2, 1)[tp_i]
        y = layer(xl)
        out["y_dtype"].add(y.dtype)
        loss = ((y.float() - tl) ** 2).sum() * (dp / B)
        loss.backward()
        finalize_grads(layer)
        grads = {n: p.grad.full_tensor().reshape(ref[n].shape) for n, p in layer.named_parameters()}
        out["grad_dtypes"] |= {p.grad.dtype for p in layer.parameters()}
        opt.step()
        opt.zero_grad()
        out["param_dtypes"] |= {p.dtype for p in layer.parameters()}
        pre = x @ ref["w_in"].T + ref["b_in"]
        y_ref = torch.nn.functional.silu(pre[..., :F]) * pre[..., F:]
        y_ref = y_ref @ ref["w_out"].T + ref["b_out"]
        ref_loss = ((y_ref - t) ** 2).sum() / B
        ref_loss.backward()
        yr = y_ref.detach().chunk(dp, 0)[dp_i].chunk(2, 1)[tp_i]
        out["y_err"].append(((y.float() - yr).norm() / yr.norm()).item())
        full_loss = loss.detach().clone()
        dist.all_reduce(full_loss)
        out["loss"].append((full_loss.item() / dp, ref_loss.item()))
        out["grad_err"].append(max(((grads[n] - ref[n].grad).norm() / ref[n].grad.norm()).item() for n in ref))
        ref_opt.step()
        ref_opt.zero_grad()
    out["param_err"] = max(((p.full_tensor().reshape(ref[n].shape) - ref[n].detach()).norm()
                            / (ref[n].detach() - dense[n]).norm()).item() for n, p in layer.named_parameters())
    return out


def test_fsdp2_mixed_precision_bf16_params_fp32_reduce_mlp(pool4):
    """bf16 compute and outputs, fp32 gradients and parameters; close to the dense fp32 model
    (bf16 tolerances: relative errors of outputs, losses and gradients a few 1e-3; the parameters'
    difference small against how far the optimizer moved them)."""
    for out in pool4.run(_fsdp_mp_run, 3):
        assert out["y_dtype"] == {torch.bfloat16}, out["y_dtype"]
        assert out["grad_dtypes"] == {torch.float32} and out["param_dtypes"] == {torch.float32}, out
        assert max(out["y_err"]) < 2e-2, out["y_err"]
        assert all(abs(a - b) < 2e-2 * abs(b) for a, b in out["loss"]), out["loss"]
        assert max(out["grad_err"]) < 3e-2, out["grad_err"]
        assert out["param_err"] < 0.1, out["param_err"]


def _dt_checkpoint_run(rank, ws):
    """A DTensor input under activation checkpointing while first-call verification cycles K=2 /
    K=1: every recomputation replays its own forward's plan (no CheckpointError), and the results
    equal the plain (not checkpointed) layer's on the same calls."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.utils.checkpoint import checkpoint
    from overlap_layers.planning.plan import TilePlan
    mesh, axis, tp = _mesh(ws, False)
    layers = []
    for _ in range(2):
        layer = _dt_layer("mlp", mesh, axis, True)
        layer.num_tiles = "auto"
        layer.planner.make_plan = lambda *key: TilePlan(2, reason="forced by the test")
        layers.append(layer)
    g = torch.Generator().manual_seed(5)
    ks = []
    for call in range(8):
        x, dy = (torch.randn(2, 4 * ws, 8, generator=g, dtype=torch.float64) for _ in range(2))
        xl, dyl = x.chunk(ws, 1)[rank], dy.chunk(ws, 1)[rank]
        outs = []
        for ck, layer in zip((False, True), layers):
            layer.zero_grad(set_to_none=True)
            xd = DTensor.from_local(xl.clone(), mesh, [Shard(1)], shape=x.shape, stride=x.stride()).requires_grad_()
            yd = checkpoint(layer, xd, use_reentrant=False) if ck else layer(xd)
            yd.backward(DTensor.from_local(dyl, mesh, [Shard(1)], shape=dy.shape, stride=dy.stride()))
            outs.append((yd.to_local().detach(), xd.grad.to_local(),
                         {n: p.grad.to_local() for n, p in layer.named_parameters()}, layer.plan.num_tiles))
        (y0, dx0, g0, k0), (y1, dx1, g1, k1) = outs
        assert k0 == k1 and torch.allclose(y0, y1) and torch.allclose(dx0, dx1), call
        assert all(torch.allclose(g0[n], g1[n]) for n in g0), call
        ks.append(k1)
    return ks


def test_dtensor_input_under_checkpoint_during_verification(pool2):
    for ks in pool2.run(_dt_checkpoint_run):
        assert ks[:6] == [2, 1, 2, 2, 1, 1], ks  # a warm-up call each, then each twice in a row


# ------------------------------------------------------------------ foreach / fused optimizers
def _optim_run(rank, ws):
    """A model mixing a mesh= layer (DTensor parameters) and a plain LayerNorm: AdamW with
    foreach=True and fused=True on ``param_groups(model)`` step like foreach=False on one list;
    on one list they raise (the case param_groups exists for)."""
    from overlap_layers import param_groups
    mesh, _, _ = _mesh(ws, False)
    out = {}
    for kw in (dict(foreach=False), dict(foreach=True), dict(fused=True)):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.LayerNorm(8, dtype=torch.float64),
                                    OverlapMLP(8, 8 * ws, mesh=mesh, sequence_parallel=False, num_tiles=1,
                                               dtype=torch.float64))
        groups = param_groups(model, lr=1e-2) if kw.get("foreach", True) else [dict(params=model.parameters())]
        opt = torch.optim.AdamW(groups, lr=1e-2, **kw)
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        for _ in range(2):
            opt.zero_grad()
            model(x).square().sum().backward()
            finalize_grads(model)
            opt.step()
        out[str(kw)] = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]
    try:
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True).step()
        out["mixed"] = None
    except RuntimeError as e:
        out["mixed"] = str(e)
    want = out["{'foreach': False}"]
    same = {k: all(torch.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(v, want))
            for k, v in out.items() if k.startswith("{")}
    return same, out["mixed"], [len(g["params"]) for g in param_groups(model)]


def test_param_groups_make_foreach_and_fused_adamw_work(pool2):
    for same, mixed, sizes in pool2.run(_optim_run):
        assert all(same.values()), same
        assert mixed is not None and "mixed torch.Tensor and DTensor" in mixed
        assert sizes == [2, 2]  # w_in, w_out (DTensors); the LayerNorm's weight and bias


def _locals_forward_run(rank, ws):
    """``distribute_params`` on a LayerNorm and a Linear: the modules compute on their parameters'
    local tensors through a ``forward`` of their class (no hooks, so ``nn.Module.__call__`` keeps its
    fast path; a subclass of the same name, one per class), the DTensors back in place after a call
    that returns and after one that raises; an in-place optimizer step and a
    replaced parameter are seen at the next call; a deep copy computes on its own parameters; the
    model has no reference cycle (freed by reference counting alone)."""
    import copy
    import gc
    import weakref

    from torch.distributed.tensor import DTensor

    from overlap_layers import distribute_params
    torch.manual_seed(5)
    dense = torch.nn.Sequential(torch.nn.LayerNorm(8, dtype=torch.float64), torch.nn.Linear(8, 4, dtype=torch.float64))
    model = distribute_params(copy.deepcopy(dense), dist.group.WORLD)
    x = torch.randn(3, 8, dtype=torch.float64)
    out = {"equal": torch.equal(model(x), dense(x)),
           "dtensors after a call": all(isinstance(p, DTensor) for p in model.parameters()),
           "no hooks": not any(m._forward_hooks or m._forward_pre_hooks for m in model),
           "the class's name": type(model[0]).__name__ == "LayerNorm" and isinstance(model[0], torch.nn.LayerNorm),
           "one class per class": type(distribute_params(torch.nn.LayerNorm(8), dist.group.WORLD)) is type(model[0])
           and type(model[0]) is not torch.nn.LayerNorm}
    try:
        model[1](torch.randn(3, 5, dtype=torch.float64))
    except RuntimeError:
        out["dtensors after a raise"] = all(isinstance(p, DTensor) for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(dense.parameters(), lr=0.1)
    for m, o in ((model, opt), (dense, ref)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    with torch.no_grad():
        out["after a step"] = torch.allclose(model(x), dense(x), rtol=1e-12, atol=0)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[1].bias.zero_()
        out["a copy's own parameters"] = not torch.equal(twin(x), model(x)) and torch.allclose(
            twin(x), model(x) - model[1].bias.to_local(), rtol=0, atol=1e-12)
        model[1].bias = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, dtype=torch.float64),
                                                              model[1].bias.device_mesh, model[1].bias.placements))
        out["a replaced parameter"] = torch.equal(model(x), twin(x))
    gone = weakref.ref(model[1])
    gc.disable()
    try:
        del model, opt
        out["no cycle"] = gone() is None
    finally:
        gc.enable()
    return out


def test_modules_outside_the_layers_compute_on_locals(pool2):
    for out in pool2.run(_locals_forward_run):
        assert all(out.values()) and len(out) == 10, out
