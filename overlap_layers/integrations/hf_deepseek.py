"""DeepSeek-V2 and DeepSeek-V3 (transformers 5) in :func:`overlap_layers.swap`: the router their
families' rows in :mod:`.hf_families` read from the module (``MoESpec(routing=Router.DEEPSEEK)``).

Reference: transformers' ``DeepseekV3MoE`` / ``DeepseekV2Moe`` block, which the swapped
:class:`~.hf_adapters.HFMoE` around :class:`~overlap_layers.layers.moe.layer.OverlapMoE` must equal::

    _, weights, experts = gate(x)          # the router (below), in float32
    y = experts(x, experts, weights) + shared_experts(x)
    shared_experts = a swiglu MLP of width n_shared_experts * moe_intermediate_size

    DeepseekV3TopkRouter: sigmoid scores; selection by score + e_score_correction_bias (a
        buffer), in the topk_group best of n_group groups (a group's score: the sum of its 2
        best); weights = the chosen experts' scores, / their sum if norm_topk_prob, times
        routed_scaling_factor                       -> RouterKind.NOAUX_TC
    DeepseekV2TopkRouter: softmax scores; topk_method "greedy" (top-k) or
        "group_limited_greedy" (groups scored by their best score); weights = the chosen
        scores times routed_scaling_factor, never normalised (transformers' V2 router reads no
        norm_topk_prob)                             -> RouterKind.TOPK / GROUP_LIMITED_GREEDY

The shared experts are the layer's shared expert (``MoESpec.shared_expert="shared_experts"``:
``shared_w_in`` = gate rows then up rows, ``shared_w_out`` = down), run on each rank's share of
the tokens like the router. The bias is the layer's buffer ``e_score_correction_bias``, which HF's
router holds too once the replacement is accepted (one tensor, as the router weight is:
:func:`.hf_adapters.tie_router`; the state dict's entry and the routing read the layer's:
``module.to()`` copies buffers module by module, so after it update the layer's,
``mlp.layer.e_score_correction_bias``). The dense layers' ``DeepseekV3MLP`` / ``DeepseekV2MLP``
are swapped as every MLP is. The attention is multi-head latent attention (MLA: low-rank q / kv
projections, heads split into a rotary and a non-rotary part), which OverlapAttention does not
compute: its spec's ``latent_kv`` leaves it dense, warned with that reason.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers.moe.routing import RouterKind, Routing
from .replace import Unswappable

_V2_METHODS = {"greedy": RouterKind.TOPK, "group_limited_greedy": RouterKind.GROUP_LIMITED_GREEDY}


def router_kwargs(gate: nn.Module, num_experts: int) -> dict:
    """The ``OverlapMoE.from_dense`` keywords a DeepSeek router module ``gate`` gives:
    ``routing`` (:class:`Routing`), ``normalize_topk`` (its ``norm_topk_prob``, False where it has
    none) and ``e_score_correction_bias`` (V3's buffer, detached; None for V2). Unswappable for a
    router that is neither V2's nor V3's."""
    scaling = getattr(gate, "routed_scaling_factor", None)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool):
        raise Unswappable(f"cannot read routed_scaling_factor from {type(gate).__name__}")
    method = getattr(gate, "topk_method", None)
    bias = getattr(gate, "e_score_correction_bias", None)
    if method is not None:  # DeepSeek-V2
        if method not in _V2_METHODS:
            raise Unswappable(f"topk_method={method!r}; OverlapMoE routes {sorted(_V2_METHODS)} of DeepSeek-V2")
        kind, bias = _V2_METHODS[method], None
    elif isinstance(bias, torch.Tensor) and tuple(bias.shape) == (num_experts,):  # DeepSeek-V3
        kind = RouterKind.NOAUX_TC
    else:
        raise Unswappable(f"{type(gate).__name__} is neither DeepSeek-V2's router (topk_method) nor DeepSeek-V3's "
                          f"(e_score_correction_bias [{num_experts}])")
    grouped = kind is not RouterKind.TOPK
    groups = (getattr(gate, "num_group", None) or 1, getattr(gate, "topk_group", None) or 1) if grouped else (1, 1)
    normalize = bool(getattr(gate, "norm_topk_prob", False))
    return dict(routing=Routing(kind, *groups, float(scaling)), normalize_topk=normalize,
                e_score_correction_bias=None if bias is None else bias.detach())
