"""The MoE's routing of a call: the router logits, top-k routing (one kernel on CUDA: Triton,
:mod:`overlap_layers.kernels.routing`, whose docstring gives the reference; its torch reference
elsewhere; differentiable in the logits), the grouped routers of DeepSeek-V2 / V3
(:func:`route_grouped`, torch ops: the kernel computes softmax top-k only), capacity, the aux loss
and the send order's sort keys (:func:`route_call`), as ``layers/moe/layer.py``'s module docstring
states them.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from ...kernels.routing import count, fused_available, key_dtype, route_fused, route_topk_reference
from ...kernels.triton_gate import worth_launching


class RouterKind(enum.Enum):
    """How the router scores the experts and selects a token's ``top_k`` (the reference:
    :func:`route_grouped`'s docstring)."""

    TOPK = "topk"  # softmax, the top_k largest (Mixtral, Qwen3-MoE; DeepSeek-V2's "greedy")
    GROUP_LIMITED_GREEDY = "group_limited_greedy"  # DeepSeek-V2: softmax; groups scored by their max
    NOAUX_TC = "noaux_tc"  # DeepSeek-V3: sigmoid; selection by score + bias, groups by the sum of their top 2


@dataclass(frozen=True)
class Routing:
    """:class:`OverlapMoE`'s router: ``kind``, the expert groups (``n_group`` groups of
    consecutive experts, of which each token's ``topk_group`` best are searched; 1 and 1 for
    ``RouterKind.TOPK``) and ``scaling``, the factor of every combine weight (DeepSeek's
    ``routed_scaling_factor``). ``RouterKind.NOAUX_TC`` gives the layer the buffer
    ``e_score_correction_bias [E]`` (float32, zeros; update it in place: no gradient trains it)."""

    kind: RouterKind = RouterKind.TOPK
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


class _Route(torch.autograd.Function):
    """The kernel's forward with the reference's gradient (module docstring)."""

    @staticmethod
    def forward(ctx, logits, k: int, normalize: bool, shift: int):
        probs, top_p, experts, weights, keys, counts = route_fused(logits, k, normalize, shift)
        ctx.save_for_backward(probs, top_p, experts)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(experts, keys, counts)
        return probs, top_p, experts, weights, keys, counts

    @staticmethod
    def backward(ctx, g_probs, g_top_p, g_experts, g_weights, g_keys, g_counts):
        probs, top_p, experts = ctx.saved_tensors
        g_top = torch.zeros_like(top_p) if g_top_p is None else g_top_p
        if g_weights is not None:
            if ctx.normalize:
                s = top_p.sum(-1, keepdim=True)
                g_top = g_top + (g_weights - (g_weights * top_p).sum(-1, keepdim=True) / s) / s
            else:
                g_top = g_top + g_weights
        g = torch.zeros_like(probs) if g_probs is None else g_probs.clone()
        g.scatter_add_(1, experts, g_top)
        return probs * (g - (g * probs).sum(-1, keepdim=True)), None, None, None


def route_topk(logits: torch.Tensor, k: int, normalize: bool, shift: int = 0) -> Tuple[torch.Tensor, ...]:
    """``(probs [T, E], top_p [T, k], experts [T, k] int64, weights [T, k], keys [T*k], counts [E]
    int64)`` of the module reference; one kernel where :func:`fused_available` and the launch pays
    (:func:`~overlap_layers.kernels.triton_gate.worth_launching`; the keys int16 for fewer than
    2**15 experts, else int64)."""
    if not (fused_available(logits) and worth_launching(logits)):
        return route_topk_reference(logits, k, normalize, shift)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Route.apply(logits, k, normalize, shift)
    return route_fused(logits, k, normalize, shift)


