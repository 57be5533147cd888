"""Tier 2: OverlapTransformerBlock on 2 and 4 gloo ranks against a dense single-process block
written out here (float64): pre-norm attention and MLP / MoE with residuals.

The sublayers get known dense weights through their ``from_dense``; what each rank must hold:
  y, x.grad                      the reference's, sliced to the rank's positions under sequence
                                 parallelism, whole otherwise
  norm weight / bias grads       the reference's full gradient, after finalize_grads
  MoE router_weight.grad         the reference's full gradient, after finalize_grads
  attention wo.grad, MLP w_out   the reference's gradient, sliced to the rank's columns (heads /
  .grad, MoE w_out.grad          ffn columns / experts)
"""
import math

import pytest
import torch
import torch.distributed as dist

from attention_reference import bad_call_input
from block_reference import D, E, EPS, F, H, NKV, NQ, THETA, TOPK, make_case, reference
from pool import expect_value_error_on_every_rank

from overlap_layers import OverlapAttention, OverlapMLP, OverlapMoE, OverlapTransformerBlock, finalize_grads

def build(c, sp, k):
    group = dist.group.WORLD
    moe = dict(num_experts=E, top_k=TOPK) if c["moe"] else None
    blk = OverlapTransformerBlock(H, NQ, F, num_kv_heads=NKV, moe=moe, norm=c["norm"], norm_eps=EPS, group=group,
                                  sequence_parallel=sp, rope_theta=THETA, num_tiles=k, dtype=torch.float64)
    blk.attention = OverlapAttention.from_dense(c["wq"], c["wk"], c["wv"], c["wo"], num_heads=NQ, num_kv_heads=NKV,
                                                group=group, sequence_parallel=sp, rope_theta=THETA, num_tiles=k)
    if c["moe"]:
        blk.mlp = OverlapMoE.from_dense(c["router"], c["w_in"], c["w_out"], top_k=TOPK, group=group, num_tiles=k)
    else:
        blk.mlp = OverlapMLP.from_dense(c["w_in"], c["w_out"], group=group, sequence_parallel=sp, activation="swiglu",
                                        num_tiles=k)
    with torch.no_grad():
        for norm, w, b in ((blk.attn_norm, c["an_w"], c["an_b"]), (blk.mlp_norm, c["mn_w"], c["mn_b"])):
            norm.weight.copy_(w)
            if b is not None:
                norm.bias.copy_(b)
    return blk


