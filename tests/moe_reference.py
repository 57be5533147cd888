"""Independent dense mixture-of-experts for the MoE layer's tests (one process, plain formulas).

Written from the spec (Switch / Mixtral top-k routing), not from the library. It holds every
expert, runs each expert densely on every token (an explicit loop over experts) and multiplies by
a [tokens, experts] gate that is zero where the expert was not chosen or its assignment was
dropped, so gradients follow from torch autograd.

Layouts: router_weight [E, H]; w_in [E, 2F, H] (per expert gate rows then up rows) for swiglu,
[E, F, H] for gelu / relu; w_out [E, H, F]; shared_w_in [2Fs, H] (or [Fs, H]); shared_w_out [H, Fs].

The reference is called once per rank on that rank's own tokens, so "capacity per source rank"
is capacity per call.

[Note: capacity order] The spec leaves open whether the capacity order uses the top-k router
probability before renormalisation or the final combine weight. ``capacity_key="weight"`` (the
default) orders by the final weight w_k used in y (after optional renormalisation);
``capacity_key="prob"`` orders by the softmax probability before renormalisation. Both break ties
by lower token index. With normalize_topk=False they coincide; with top_k=1 and normalize_topk=True
every final weight is 1, so "weight" keeps the first tokens in token order.
"""
import math

import torch


def activate(pre, activation, ffn):
    """act(x @ w_in.T): swiglu = silu(first ffn columns) * rest; gelu is exact (erf); relu."""
    if activation == "swiglu":
        g, u = pre[..., :ffn], pre[..., ffn:]
        return g * torch.sigmoid(g) * u
    if activation == "gelu":
        return 0.5 * pre * (1 + torch.erf(pre / math.sqrt(2)))
    if activation == "relu":
        return pre.clamp(min=0)
    raise ValueError(activation)


def expert(x_TH, w_in, w_out, activation):
    """One FFN expert on tokens [T, H]: act(x @ w_in.T) @ w_out.T."""
    return activate(x_TH @ w_in.T, activation, w_out.shape[1]) @ w_out.T


def route(x_TH, router_weight, top_k, *, normalize_topk=True, capacity_factor=None, capacity_key="weight"):
    """Routing decisions for the tokens x [T, H] (plain loops where it matters).

    Returns a dict:
      probs [T, E]    softmax of the router logits (float32, or x's dtype if wider)
      experts [T, k]  chosen experts, by decreasing probability, ties to the lower expert index
      weights [T, k]  the combine weights (renormalised over the k when normalize_topk)
      kept [T, k]     bool, False where capacity dropped the assignment
      capacity        per-expert capacity for this call (None when dropless)
    """
    T, E = x_TH.shape[0], router_weight.shape[0]
    rdtype = torch.promote_types(x_TH.dtype, torch.float32)
    logits = x_TH.to(rdtype) @ router_weight.to(rdtype).T
    probs = torch.softmax(logits, dim=-1)
    # top-k with ties to the lower expert index: a stable descending sort keeps index order on ties.
    order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices
    experts = order[:, :top_k]
    topp = probs.gather(1, experts)
    weights = topp / topp.sum(-1, keepdim=True) if normalize_topk else topp
    kept = torch.ones(T, top_k, dtype=torch.bool, device=probs.device)
    capacity = None
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * T * top_k / E)
        key = (weights if capacity_key == "weight" else topp).detach()
        for e in range(E):
            cands = [(t, j) for t in range(T) for j in range(top_k) if int(experts[t, j]) == e]
            cands.sort(key=lambda tj: (-float(key[tj[0], tj[1]]), tj[0]))
            for t, j in cands[capacity:]:
                kept[t, j] = False
    return dict(probs=probs, experts=experts, weights=weights, kept=kept, capacity=capacity)


def aux_loss(r, num_experts, top_k, coef):
    """coef * E * sum_e f_e * P_e over the call's tokens; f_e counts assignments before capacity
    drops (no gradient), P_e is the mean router probability. Zero for zero tokens (empty sum)."""
    probs, experts = r["probs"], r["experts"]
    T = probs.shape[0]
    if T == 0:
        return probs.sum() * 0.0
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
    for e in range(num_experts):
        counts[e] = float((experts == e).sum())
    f = counts / (T * top_k)
    P = probs.mean(0)
    return coef * num_experts * (f * P).sum()


def dense_moe(x, router_weight, w_in, w_out, *, top_k, activation="swiglu", normalize_topk=True,
              capacity_factor=None, shared_w_in=None, shared_w_out=None, aux_loss_coef=0.0,
              capacity_key="prob"):
    """(y [B, S, H], aux_loss scalar) for one rank's tokens x [B, S, H]; computes the experts in
    x's dtype and the router in float32 or x's dtype if wider."""
    B, S, H = x.shape
    E = router_weight.shape[0]
    x_TH = x.reshape(B * S, H)
    r = route(x_TH, router_weight, top_k, normalize_topk=normalize_topk, capacity_factor=capacity_factor,
              capacity_key=capacity_key)
    # gate [T, E]: the combine weight of expert e for token t, zero if not chosen or dropped.
    gate = torch.zeros(B * S, E, dtype=r["weights"].dtype, device=x.device)
    onehot = torch.nn.functional.one_hot(r["experts"], E).to(gate.dtype)  # [T, k, E]
    gate = gate + (onehot * (r["weights"] * r["kept"].to(gate.dtype))[..., None]).sum(1)
    gate = gate.to(x.dtype)
    y = torch.zeros_like(x_TH)
    for e in range(E):
        y = y + gate[:, e:e + 1] * expert(x_TH, w_in[e], w_out[e], activation)
    if shared_w_in is not None:
        y = y + expert(x_TH, shared_w_in, shared_w_out, activation)
    aux = aux_loss(r, E, top_k, aux_loss_coef)
    return y.reshape(B, S, H), aux
