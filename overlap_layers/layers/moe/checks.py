"""The argument checks of :class:`~overlap_layers.layers.moe.layer.OverlapMoE`'s constructor and
``from_dense``: each raises ``ValueError`` naming the argument and what is valid."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...config import check_positive_int
from ...planning.checks import finite_number
from ..common.activations import ACTIVATIONS, gated
from .routing import RouterKind, Routing


def check_args(hidden_size, ffn_hidden_size, num_experts, top_k, activation, capacity_factor, aux_loss_coef,
               shared_expert_ffn) -> None:
    """The constructor's arguments (the group's divisibility is checked where the group is known)."""
    for name, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                    ("num_experts", num_experts), ("top_k", top_k)):
        check_positive_int(v, name)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be at most num_experts={num_experts}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; valid: {ACTIVATIONS}")
    if capacity_factor is not None and not finite_number(capacity_factor):
        raise ValueError(f"capacity_factor={capacity_factor!r}; must be None (dropless) or a positive finite "
                         f"number")
    if not finite_number(aux_loss_coef, zero_ok=True):
        raise ValueError(f"aux_loss_coef={aux_loss_coef!r}; must be a finite number >= 0")
    check_positive_int(shared_expert_ffn, "shared_expert_ffn", none_ok=True)


def check_routing(routing, num_experts: int, top_k: int) -> None:
    """The constructor's ``routing`` (a :class:`~.routing.Routing`) for ``num_experts`` experts and
    ``top_k``."""
    if not isinstance(routing, Routing) or not isinstance(routing.kind, RouterKind):
        raise ValueError(f"routing={routing!r}; must be a Routing(kind=RouterKind..., n_group=, topk_group=, "
                         f"scaling=)")
    check_positive_int(routing.n_group, "routing.n_group")
    check_positive_int(routing.topk_group, "routing.topk_group")
    if not finite_number(routing.scaling):
        raise ValueError(f"routing.scaling={routing.scaling!r}; must be a positive finite number")
    G, kept = routing.n_group, routing.topk_group
    if routing.kind is RouterKind.TOPK:
        if (G, kept) != (1, 1):
            raise ValueError(f"routing.n_group={G}, routing.topk_group={kept}: RouterKind.TOPK has no groups "
                             f"(1 and 1); groups are RouterKind.GROUP_LIMITED_GREEDY's and NOAUX_TC's")
        return
    if num_experts % G:
        raise ValueError(f"routing.n_group={G} must divide num_experts={num_experts}")
    if kept > G:
        raise ValueError(f"routing.topk_group={kept} must be at most routing.n_group={G}")
    if routing.kind is RouterKind.NOAUX_TC and num_experts // G < 2:
        raise ValueError(f"routing.n_group={G}: RouterKind.NOAUX_TC scores a group by its 2 best experts, so "
                         f"each group needs at least 2 (n_group at most num_experts // 2 = {num_experts // 2})")
    if top_k > kept * (num_experts // G):
        raise ValueError(f"top_k={top_k} must be at most the experts of the kept groups, routing.topk_group * "
                         f"num_experts / routing.n_group = {kept * (num_experts // G)}")


def check_dense(router_weight, w_in, w_out, shared_w_in, shared_w_out,
                activation: str) -> Tuple[int, int, int, Optional[int]]:
    """``from_dense``'s weights: ``(E, H, ffn, shared ffn or None)`` of consistent shapes."""
    for name, t, dim in (("router_weight", router_weight, 2), ("w_in", w_in, 3), ("w_out", w_out, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim:
            raise ValueError(f"{name} must be a {dim}-D tensor; got {getattr(t, 'shape', t)!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; valid: {ACTIVATIONS}")
    E, H = router_weight.shape
    ffn = w_out.shape[2]
    mult = 2 if gated(activation) else 1
    for name, t, want in (("w_in", w_in, (E, mult * ffn, H)), ("w_out", w_out, (E, H, ffn))):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; with router_weight {tuple(router_weight.shape)} "
                             f"and activation={activation!r} it must be {want}")
    if (shared_w_in is None) != (shared_w_out is None):
        raise ValueError("pass both shared_w_in and shared_w_out, or neither")
    sffn = None
    if shared_w_in is not None:
        sffn = shared_w_out.shape[-1] if shared_w_out.dim() == 2 else -1
        if shared_w_out.dim() != 2 or tuple(shared_w_out.shape) != (H, sffn) or \
                shared_w_in.dim() != 2 or tuple(shared_w_in.shape) != (mult * sffn, H):
            raise ValueError(f"shared_w_in {tuple(shared_w_in.shape)} / shared_w_out {tuple(shared_w_out.shape)}: "
                             f"must be [{mult}*shared_ffn, {H}] and [{H}, shared_ffn]")
    return E, H, ffn, sffn
