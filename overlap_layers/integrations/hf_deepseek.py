"""DeepSeek-V2 and DeepSeek-V3 (transformers 5) in :func:`overlap_layers.swap`: what
:mod:`.hf_build` adds for them to its tables and builders.

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

The shared experts are the layer's shared expert (``shared_w_in`` = gate rows then up rows,
``shared_w_out`` = down), run on each rank's share of the tokens like the router. The bias is
the layer's buffer ``e_score_correction_bias``, which HF's router holds too (one tensor, as the
router weight is; the state dict's entry and the routing read the layer's: ``module.to()``
copies buffers module by module, so after it update the layer's, ``mlp.layer.e_score_correction_bias``). The dense layers' ``DeepseekV3MLP`` /
``DeepseekV2MLP`` are swapped as every MLP is. The attention is multi-head latent attention (MLA:
low-rank q / kv projections, heads split into a rotary and a non-rotary part), which
OverlapAttention does not compute: it is recognised only to be left dense, warned with that
reason.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers.moe.routing import RouterKind, Routing
from .hf_state import Entry
from .replace import Unswappable

# The classes hf_build's table recognises, by kind (module path, class name).
CLASSES = {"mlp": [("deepseek_v2", "DeepseekV2MLP"), ("deepseek_v3", "DeepseekV3MLP")],
           "attention": [("deepseek_v2", "DeepseekV2Attention"), ("deepseek_v3", "DeepseekV3Attention")],
           "moe": [("deepseek_v2", "DeepseekV2Moe"), ("deepseek_v3", "DeepseekV3MoE")]}
_MLA = ("DeepseekV2Attention", "DeepseekV3Attention")
_V2_METHODS = {"greedy": RouterKind.TOPK, "group_limited_greedy": RouterKind.GROUP_LIMITED_GREEDY}


def refuse_mla(module: nn.Module) -> None:
    """Unswappable for DeepSeek's multi-head latent attention (the reason its warning gives)."""
    if type(module).__name__ in _MLA:
        raise Unswappable("multi-head latent attention (MLA: low-rank q / kv projections, rotary and non-rotary "
                          "head parts) is not OverlapAttention's; it stays dense, replicated")


def _routing(gate: nn.Module, num_experts: int) -> tuple:
    """``(Routing, normalize_topk, e_score_correction_bias or None)`` of a DeepSeek router module."""
    scaling = getattr(gate, "routed_scaling_factor", None)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool):
        raise Unswappable(f"cannot read routed_scaling_factor from {type(gate).__name__}")
    method = getattr(gate, "topk_method", None)
    bias = getattr(gate, "e_score_correction_bias", None)
    if method is not None:  # DeepSeek-V2
        if method not in _V2_METHODS:
            raise Unswappable(f"topk_method={method!r}; OverlapMoE routes {sorted(_V2_METHODS)} of DeepSeek-V2")
        kind, normalize, bias = _V2_METHODS[method], bool(getattr(gate, "norm_topk_prob", False)), None
    elif isinstance(bias, torch.Tensor) and tuple(bias.shape) == (num_experts,):  # DeepSeek-V3
        kind, normalize = RouterKind.NOAUX_TC, bool(getattr(gate, "norm_topk_prob", False))
    else:
        raise Unswappable(f"{type(gate).__name__} is neither DeepSeek-V2's router (topk_method) nor DeepSeek-V3's "
                          f"(e_score_correction_bias [{num_experts}])")
    grouped = kind is not RouterKind.TOPK
    groups = (getattr(gate, "num_group", None) or 1, getattr(gate, "topk_group", None) or 1) if grouped else (1, 1)
    return Routing(kind, *groups, float(scaling)), normalize, None if bias is None else bias.detach()


def moe_kwargs(module: nn.Module, num_experts: int) -> dict:
    """The ``OverlapMoE.from_dense`` keywords of a DeepSeek MoE block beyond its routed experts
    (routing, normalisation, bias, shared expert); ``{}`` for a block without ``shared_experts``."""
    shared = getattr(module, "shared_experts", None)
    if shared is None:
        return {}
    routing, normalize, bias = _routing(module.gate, num_experts)
    lins = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(lin, nn.Linear) and lin.bias is None for lin in lins):
        raise Unswappable("shared_experts must have gate_proj, up_proj, down_proj: nn.Linear without bias")
    if type(getattr(shared, "act_fn", None)) is not type(getattr(module.experts, "act_fn", None)):
        raise Unswappable(f"shared_experts.act_fn {getattr(shared, 'act_fn', None)!r} is not the experts' activation")
    with torch.no_grad():
        shared_w_in = torch.cat([lins[0].weight, lins[1].weight])
    return dict(routing=routing, normalize_topk=normalize, e_score_correction_bias=bias, shared_w_in=shared_w_in,
                shared_w_out=lins[2].weight.detach())


def tie_bias(hf_moe: nn.Module) -> None:
    """HF's router holds the layer's ``e_score_correction_bias`` tensor as its buffer, as it holds
    the layer's router weight (no-op without one)."""
    bias = hf_moe.layer.e_score_correction_bias
    if bias is not None and hf_moe.gate is not None:
        hf_moe.gate.e_score_correction_bias = bias


def entries(hf: str, ours: str, router: str) -> list:
    """A DeepSeek MoE block's state-dict entries beyond the routed experts' and the router weight's
    (``router``: the path of HF's router module in the swapped module)."""
    return [Entry(f"{hf}gate.e_score_correction_bias", (f"{ours}e_score_correction_bias",
                                                         f"{router}e_score_correction_bias")),
            Entry(f"{hf}shared_experts.gate_proj.weight", (f"{ours}shared_w_in",), 0),
            Entry(f"{hf}shared_experts.up_proj.weight", (f"{ours}shared_w_in",), 1),
            Entry(f"{hf}shared_experts.down_proj.weight", (f"{ours}shared_w_out",))]
