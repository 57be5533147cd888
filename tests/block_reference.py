"""The dense single-process reference of OverlapTransformerBlock (tests/test_block.py and the CUDA
tier): pre-norm attention (``attention_reference.dense_attention``), then the swiglu MLP or the
MoE (``moe_reference.dense_moe``), each with its residual; norms written out here."""
import math

import torch

from attention_reference import dense_attention
from moe_reference import dense_moe

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