def run_block(rank, ws, c, sp, k):
    blk = build(c, sp, k)
    S = c["x"].shape[1]
    own = slice(rank * S // ws, (rank + 1) * S // ws) if sp else slice(None)
    x = c["x"][:, own].clone().requires_grad_()
    y = blk(x)
    (y * c["dy"][:, own]).sum().backward()
    finalize_grads(blk)
    out = dict(y=y.detach(), dx=x.grad, an_w=blk.attn_norm.weight.grad, mn_w=blk.mlp_norm.weight.grad,
               an_b=None if blk.attn_norm.bias is None else blk.attn_norm.bias.grad,
               mn_b=None if blk.mlp_norm.bias is None else blk.mlp_norm.bias.grad,
               wo=blk.attention.wo.grad, w_out=blk.mlp.w_out.grad)
    if c["moe"]:
        out["router"] = blk.mlp.router_weight.grad
    return out


def check(results, c, sp):
    y_ref, g = reference(c)
    ws, S = len(results), c["x"].shape[1]
    fails = []

    def close(name, got, want):
        err = ((got - want).norm() / max(want.norm().item(), 1e-12)).item() if got is not None else math.inf
        if not err < 1e-9:
            fails.append(f"{name}: relative error {err:.2e}")

    for rank, res in enumerate(results):
        own = slice(rank * S // ws, (rank + 1) * S // ws) if sp else slice(None)
        close(f"rank {rank} y", res["y"], y_ref[:, own])
        close(f"rank {rank} dx", res["dx"], g["x"][:, own])
        for n in ("an_w", "mn_w", "an_b", "mn_b") + (("router",) if c["moe"] else ()):
            if g[n] is not None:
                close(f"rank {rank} {n}.grad", res[n], g[n])
        d = NQ // ws * D
        close(f"rank {rank} wo.grad", res["wo"], g["wo"][:, rank * d:(rank + 1) * d])
        if c["moe"]:
            close(f"rank {rank} moe w_out.grad", res["w_out"], g["w_out"][rank * E // ws:(rank + 1) * E // ws])
        else:
            close(f"rank {rank} mlp w_out.grad", res["w_out"], g["w_out"][:, rank * F // ws:(rank + 1) * F // ws])
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("sp", [True, False])
@pytest.mark.parametrize("moe,norm,k", [(False, "rmsnorm", 1), (False, "layernorm", 2), (True, "rmsnorm", 2),
                                        (True, "layernorm", 1)])
def test_block_matches_dense_block(pool2, sp, moe, norm, k):
    c = make_case(1, moe=moe, norm=norm)
    check(pool2.run(run_block, c, sp, k), c, sp)


@pytest.mark.parametrize("moe", [False, True])
def test_block_four_ranks(pool4, moe):
    c = make_case(2, moe=moe, S=8)
    check(pool4.run(run_block, c, True, 2), c, True)


@pytest.mark.parametrize("moe,k,empty", [(False, "auto", "batch"), (False, "auto", "seq"), (True, "auto", "batch"),
                                         (False, 2, "seq")])
def test_block_without_tokens_matches_dense_block(pool2, moe, k, empty):
    """No batch rows or no positions, with the fused program allowed (K "auto") or not: the
    reference's empty y and dx, and its zero gradients (a missing one fails)."""
    c = make_case(3, moe=moe, B=0 if empty == "batch" else 2, S=0 if empty == "seq" else 8)
    check(pool2.run(run_block, c, True, k), c, True)


def bad_args(rank, ws):
    msgs = []
    for kw in (dict(norm="batchnorm"), dict(norm_eps=0), dict(moe=dict(num_experts=4)),
               dict(moe=dict(num_experts=4, top_k=2, experts_per_rank=2)), dict(moe=[4, 2]),
               dict(norm_eps=float("inf")), dict(dtype=torch.int32)):
        try:
            OverlapTransformerBlock(H, NQ, F, group=dist.group.WORLD, **kw)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_arguments_raise_value_error(pool2):
    for msgs in pool2.run(bad_args):
        norm, eps, missing, unknown, not_dict, eps_inf, dtype = msgs
        assert norm and "norm='batchnorm'" in norm and "rmsnorm" in norm
        assert eps and "norm_eps=0" in eps
        assert missing and "missing keys ['top_k']" in missing
        assert unknown and "experts_per_rank" in unknown
        assert not_dict and "moe=[4, 2]" in not_dict
        assert eps_inf and "norm_eps=inf" in eps_inf
        assert dtype and "dtype=torch.int32" in dtype and "floating-point" in dtype


def _call_with(rank, ws, name, moe):
    block = OverlapTransformerBlock(8, 2, 16, moe=dict(num_experts=4, top_k=2) if moe else None,
                                    group=dist.group.WORLD, num_tiles=2)
    x, kw = bad_call_input(rank, ws, name)
    block(x, **kw)


@pytest.mark.parametrize("name,match", [("hidden", "hidden"), ("hidden_rank1", "hidden"), ("rank0_2d", "3-D"),
                                        ("rank0_none", "3-D"), ("int", "dtype"), ("dtype_rank1", "dtype"),
                                        ("device", "device"), ("seq", "seq"), ("position_ids", "position_ids must")])
@pytest.mark.parametrize("moe", [False, True])
def test_bad_input_raises_on_every_rank(pool2, name, match, moe):
    """An input the attention's agreement rejects raises ValueError on every rank, also where the
    attention's norm, which runs first, could not take it on one rank (a hidden size of 6 on rank
    1: the others would wait in the agreement)."""
    expect_value_error_on_every_rank(pool2, _call_with, name, moe, match=match)


def mesh_vs_group(rank, ws, moe, sp):
    """The block built with mesh= (DTensor parameters) against the same block with group=."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    kw = dict(num_kv_heads=NKV, moe=dict(num_experts=E, top_k=TOPK) if moe else None, norm="layernorm",
              sequence_parallel=sp, num_tiles=2, dtype=torch.float64)
    torch.manual_seed(0)
    on_mesh = OverlapTransformerBlock(H, NQ, F, mesh=mesh, **kw)
    torch.manual_seed(0)
    on_group = OverlapTransformerBlock(H, NQ, F, group=dist.group.WORLD, **kw)
    with torch.no_grad():  # non-trivial norms, the same on both
        for blk in (on_mesh, on_group):
            for i, n in enumerate((blk.attn_norm, blk.mlp_norm)):
                for p in (n.weight, n.bias):
                    _local_of(p).add_(0.1 * (i + 1))
    not_dt = [n for n, p in on_mesh.named_parameters() if not isinstance(p, DTensor)]
    rebuilt = OverlapTransformerBlock.from_layers(on_mesh.attention, on_mesh.mlp, norm="layernorm")
    not_dt += [f"from_layers {n}" for n, p in rebuilt.named_parameters() if not isinstance(p, DTensor)]
    g = torch.Generator().manual_seed(3)
    S = 8 // ws if sp else 8
    x = torch.randn(2, S, H, generator=g, dtype=torch.float64)
    dy = torch.randn(2, S, H, generator=g, dtype=torch.float64)
    outs = []
    for blk in (on_mesh, on_group):
        xi = x.clone().requires_grad_()
        y = blk(xi)
        y.backward(dy)
        finalize_grads(blk)
        outs.append((y.detach(), xi.grad, {n: _local_of(p.grad) for n, p in blk.named_parameters()}))
    (ym, dxm, gm), (yg, dxg, gg) = outs
    return dict(not_dt=not_dt, y=torch.equal(ym, yg), dx=torch.equal(dxm, dxg),
                # flat: the mesh swiglu w_in's local view is [2, F/ws, H], the group one's [2*F/ws, H]
                grads=[n for n in gg if not torch.equal(gm[n].reshape(-1), gg[n].reshape(-1))])


def _local_of(t):
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.parametrize("moe,sp", [(False, True), (True, False)])
def test_block_with_mesh_holds_dtensors_and_equals_group_block(pool2, moe, sp):
    for res in pool2.run(mesh_vs_group, moe, sp):
        assert res["not_dt"] == [], res["not_dt"]
        assert res["y"] and res["dx"] and res["grads"] == [], res


# ------------------------------------------------------------------ the fused program ([Note: fused block])
def run_fused(rank, ws, c, calls, mlp_k=2, grad=True):
    """``calls`` calls (forward and backward) of a block whose sublayers report settled K=2 plans,
    with the block's verification over one trial each: the block times the fused program against
    its sublayers in turn, so both run. Per call: the block's plan, y and the gradients, and the
    launch order of the collectives when it ran fused."""
    from overlap_layers.planning.plan import TilePlan
    from overlap_layers.planning.plan_cache import PlanCache
    blk = build(c, True, "auto")
    blk.attention.settled_plan = lambda *a: TilePlan(2)
    blk.mlp.settled_plan = lambda *a: TilePlan(mlp_k)
    blk._fusion.plans_agreement = blk.attention.planner.agreement
    blk._fusion.plans = PlanCache(blk.attention.planner.agreement, trials=1)
    S = c["x"].shape[1]
    own = slice(rank * S // ws, (rank + 1) * S // ws)
    out = []
    for _ in range(calls):
        blk.zero_grad()
        log = blk.attention.launch_log = []
        x = c["x"][:, own].clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            y = blk(x)
        if grad:
            (y * c["dy"][:, own]).sum().backward()
            finalize_grads(blk)
        out.append(dict(plan=blk.plan.label, reason=blk.plan.reason, y=y.detach(), dx=x.grad,
                        an_w=blk.attn_norm.weight.grad,
                        mn_w=blk.mlp_norm.weight.grad,
                        an_b=None if blk.attn_norm.bias is None else blk.attn_norm.bias.grad,
                        mn_b=None if blk.mlp_norm.bias is None else blk.mlp_norm.bias.grad,
                        wo=blk.attention.wo.grad, w_out=blk.mlp.w_out.grad,
                        comms=[f"{name}[{t}]" for t, name, kind in log if kind == "comm"]))
    blk.attention.launch_log = None
    return out


FUSED_ORDER = {  # the collectives of a fused call in launch order, forward then backward
    2: ["a.ag[0]", "a.ag[1]", "a.rs[0]", "m0.ag[0]", "a.rs[1]", "m0.ag[1]", "m0.rs[0]", "m0.rs[1]",
        "m0.ag_dy[0]", "m0.ag_dy[1]", "m0.rs_dx[0]", "a.ag_dy[0]", "m0.rs_dx[1]", "a.ag_dy[1]", "a.rs_dx[0]",
        "a.rs_dx[1]"],
    4: ["a.ag[0]", "a.ag[1]", "a.rs[0]", "m0.ag[0]", "m1.ag[0]", "a.rs[1]", "m0.ag[1]", "m1.ag[1]",
        "m0.rs[0]", "m0.rs[1]", "m1.rs[0]", "m1.rs[1]",
        "m0.ag_dy[0]", "m1.ag_dy[0]", "m0.ag_dy[1]", "m1.ag_dy[1]", "m0.rs_dx[0]", "m0.rs_dx[1]",
        "m1.rs_dx[0]", "a.ag_dy[0]", "m1.rs_dx[1]", "a.ag_dy[1]", "a.rs_dx[0]", "a.rs_dx[1]"]}


VERIFYING = ["fused K=2", "sublayers in turn"] + ["fused K=2"] * 2 + ["sublayers in turn"] * 2  # one trial each


@pytest.mark.parametrize("norm,mlp_k,batch", [("rmsnorm", 2, 2), ("layernorm", 2, 2), ("rmsnorm", 4, 2),
                                              ("layernorm", 4, 3)])
def test_fused_block_matches_dense_block(pool2, norm, mlp_k, batch):
    """The fused program (the attention at K=2, each of its tiles one or two MLP tiles) equals the
    dense block, forward and gradients, and runs the seam in the interleaved order: the
    attention's reduce-scatter of tile 0, then the MLP's all-gathers of tile 0, before the
    attention's reduce-scatter of tile 1 (backward: the MLP's last dx reduce-scatter of a tile,
    then the attention's all-gather of that tile's dy). Batch 3: tiles of 2 and 1 sequences."""
    c = make_case(3, norm=norm, B=batch)
    res = pool2.run(run_fused, c, 7, mlp_k)
    labels = [r["plan"] for r in res[0]]  # each contender once, then twice (the second call timed), then the faster
    assert labels[:6] == VERIFYING and labels[6] in VERIFYING, labels
    assert "verified on the first calls (forward+backward" in res[0][6]["reason"]  # the backward was timed too
    for i, label in enumerate(labels):
        check([r[i] for r in res], c, True)
        if label == "fused K=2":
            assert res[0][i]["comms"] == FUSED_ORDER[mlp_k]
        else:
            assert not any(n.startswith(("a.", "m.")) for n in res[0][i]["comms"])


def test_fused_block_without_grad_matches_dense_block(pool2):
    """Under no_grad (inference) the fused calls give the dense block's y."""
    c = make_case(4, norm="rmsnorm")
    y_ref, _ = reference(c)
    res = pool2.run(run_fused, c, 7, 4, False)
    S = c["x"].shape[1]
    for rank, calls in enumerate(res):
        assert [r["plan"] for r in calls][:6] == VERIFYING
        assert "(forward," in calls[6]["reason"]  # nothing to time backward
        for r in calls:
            want = y_ref[:, rank * S // 2:(rank + 1) * S // 2]
            assert ((r["y"] - want).norm() / want.norm()).item() < 1e-9


def run_traced(rank, ws, c, tmp):
    """One fused call (the block's first verification call) after ``export_trace(measured=True)``
    on both sublayers: the traces each file holds, and the requests left pending."""
    import json
    from overlap_layers.planning.plan import TilePlan
    blk = build(c, True, "auto")
    blk.attention.settled_plan = blk.mlp.settled_plan = lambda *a: TilePlan(2)
    paths = [f"{tmp}/attn{rank}.json", f"{tmp}/mlp{rank}.json"]
    blk.attention.export_trace(paths[0], measured=True)
    blk.mlp.export_trace(paths[1], measured=True)
    S = c["x"].shape[1]
    x = c["x"][:, rank * S // ws:(rank + 1) * S // ws].clone().requires_grad_()
    blk(x).sum().backward()
    names = [sorted({e["name"] for e in json.load(open(p))["traceEvents"] if e.get("ph") == "X"}) for p in paths]
    return blk.plan.label, names, blk.attention.planner.trace_to, blk.mlp.planner.trace_to


def test_fused_call_writes_the_sublayers_measured_traces(pool2, tmp_path):
    """export_trace(measured=True) asked of a sublayer is answered by a fused call too: its file
    holds the fused program's measured ops, both sublayers' (scoped a. and m0.), forward and backward."""
    for label, names, *pending in pool2.run(run_traced, make_case(9, norm="rmsnorm"), str(tmp_path)):
        assert label == "fused K=2" and pending == [None, None]
        assert names[0] == names[1]
        for op in ("a.qkv", "a.proj", "residual_norm", "m0.fc1", "a.dgrad_o", "norm_backward", "m0.wgrad1"):
            assert any(n.startswith(op) for n in names[0]), (op, names[0])


def run_fused_biases(rank, ws, calls):
    """A block whose attention and MLP have biases (randomly drawn, the same on every rank), the
    sublayers reporting settled K=2 plans: per call, the plan, y and every gradient."""
    from overlap_layers.planning.plan import TilePlan
    torch.manual_seed(5)
    group = dist.group.WORLD
    attn = OverlapAttention(H, NQ, NKV, group=group, rope_theta=THETA, bias=True, qk_norm=True, dtype=torch.float64)
    mlp = OverlapMLP(H, F, group=group, bias=True, dtype=torch.float64)
    with torch.no_grad():
        for p in (*attn.parameters(), *mlp.parameters()):
            p.normal_(0, 0.3)  # biases of 0 would hide a missing bias
    blk = OverlapTransformerBlock.from_layers(attn, mlp, norm="layernorm")
    attn.settled_plan = mlp.settled_plan = lambda *a: TilePlan(2)
    gen = torch.Generator().manual_seed(6)
    x0 = torch.randn(2, 8 // ws, H, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, 8 // ws, H, generator=gen, dtype=torch.float64)
    out = []
    for _ in range(calls):
        blk.zero_grad()
        x = x0.clone().requires_grad_()
        y = blk(x)
        y.backward(dy)
        out.append(dict(plan=blk.plan.label, y=y.detach(), dx=x.grad,
                        grads={n: p.grad.clone() for n, p in blk.named_parameters()}))
    return out


def test_fused_block_biases_equal_the_sublayers_in_turn(pool2):
    """With every bias (q, k, v, o, the MLP's in and out, LayerNorm's) and qk-norm, the fused calls give the
    y and gradients of the calls that ran the sublayers in turn (checked against dense blocks
    above and, with biases, per sublayer in their own tests)."""
    res = pool2.run(run_fused_biases, 5)
    for r in res:
        fused = [c for c in r if c["plan"] == "fused K=2"]
        turn = [c for c in r if c["plan"] == "sublayers in turn"]
        assert fused and turn
        ref = turn[0]
        for c in fused:
            assert torch.allclose(c["y"], ref["y"], rtol=1e-10, atol=1e-12)
            assert torch.allclose(c["dx"], ref["dx"], rtol=1e-10, atol=1e-12)
            assert ref["grads"].keys() == c["grads"].keys()
            for n, g in ref["grads"].items():
                assert torch.allclose(c["grads"][n], g, rtol=1e-10, atol=1e-12), n


def run_hooked(rank, ws):
    """A block whose attention carries a forward pre-hook (as FSDP2's unsharding does), with the
    sublayers reporting settled K=2 plans: the block's plan per call and the hook's call count."""
    from overlap_layers.planning.plan import TilePlan
    blk = build(make_case(1), True, "auto")
    blk.attention.settled_plan = blk.mlp.settled_plan = lambda *a: TilePlan(2)
    seen = []
    blk.attention.register_forward_pre_hook(lambda m, args: seen.append(1))
    plans = []
    for _ in range(5):
        x = torch.randn(2, 8 // ws, H, dtype=torch.float64, requires_grad=True)
        blk(x).sum().backward()
        plans.append(blk.plan)
    return plans, len(seen)


def test_block_with_hooked_sublayer_runs_them_in_turn(pool2):
    """A sublayer with module hooks is always called as a module: the block never fuses it."""
    for plans, hooked in pool2.run(run_hooked):
        assert plans == [None] * 5 and hooked == 5


def run_fused_fsdp(rank, ws, calls):
    """A ``group=`` block on tp (2 ranks), under ``fully_shard`` over dp (2): FSDP2's hooks sit on
    the block, so its sublayers may fuse (settled K=2 plans reported). Per call: the block's plan,
    y, and every parameter's gradient in full (reduced over dp by FSDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from overlap_layers.planning.plan import TilePlan
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    torch.manual_seed(7)
    blk = OverlapTransformerBlock(H, NQ, F, num_kv_heads=NKV, group=tp, rope_theta=THETA, num_tiles="auto",
                                  dtype=torch.float64)
    blk.attention.settled_plan = blk.mlp.settled_plan = lambda *a: TilePlan(2)
    fully_shard(blk, mesh=mesh["dp"])
    dp_i, tp_i = mesh.get_coordinate()
    gen = torch.Generator().manual_seed(8 + dp_i)
    x0 = torch.randn(2, 8, H, generator=gen, dtype=torch.float64)[:, tp_i * 4:(tp_i + 1) * 4]
    out = []
    for _ in range(calls):
        blk.zero_grad()
        x = x0.clone().requires_grad_()
        y = blk(x)
        (y ** 2).sum().backward()
        out.append(dict(plan=blk.plan.label, y=y.detach(), dx=x.grad,
                        grads={n: p.grad.full_tensor() for n, p in blk.named_parameters()}))
    return out


def test_fused_block_under_fsdp2_equals_the_sublayers_in_turn(pool4):
    """FSDP2 (``fully_shard`` on the block, over dp) with the block's sublayers on tp: the fused
    calls give the y, dx and (dp-reduced) gradients of the calls that ran the sublayers in turn."""
    for calls in pool4.run(run_fused_fsdp, 5):
        fused = [c for c in calls if c["plan"] == "fused K=2"]
        turn = [c for c in calls if c["plan"] == "sublayers in turn"]
        assert len(fused) >= 2 and len(turn) >= 2
        ref = turn[0]
        for c in fused:
            assert torch.allclose(c["y"], ref["y"], rtol=1e-10, atol=1e-12)
            assert torch.allclose(c["dx"], ref["dx"], rtol=1e-10, atol=1e-12)
            for n, g in ref["grads"].items():
                assert torch.allclose(c["grads"][n], g, rtol=1e-10, atol=1e-12), n


def test_fused_plans_by_hand():
    """Which sublayer plans fuse, and how many MLP tiles each attention tile carries."""
    from overlap_layers.layers.block.fused import fused_plans
    from overlap_layers.planning.plan import TilePlan
    a2, m8 = TilePlan(2, buckets_fwd=(("ag", ((0, 1),)),)), TilePlan(8, buckets_bwd=(("rs_dx", ((0, 1), (2, 3))),))
    pa, pm = fused_plans(a2, m8, tile_rows=100)
    assert (pa.num_tiles, pm.num_tiles) == (2, 8) and not pa.buckets_fwd and not pm.buckets_bwd  # 4 per tile
    assert fused_plans(a2, TilePlan(3), tile_rows=100)[1].num_tiles == 2  # 3 // 2 = 1 per tile
    assert fused_plans(a2, TilePlan(1), tile_rows=100)[1].num_tiles == 2  # at least 1 per tile
    assert fused_plans(a2, m8, tile_rows=3)[1].num_tiles == 6  # no MLP tile without rows
    for a, m in ((TilePlan(1), m8), (a2, TilePlan(2, regather=True)), (TilePlan(2, regather=True), m8),
                 (TilePlan(2, decomposition="rank", transport="copy_engine"), m8),
                 (a2, TilePlan(1, decomposition="rank", transport="nccl"))):
        assert fused_plans(a, m, tile_rows=100) is None
