"""OverlapMoE with DeepSeek's routers (``Routing``: DeepSeek-V2's group-limited greedy, DeepSeek-V3's
``noaux_tc``) against an independent dense float64 reference written here from transformers'
DeepseekV2TopkRouter / DeepseekV3TopkRouter, per token in plain Python where the selection is made:

  V3  scores = sigmoid(logits); choice = scores + e_score_correction_bias; a group's score is the
      sum of its 2 best choices; keep topk_group groups; the top_k best choices among their experts
  V2  scores = softmax(logits); choice = scores; a group's score is its best choice
  both  weights = scores of the chosen experts (never the bias), / their sum if normalize_topk,
        times routed_scaling_factor; y = sum of weight * expert(x) + the shared expert(x)

Ties go to the lower group and expert index. Gradients (x, router, experts, shared expert) come
from autograd through the reference; each rank runs its own tokens, the experts split over 1 and
2 gloo ranks (expert parallel).
"""
import math
import re

import pytest
import torch
import torch.distributed as dist

from moe_reference import expert
from overlap_layers import OverlapMoE, RouterKind, Routing
from overlap_layers.layers.moe.routing import route

TOL = 1e-10  # float64


# ------------------------------------------------------------------ the reference
def reference_route(logits, kind, n_group, topk_group, top_k, normalize, scaling, bias):
    """(experts [T, k] as lists, weights [T, k] with autograd, scores [T, E])."""
    T, E = logits.shape
    v3 = kind is RouterKind.NOAUX_TC
    scores = torch.sigmoid(logits) if v3 else torch.softmax(logits, dim=-1)
    per = E // n_group
    chosen = []
    plain = scores.detach()
    for t in range(T):
        c = [float(plain[t, e]) + (float(bias[e]) if v3 else 0.0) for e in range(E)]
        groups = [sorted(c[g * per:(g + 1) * per], reverse=True) for g in range(n_group)]
        gscore = [grp[0] + grp[1] if v3 else grp[0] for grp in groups]
        kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        cands = [e for e in range(E) if e // per in kept]
        chosen.append(sorted(cands, key=lambda e: (-c[e], e))[:top_k])
    rows = []
    for t in range(T):
        w = torch.stack([scores[t, e] for e in chosen[t]])
        if normalize:
            w = w / w.sum()
        rows.append(w * scaling)
    weights = torch.stack(rows) if rows else scores.new_zeros(0, top_k)
    return chosen, weights, scores


def reference_moe(x, p, routing, top_k, normalize, bias):
    """y [B, S, H] of the dense MoE on x (float64, autograd to x and every tensor of ``p``)."""
    B, S, H = x.shape
    x_TH = x.reshape(B * S, H)
    logits = x_TH @ p["router_weight"].T
    chosen, weights, _ = reference_route(logits, routing.kind, routing.n_group, routing.topk_group, top_k,
                                         normalize, routing.scaling, bias)
    y = expert(x_TH, p["shared_w_in"], p["shared_w_out"], "swiglu")
    outs = [y[t] for t in range(B * S)]
    for t in range(B * S):
        for j, e in enumerate(chosen[t]):
            outs[t] = outs[t] + weights[t, j] * expert(x_TH[t:t + 1], p["w_in"][e], p["w_out"][e], "swiglu")[0]
    return torch.stack(outs).reshape(B, S, H) if outs else y.reshape(B, S, H)


# ------------------------------------------------------------------ routing alone
ROUTERS = {
    # DeepSeek-V3: 4 groups of 4, keep 2, top 3, normalised, scaled
    "v3": (Routing(RouterKind.NOAUX_TC, n_group=4, topk_group=2, scaling=2.5), 3, True),
    # DeepSeek-V3 without normalisation, one group kept: every expert from the best group
    "v3_one_group": (Routing(RouterKind.NOAUX_TC, n_group=4, topk_group=1, scaling=1.0), 2, False),
    # DeepSeek-V2's group-limited greedy, not normalised (transformers' V2 router), scaled
    "v2_grouped": (Routing(RouterKind.GROUP_LIMITED_GREEDY, n_group=4, topk_group=2, scaling=16.0), 3, False),
    # DeepSeek-V2's greedy: softmax top-k, scaled (the Triton kernel's routing where it runs)
    "v2_greedy": (Routing(RouterKind.TOPK, scaling=2.0), 2, True),
}


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("ties", [False, True])
def test_routing_matches_the_reference(name, ties):
    """experts, weights and the logits' gradient through scores and weights (float64), with a
    random bias for V3; integer logits tie often."""
    routing, k, normalize = ROUTERS[name]
    T, E = 24, 16
    g = torch.Generator().manual_seed(7 + ties)
    logits = torch.randint(-2, 3, (T, E), generator=g).double() if ties else \
        torch.randn(T, E, generator=g, dtype=torch.float64) * 2
    bias = (torch.randint(0, 2, (E,), generator=g) * 0.5).float() if ties else torch.randn(E, generator=g) * 0.3
    leaf = logits.clone().requires_grad_()
    probs, top_p, experts, weights, keys, counts = route(leaf, torch.eye(E, dtype=torch.float64), k, normalize,
                                                         shift=3, routing=routing, bias=bias)
    ref_x = logits.clone().requires_grad_()
    chosen, ref_w, ref_scores = reference_route(ref_x, routing.kind, routing.n_group, routing.topk_group, k,
                                                normalize, routing.scaling, bias.double())
    assert experts.tolist() == chosen
    torch.testing.assert_close(weights, ref_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(probs, ref_scores, rtol=1e-12, atol=1e-12)
    assert keys.tolist() == [(e - 3) % E for row in chosen for e in row]
    assert counts.tolist() == [sum(row.count(e) for row in chosen) for e in range(E)]
    gp = torch.randn(T, E, generator=g, dtype=torch.float64)
    gw = torch.randn(T, k, generator=g, dtype=torch.float64)
    ((probs * gp).sum() + (weights * gw).sum()).backward()
    ((ref_scores * gp).sum() + (ref_w * gw).sum()).backward()
    torch.testing.assert_close(leaf.grad, ref_x.grad, rtol=1e-10, atol=1e-12)


def _v3(logits, bias, n_group=2, topk_group=1, k=2, normalize=False):
    return route(logits, torch.eye(logits.shape[1], dtype=torch.float64), k, normalize,
                 routing=Routing(RouterKind.NOAUX_TC, n_group=n_group, topk_group=topk_group), bias=bias)


def test_bias_changes_the_selection_not_the_weights():
    """The bias moves expert 3 ahead of expert 0; the weights stay the unbiased sigmoid scores."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    _, _, experts, weights, _, _ = _v3(logits, torch.zeros(4), n_group=1)
    assert experts.tolist() == [[0, 1]]
    _, _, experts, weights, _, _ = _v3(logits, torch.tensor([0.0, 0.0, 0.0, 2.0]), n_group=1)
    assert experts.tolist() == [[3, 0]]
    torch.testing.assert_close(weights, torch.sigmoid(logits[:, [3, 0]]), rtol=0, atol=0)


def test_grouped_selection():
    """V3 scores a group by the sum of its 2 best: group 1 (0.6 + 0.6) beats group 0 (0.95 + 0.0)
    although group 0 holds the best expert; V2 scores by the best, keeping group 0."""
    p = torch.tensor([[0.95, 1e-6, 0.6, 0.6]], dtype=torch.float64)
    logits = torch.log(p) - torch.log1p(-p)  # sigmoid(logits) = p
    _, _, experts, _, _, _ = _v3(logits, torch.zeros(4))
    assert experts.tolist() == [[2, 3]]
    v2 = Routing(RouterKind.GROUP_LIMITED_GREEDY, n_group=2, topk_group=1)
    _, _, experts, _, _, _ = route(torch.log(p), torch.eye(4, dtype=torch.float64), 2, False, routing=v2)
    assert experts.tolist() == [[0, 1]]


# ------------------------------------------------------------------ the layer, 1 and 2 ranks
H, F, Fs, E = 8, 6, 10, 8
CASES = {
    "v3": (Routing(RouterKind.NOAUX_TC, n_group=4, topk_group=2, scaling=2.5), 3, True),
    "v2_grouped": (Routing(RouterKind.GROUP_LIMITED_GREEDY, n_group=2, topk_group=1, scaling=4.0), 2, False),
}


def make_weights(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(router_weight=r(E, H) / math.sqrt(H) * 2, w_in=r(E, 2 * F, H) / math.sqrt(H),
                w_out=r(E, H, F) / math.sqrt(F), shared_w_in=r(2 * Fs, H) / math.sqrt(H),
                shared_w_out=r(H, Fs) / math.sqrt(Fs)), r(E).float() * 0.3, g


def layer_run(rank, ws, name, num_tiles):
    routing, k, normalize = CASES[name]
    p, bias, g = make_weights(3)
    bias = bias if routing.kind is RouterKind.NOAUX_TC else None
    xs = [torch.randn(1 + r, 5, H, generator=g, dtype=torch.float64) for r in range(ws)]
    dys = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in xs]
    layer = OverlapMoE.from_dense(**p, top_k=k, normalize_topk=normalize, routing=routing,
                                  e_score_correction_bias=bias, group=dist.group.WORLD, num_tiles=num_tiles)
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    (y * dys[rank]).sum().backward()
    El = E // ws
    mine = slice(rank * El, (rank + 1) * El)
    # the reference: this rank's tokens for y, dx, router and shared expert; every rank's for the experts
    errs = {}
    expert_grads = {"w_in": 0, "w_out": 0}
    for r_ in range(ws):
        leaves = {n: t.clone().requires_grad_() for n, t in p.items()}
        xr = xs[r_].clone().requires_grad_()
        yr = reference_moe(xr, leaves, routing, k, normalize, bias)
        (yr * dys[r_]).sum().backward()
        for n in expert_grads:
            expert_grads[n] = expert_grads[n] + leaves[n].grad
        if r_ == rank:
            want = dict(y=yr.detach(), dx=xr.grad, router_weight=leaves["router_weight"].grad,
                        shared_w_in=leaves["shared_w_in"].grad, shared_w_out=leaves["shared_w_out"].grad)
    got = dict(y=y.detach(), dx=x.grad, **{n: getattr(layer, n).grad for n in ("router_weight", "shared_w_in",
                                                                              "shared_w_out")})
    got.update(w_in=layer.w_in.grad, w_out=layer.w_out.grad)
    want.update(w_in=expert_grads["w_in"][mine], w_out=expert_grads["w_out"][mine])
    for n, w in want.items():
        errs[n] = ((got[n] - w).norm() / w.norm()).item()
    sd = layer.state_dict()
    return errs, None if bias is None else torch.equal(sd["e_score_correction_bias"], bias)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ws,num_tiles", [(1, 1), (2, 1), (2, 2)])
def test_layer_matches_the_dense_reference(pools, name, ws, num_tiles):
    """y, x.grad, the router's and shared expert's gradients (this rank's tokens) and the experts'
    (every rank's tokens, this rank's experts), float64; V3's bias in the state dict."""
    for rank, (errs, bias_kept) in enumerate(pools(ws).run(layer_run, name, num_tiles)):
        bad = {n: e for n, e in errs.items() if not e < TOL}
        assert not bad, (rank, bad)
        assert bias_kept is (True if name == "v3" else None)


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kw,match", [
    (dict(routing=Routing(RouterKind.NOAUX_TC, n_group=3, topk_group=1)), "routing.n_group=3 must divide"),
    (dict(routing=Routing(RouterKind.NOAUX_TC, n_group=2, topk_group=3)), "routing.topk_group=3 must be at most"),
    (dict(routing=Routing(RouterKind.GROUP_LIMITED_GREEDY, n_group=4, topk_group=1), top_k=3),
     "top_k=3 must be at most the experts of the kept groups"),
    (dict(routing=Routing(RouterKind.NOAUX_TC, n_group=8, topk_group=4)), "at least 2"),
    (dict(routing=Routing(RouterKind.TOPK, n_group=2, topk_group=1)), "RouterKind.TOPK has no groups"),
    (dict(routing=Routing(RouterKind.NOAUX_TC, scaling=0.0)), "routing.scaling=0.0"),
    (dict(routing=Routing(RouterKind.NOAUX_TC, n_group=0)), "routing.n_group=0"),
    (dict(routing="noaux_tc"), "routing='noaux_tc'"),
])
def test_bad_routing_arguments(kw, match):
    """ValueError naming the argument, its value and what is valid (checked before the group)."""
    args = {"top_k": 2, **kw}
    with pytest.raises(ValueError, match=re.escape(match)):
        OverlapMoE(H, F, E, args.pop("top_k"), **args)


def test_from_dense_bias_needs_noaux_tc():
    p, bias, _ = make_weights(0)
    with pytest.raises(ValueError, match="e_score_correction_bias of shape"):
        OverlapMoE.from_dense(**p, top_k=2, e_score_correction_bias=bias, group=object())


def block_routing(rank, ws):
    from overlap_layers import OverlapTransformerBlock
    routing = Routing(RouterKind.NOAUX_TC, n_group=4, topk_group=2, scaling=2.5)
    block = OverlapTransformerBlock(H, 2, F, moe={"num_experts": E, "top_k": 2, "routing": routing},
                                    group=dist.group.WORLD)
    y = block(torch.randn(1, 4, H))
    return block.mlp.routing == routing, "mlp.e_score_correction_bias" in block.state_dict(), tuple(y.shape)


def test_block_takes_the_routing(pools):
    """``OverlapTransformerBlock(moe={..., "routing": ...})`` builds its MoE with that router."""
    for same, has_bias, shape in pools(1).run(block_routing):
        assert same and has_bias and shape == (1, 4, H)