class _HalfRouterLogits(torch.autograd.Function):
    """``x.float() @ w.float().T`` for bfloat16 or float16 ``x`` and ``w`` of one dtype on CUDA, as
    one GEMM on the half operands with float32 output (``torch.mm``'s ``out_dtype``): their
    products are exact in float32 and summed in float32, so it equals the converted GEMM up to
    summation order, without the two conversions and the float32 GEMM (98 us of a qwen3 forward
    on H200). The backward is that reference's: float32 GEMMs, each gradient cast to its
    operand's dtype."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = (g @ w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x.float()).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def router_logits(x_TH: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """``x @ router_weight.T`` in float32 (float64 if x is), from the operands converted to it
    (:class:`_HalfRouterLogits` on CUDA half operands; its GEMM alone where no gradient is wanted)."""
    if x_TH.is_cuda and x_TH.dtype in (torch.bfloat16, torch.float16) and router_weight.dtype == x_TH.dtype:
        if torch.is_grad_enabled() and (x_TH.requires_grad or router_weight.requires_grad):
            return _HalfRouterLogits.apply(x_TH, router_weight)
        return torch.mm(x_TH, router_weight.t(), out_dtype=torch.float32)
    rdt = torch.float64 if x_TH.dtype == torch.float64 else torch.float32
    return x_TH.to(rdt) @ router_weight.to(rdt).t()


def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` largest of each row, descending, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def route_grouped(logits: torch.Tensor, k: int, normalize: bool, shift: int, routing: Routing,
                  bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """The outputs of :func:`route_topk` for ``routing``'s grouped routers, in torch ops.
    Reference (DeepSeek-V2's ``group_limited_greedy`` and DeepSeek-V3's ``noaux_tc`` routers of
    transformers; ``logits [T, E]``, G = ``n_group`` groups of E/G consecutive experts)::

        scores      = softmax(logits) (GROUP_LIMITED_GREEDY) | sigmoid(logits) (NOAUX_TC)
        choice      = scores | scores + bias                    (bias: e_score_correction_bias)
        group score = max of choice in the group | sum of the group's 2 largest choices
        keep the topk_group best groups; experts = the k largest choices in kept groups
        top_p       = scores[experts]                           (the bias selects, never weighs)
        weights     = top_p / sum(top_p) (normalize; else top_p), times routing.scaling

    ties to the lower group and expert index; gradients flow to ``logits`` through ``probs``
    (``scores``), ``top_p`` and ``weights``, not through the selection."""
    T, E = logits.shape
    G = routing.n_group
    sigmoid = routing.kind is RouterKind.NOAUX_TC
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    choice = scores.detach() + bias.to(scores.dtype) if sigmoid else scores.detach()
    in_groups = choice.view(T, G, E // G)
    group_score = in_groups.topk(2, dim=-1).values.sum(-1) if sigmoid else in_groups.max(-1).values
    kept = torch.zeros(T, G, dtype=torch.bool, device=logits.device)
    kept.scatter_(1, _top(group_score, routing.topk_group), True)
    experts = _top(choice.masked_fill(~kept.repeat_interleave(E // G, dim=1), -math.inf), k)
    top_p = scores.gather(1, experts)
    weights = top_p / top_p.sum(-1, keepdim=True) if normalize else top_p
    if routing.scaling != 1.0:
        weights = weights * routing.scaling
    flat = experts.reshape(-1)
    keys = torch.remainder(flat - shift, E).to(key_dtype(E))
    return scores, top_p, experts, weights, keys, count(flat, E)


def route(x_TH: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool, shift: int = 0,
          routing: Routing = Routing(), bias: Optional[torch.Tensor] = None):
    """``(probs [T, E], top-k probs [T, k], top-k experts [T, k], combine weights [T, k], sort keys
    [T*k] ((expert - shift) mod E), assignments per expert [E])`` of the router logits: ``probs``
    the router's scores (softmax, or sigmoid for ``RouterKind.NOAUX_TC``), in float32 (or x's dtype
    if wider), ties to the lower expert index. ``RouterKind.TOPK``: :func:`route_topk` (the
    weights times ``routing.scaling``); the grouped routers: :func:`route_grouped`."""
    logits = router_logits(x_TH, router_weight)
    if routing.kind is not RouterKind.TOPK:
        return route_grouped(logits, top_k, normalize, shift, routing, bias)
    out = route_topk(logits, top_k, normalize, shift)
    if routing.scaling == 1.0:
        return out
    probs, top_p, experts, weights, keys, counts = out
    return probs, top_p, experts, weights * routing.scaling, keys, counts


def keep_within_capacity(experts: torch.Tensor, priority: torch.Tensor, num_experts: int, capacity: int):
    """Mask over the flattened assignments (token-major): at most ``capacity`` per expert, by
    decreasing ``priority``, ties to the lower token (earlier assignment)."""
    n = experts.numel()
    by_priority = torch.sort(-priority, stable=True).indices
    order = by_priority[torch.sort(experts[by_priority], stable=True).indices]
    e_sorted = experts[order]
    counts = count(e_sorted, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    keep_sorted = torch.arange(n, device=experts.device) - starts[e_sorted] < capacity
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def tile_index(n: int, k: int, device) -> torch.Tensor:
    """The tile of each of ``n`` rows cut into ``k`` tiles as
    :func:`~overlap_layers.planning.tiling.tile_bounds` cuts them (the
    first ``n % k`` tiles one row longer), in a fixed number of kernels whatever ``k``."""
    base, extra = divmod(n, max(1, min(k, n)))
    i = torch.arange(n, device=device)
    cut = extra * (base + 1)
    return torch.where(i < cut, i // (base + 1), extra + (i - cut) // max(base, 1))


class Routed(NamedTuple):
    """A call's routing (:func:`route_call`): ``keys`` each token-major assignment's place in the
    send order's key order, ``weights [T, k]`` the combine weights (with the router's graph),
    ``counts [K, ws, El]`` the assignments kept per tile and destination expert; the aux loss
    (``aux``), or where it is 0 and not made, what it is made from when read (``aux_zero_of``:
    device, dtype, whether the call had autograd)."""

    keys: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    aux: Optional[torch.Tensor]
    aux_zero_of: Optional[tuple]


def route_call(layer, x_TH: torch.Tensor, K: int, step_order: bool = False) -> Routed:
    """Routing on the whole local batch of an ``OverlapMoE`` call cut into ``K`` tiles, and
    capacity (module docstring): ``keys`` is ``K * E`` where dropped by capacity (``E`` with one
    tile); with ``step_order`` (one tile) by expert in the rank exchange's step order, own experts
    first."""
    T, E, k, El, ws = x_TH.shape[0], layer.num_experts, layer.top_k, layer.num_local_experts, layer.world_size
    shift = El * layer.rank if step_order else 0
    probs, top_p, experts, weights, keys, per_expert = route(x_TH, layer._local("router_weight"), k,
                                                             layer.normalize_topk, shift, layer.routing,
                                                             layer.e_score_correction_bias)
    flat_e = experts.reshape(-1)
    keep = None
    if layer.capacity_factor is not None:
        cap = math.ceil(layer.capacity_factor * T * k / E)
        keep = keep_within_capacity(flat_e, top_p.detach().reshape(-1), E, cap)
    if layer.aux_loss_coef > 0 and T > 0:
        f = per_expert.to(probs.dtype) / (T * k)
        aux, aux_zero_of = layer.aux_loss_coef * E * (f * probs.mean(0)).sum(), None
    else:  # 0, made when read (launches off the call's path)
        aux, aux_zero_of = None, (weights.device, weights.dtype, weights.requires_grad)
    # Send order: by tile, then expert; dropped assignments sort last (key K*E) and are cut off
    # once the counts are on the host ([Note: MoE host syncs]: no sync here).
    if K == 1:  # the routing's own keys (in the step order if asked) and counts
        sort_key, counts = keys, per_expert
        if keep is not None:
            sort_key = torch.where(keep, keys, E)
            counts = count(torch.where(keep, flat_e, E), E + 1)[:E]
        counts = counts.view(1, ws, El)
    else:  # tiles: never the step order (rank chunks run one tile)
        tokens = torch.arange(T, device=x_TH.device).repeat_interleave(k)
        key = tile_index(T, K, x_TH.device)[tokens] * E + flat_e
        if keep is not None:
            key = torch.where(keep, key, K * E)
        sort_key = key.to(key_dtype(K * E))
        counts = count(key, K * E + 1)[:K * E].view(K, ws, El)
    return Routed(sort_key, weights, counts, aux, aux_zero_of)


def zero_aux(router: torch.Tensor, device, dtype: torch.dtype, graph: bool) -> torch.Tensor:
    """The aux loss 0 of a call (``Routed.aux_zero_of``: its device, dtype, whether it had
    autograd), attached to ``router`` where the call had autograd, so that ``backward()`` works."""
    if graph and router.requires_grad:
        # hung from the router's weight, not from the call's graph: held between calls, that
        # graph would keep its parameters' gradient nodes, made on the stream of that call,
        # alive into the next call (which a training graph's capture cannot follow:
        # [Note: MoE training graphs] in layers/moe/device.py)
        with torch.enable_grad():
            return router.to(dtype).sum() * 0.0
    return torch.zeros((), device=device, dtype=dtype, requires_grad=graph)
