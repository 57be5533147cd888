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

from attention_reference import dense_attention
from moe_reference import dense_moe

from overlap_layers import OverlapAttention, OverlapMLP, OverlapMoE, OverlapTransformerBlock, finalize_grads

H, NQ, NKV, D, F, E, TOPK, EPS, THETA = 16, 4, 2, 4, 8, 4, 2, 1e-5, 10000.0


def make_case(seed, *, B=2, S=8, moe=False, norm="rmsnorm"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    c = dict(x=r(B, S, H), dy=r(B, S, H), norm=norm, moe=moe,
             an_w=1 + 0.1 * r(H), mn_w=1 + 0.1 * r(H),
             an_b=0.1 * r(H) if norm == "layernorm" else None, mn_b=0.1 * r(H) if norm == "layernorm" else None,
             wq=r(NQ * D, H) / 4, wk=r(NKV * D, H) / 4, wv=r(NKV * D, H) / 4, wo=r(H, NQ * D) / 4)
    if moe:
        c.update(router=r(E, H) / 2, w_in=r(E, 2 * F, H) / 4, w_out=r(E, H, F) / math.sqrt(F))
    else:
        c.update(w_in=r(2 * F, H) / 4, w_out=r(H, F) / math.sqrt(F))
    return c


def _norm(t, w, b, kind):
    if kind == "rmsnorm":
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * w
    mu = t.mean(-1, keepdim=True)
    return (t - mu) / torch.sqrt((t - mu).pow(2).mean(-1, keepdim=True) + EPS) * w + b


def dense_block(c, leaves):
    x, an_w, an_b, mn_w, mn_b, wq, wk, wv, wo, w_in, w_out, router = leaves
    h = x + dense_attention(_norm(x, an_w, an_b, c["norm"]), wq, wk, wv, wo, num_heads=NQ, num_kv_heads=NKV,
                            rope_theta=THETA)
    z = _norm(h, mn_w, mn_b, c["norm"])
    if c["moe"]:
        return h + dense_moe(z, router, w_in, w_out, top_k=TOPK)[0]
    a = z @ w_in.T
    return h + (torch.nn.functional.silu(a[..., :F]) * a[..., F:]) @ w_out.T


def reference(c):
    names = ("x", "an_w", "an_b", "mn_w", "mn_b", "wq", "wk", "wv", "wo", "w_in", "w_out", "router")
    leaves = [c.get(n).clone().requires_grad_() if c.get(n) is not None else None for n in names]
    y = dense_block(c, leaves)
    (y * c["dy"]).sum().backward()
    return y.detach(), {n: (t.grad if t is not None else None) for n, t in zip(names, leaves)}


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


def bad_args(rank, ws):
    msgs = []
    for kw in (dict(norm="batchnorm"), dict(norm_eps=0), dict(moe=dict(num_experts=4)),
               dict(moe=dict(num_experts=4, top_k=2, experts_per_rank=2)), dict(moe=[4, 2])):
        try:
            OverlapTransformerBlock(H, NQ, F, group=dist.group.WORLD, **kw)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_arguments_raise_value_error(pool2):
    for msgs in pool2.run(bad_args):
        norm, eps, missing, unknown, not_dict = msgs
        assert norm and "norm='batchnorm'" in norm and "rmsnorm" in norm
        assert eps and "norm_eps=0" in eps
        assert missing and "missing keys ['top_k']" in missing
        assert unknown and "experts_per_rank" in unknown
        assert not_dict and "moe=[4, 2]" in not_dict
