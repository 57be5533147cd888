"""The Hugging Face families ``swap`` recognises (by type, without a ``plan``), and how each
recognised module becomes an overlap layer (the builders :func:`.hf.swap` calls):

=========================================  ==============================================================
HF module (transformers 5)                 replaced by
=========================================  ==============================================================
LlamaMLP, MistralMLP, Qwen3MLP,            :class:`OverlapMLP` (swiglu, ``sequence_parallel=sp``):
Qwen3MoeMLP (dense layers of Qwen3-MoE),   ``w_in`` = gate rows then up rows (Phi-3's fused
Phi3MLP, DeepseekV3MLP, DeepseekV2MLP      ``gate_up_proj`` as it is), ``w_out`` = down; biases when
                                           ``mlp_bias``
LlamaAttention, MistralAttention,          :class:`HFAttention` around :class:`OverlapAttention`
MixtralAttention, Qwen3Attention,          (``sequence_parallel=sp``; GQA; Qwen3's q_norm / k_norm;
Qwen3MoeAttention, Phi3Attention           HF's (cos, sin) so RoPE scaling is exact; biases when
                                           ``attention_bias``; Phi-3's fused ``qkv_proj`` split into
                                           q, k, v; ``partial_rotary_factor`` must be 1)
DeepseekV3Attention, DeepseekV2Attention   left dense, warned (multi-head latent attention)
MixtralSparseMoeBlock,                     :class:`HFMoE` around :class:`OverlapMoE` (expert parallel;
Qwen3MoeSparseMoeBlock                     Mixtral: top-k renormalised; Qwen3-MoE: ``norm_topk_prob``)
DeepseekV3MoE, DeepseekV2Moe               :class:`HFMoE` with DeepSeek's router (``Routing``: V3's
                                           ``noaux_tc``, V2's greedy / group-limited greedy), the
                                           bias and the shared experts (:mod:`.hf_deepseek`)
with ``block=True``: LlamaDecoderLayer,    :class:`HFBlock` around :class:`OverlapTransformerBlock`
MistralDecoderLayer, Qwen3DecoderLayer,    (``sequence_parallel=sp``): the layer's attention and MLP /
MixtralDecoderLayer, Qwen3MoeDecoderLayer, MoE as above, its two RMSNorms inside the block (Phi-3:
Phi3DecoderLayer                           ``resid_pdrop`` must be 0)
=========================================  ==============================================================

``sp``: ``swap``'s ``sequence_parallel``; with ``sequence_parallel=True`` the adapters are
:mod:`.hf_sequence`'s (:class:`HFSequenceAttention`, :class:`HFSequenceMoE`, :class:`HFSequenceBlock`),
and with ``attention="ulysses"`` the attention is a :class:`UlyssesAttention` (``swap`` hands both to
the builders in their options).

A builder raises :class:`~.replace.Unswappable` for a recognised module it cannot replace
(unsupported activation, partial biases, qk-norm eps, router jitter, ...): it is left, warned.

Each replacement keeps the replaced module's state-dict layout (:mod:`.hf_state`, [Note: swapped
state dicts]); its entries are the inverse of what the builders read:

==========================================  =========================================================
the replaced module's entry                 the replacement's parameter
==========================================  =========================================================
``gate_proj.weight`` / ``.bias``            ``w_in`` / ``b_in`` ``[0]`` (global form ``[2, F, ...]``)
``up_proj.weight`` / ``.bias``              ``w_in`` / ``b_in`` ``[1]``
``down_proj.weight`` / ``.bias``            ``w_out`` / ``b_out``
``{q,k,v,o}_proj.weight`` / ``.bias``       ``layer.w{q,k,v,o}`` / ``layer.b{q,k,v,o}``
``gate_up_proj.weight`` (Phi-3, fused)      ``w_in`` whole (fused entries: ``Entry.rows``, below)
``qkv_proj.weight`` (Phi-3, fused)          ``layer.wq``, ``layer.wk``, ``layer.wv`` (rows in turn)
``q_norm.weight``, ``k_norm.weight``        ``layer.q_norm``, ``layer.k_norm``
``gate.weight`` (the router)                ``gate.weight``, tied to ``layer.router_weight``
``experts.gate_up_proj``, ``.down_proj``    ``layer.w_in``, ``layer.w_out`` (``[E, 2F, H]``, ``[E, H, F]``)
``gate.e_score_correction_bias`` (V3)       ``layer.e_score_correction_bias`` (a buffer), tied to ``gate.``'s
``shared_experts.{gate,up,down}_proj``      ``layer.shared_w_in`` ``[0]`` / ``[1]``, ``layer.shared_w_out``
a decoder layer's ``self_attn.*``,          ``block.attention.*``, ``block.mlp.*`` (the MoE's router:
``mlp.*``, ``input_layernorm.weight``,      ``gate.weight``), ``block.attn_norm.weight``,
``post_attention_layernorm.weight``         ``block.mlp_norm.weight``
==========================================  =========================================================

A fused entry (Phi-3's) is the concatenation of several parameters' global values, sharded
differently (q heads, kv heads, gate and up rows), which no one DTensor placement expresses: it is
a ``Replicate()`` DTensor gathered in ``state_dict()`` (a collective; with plain parameters the
whole plain tensor), and loads from the whole tensor ([Note: swapped state dicts]).
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional, Sequence

import torch
from torch import nn

from ..layers import OverlapAttention, OverlapMLP, OverlapMoE, OverlapTransformerBlock
from ..layers.attention.core import QK_NORM_EPS
from . import hf_deepseek
from .hf_adapters import HFAttention, HFBlock, HFMoE
from .hf_sequence import HFSequenceAttention, HFSequenceBlock, HFSequenceMoE, sequence_options, ulysses_attention
from .hf_state import Entry, keep_hf_state
from .replace import Unswappable, on

# The HF classes recognised by type: kind -> [(module path, class name)]. A family missing from
# the installed transformers is skipped.
_KNOWN = {
    "mlp": [("llama", "LlamaMLP"), ("mistral", "MistralMLP"), ("qwen3", "Qwen3MLP"), ("qwen3_moe", "Qwen3MoeMLP"),
            ("phi3", "Phi3MLP")],
    "attention": [("llama", "LlamaAttention"), ("mistral", "MistralAttention"), ("mixtral", "MixtralAttention"),
                  ("qwen3", "Qwen3Attention"), ("qwen3_moe", "Qwen3MoeAttention"), ("phi3", "Phi3Attention")],
    "moe": [("mixtral", "MixtralSparseMoeBlock"), ("qwen3_moe", "Qwen3MoeSparseMoeBlock")],
    # block=True: decoder layers of the pre-norm form input_layernorm -> self_attn -> residual,
    # post_attention_layernorm -> mlp -> residual
    "block": [("llama", "LlamaDecoderLayer"), ("mistral", "MistralDecoderLayer"), ("qwen3", "Qwen3DecoderLayer"),
              ("mixtral", "MixtralDecoderLayer"), ("qwen3_moe", "Qwen3MoeDecoderLayer"), ("phi3", "Phi3DecoderLayer")],
}
for _kind, _entries in hf_deepseek.CLASSES.items():  # DeepSeek-V2 / V3 (hf_deepseek.py)
    _KNOWN[_kind] += _entries
# Class names that look like a swappable module (an unknown one of these is warned about).
_LOOKALIKE_SUFFIXES = {"mlp": ("MLP", "FeedForward", "FFN"), "attention": ("Attention",),
                       "moe": ("MoeBlock", "MoEBlock", "MoE", "Moe", "Experts"), "block": ("DecoderLayer",)}


def known_classes() -> Dict[str, tuple]:
    out = {}
    for kind, entries in _KNOWN.items():
        classes = []
        for family, name in entries:
            try:
                mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            except ImportError:
                continue
            cls = getattr(mod, name, None)
            if cls is not None:
                classes.append(cls)
        out[kind] = tuple(classes)
    return out


def kind_by_type(module: nn.Module, known: Dict[str, tuple], kinds: Sequence[str]) -> Optional[str]:
    for kind in kinds:
        if known.get(kind) and type(module) in known[kind]:
            return kind
    return None


def lookalike_kind(module: nn.Module, kinds: Sequence[str]) -> Optional[str]:
    name = type(module).__name__
    for kind in kinds:
        if name.endswith(_LOOKALIKE_SUFFIXES[kind]):
            return kind
    return None


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    try:
        t = torch.tensor([-2.0, -0.5, 0.0, 0.7, 3.0])
        out = act(t)
        return isinstance(out, torch.Tensor) and torch.allclose(out, nn.functional.silu(t), atol=1e-6)
    except Exception:  # noqa: BLE001
        return False


def _linear(module, name) -> nn.Linear:
    lin = getattr(module, name, None)
    if not isinstance(lin, nn.Linear):
        raise Unswappable(f"{name} is not an nn.Linear")
    return lin


def _check_plain(tensors) -> None:
    for t in tensors:
        if t is not None and type(t) not in (nn.Parameter, torch.Tensor):
            raise Unswappable(f"weights are {type(t).__name__}s (already sharded?); swap a model with plain tensors")


def _build_mlp(module, group, opts) -> nn.Module:
    fused = hasattr(module, "gate_up_proj")  # Phi-3: one gate_up_proj, gate rows then up rows
    ins = [_linear(module, "gate_up_proj")] if fused else [_linear(module, n) for n in ("gate_proj", "up_proj")]
    down = _linear(module, "down_proj")
    act = getattr(module, "activation_fn", None) or getattr(module, "act_fn", None)  # Phi-3's / the others' name
    if not _is_silu(act):
        raise Unswappable(f"activation {act!r} is not SiLU (OverlapMLP's swiglu)")
    biases = [lin.bias for lin in ins] + [down.bias]
    if len({b is None for b in biases}) > 1:
        raise Unswappable("some but not all of the MLP's projections have a bias")
    if fused and ins[0].out_features != 2 * down.in_features:
        raise Unswappable(f"gate_up_proj {tuple(ins[0].weight.shape)} is not [2 * {down.in_features}, hidden]")
    _check_plain([lin.weight for lin in ins] + [down.weight, *biases])
    sp, _, opts = sequence_options(opts)
    has_bias = down.bias is not None
    with torch.no_grad():
        w_in = torch.cat([lin.weight for lin in ins])
        b_in = torch.cat([lin.bias for lin in ins]) if has_bias else None
    return OverlapMLP.from_dense(w_in, down.weight.detach(), b_in=b_in, b_out=down.bias.detach() if has_bias else None,
                                 **on(group), sequence_parallel=sp, activation="swiglu", **opts)


def _norm_weight(norm, head_dim):
    if norm is None:
        return None
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (head_dim,):
        raise Unswappable(f"q_norm/k_norm weight must have shape ({head_dim},)")
    if eps is None or abs(eps - QK_NORM_EPS) > 1e-12:
        raise Unswappable(f"q_norm/k_norm eps={eps}; OverlapAttention's qk-norm uses eps={QK_NORM_EPS}")
    return w.detach()


class _Rows:
    """q, k or v rows of a fused ``qkv_proj`` (Phi-3), with an ``nn.Linear``'s ``weight`` / ``bias``."""

    def __init__(self, lin: nn.Linear, start: int, stop: int):
        self.weight = lin.weight[start:stop]
        self.bias = lin.bias[start:stop] if lin.bias is not None else None
        self.out_features = stop - start


def partial_rotary_factor(cfg) -> float:
    """The config's ``partial_rotary_factor`` (in ``rope_parameters`` in transformers >= 5, or on the
    config itself), 1.0 where absent."""
    rope = getattr(cfg, "rope_parameters", None)
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if factor is None:
        factor = getattr(cfg, "partial_rotary_factor", None)
    return 1.0 if factor is None else float(factor)


def _build_attention(module, group, opts) -> nn.Module:
    hf_deepseek.refuse_mla(module)
    cfg = getattr(module, "config", None)
    d = getattr(module, "head_dim", None)
    nq = getattr(cfg, "num_attention_heads", None)
    nkv = getattr(cfg, "num_key_value_heads", None) or nq
    o = _linear(module, "o_proj")
    if hasattr(module, "qkv_proj"):  # Phi-3: one qkv_proj, rows q heads, then k, then v
        qkv = _linear(module, "qkv_proj")
        if not (isinstance(d, int) and isinstance(nq, int) and qkv.out_features == (nq + 2 * nkv) * d):
            raise Unswappable(f"cannot read the head layout (head_dim={d}, num_attention_heads={nq}, "
                               f"num_key_value_heads={nkv}, qkv_proj {tuple(qkv.weight.shape)})")
        _check_plain([qkv.weight, qkv.bias])
        q, k, v = (_Rows(qkv, a * d, b * d) for a, b in ((0, nq), (nq, nq + nkv), (nq + nkv, nq + 2 * nkv)))
    else:
        q, k, v = (_linear(module, n) for n in ("q_proj", "k_proj", "v_proj"))
    if not (isinstance(d, int) and isinstance(nq, int) and q.out_features == nq * d and k.out_features == nkv * d):
        raise Unswappable(f"cannot read the head layout (head_dim={d}, num_attention_heads={nq}, "
                           f"num_key_value_heads={nkv}, q_proj {tuple(q.weight.shape)})")
    if partial_rotary_factor(cfg) != 1.0:
        raise Unswappable(f"partial_rotary_factor={partial_rotary_factor(cfg)} (RoPE on part of head_dim); "
                           f"OverlapAttention rotates the whole head")
    if not getattr(module, "is_causal", True):
        raise Unswappable("is_causal=False (OverlapAttention is swapped in for causal decoders only)")
    biases = [q.bias, k.bias, v.bias, o.bias]
    if len({b is None for b in biases}) > 1:
        raise Unswappable("some but not all of q/k/v/o_proj have a bias (OverlapAttention takes all four or none)")
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if (q_norm is None) != (k_norm is None):
        raise Unswappable("only one of q_norm / k_norm")
    _check_plain([q.weight, k.weight, v.weight, o.weight, *biases])
    det = lambda t: t.detach() if t is not None else None  # noqa: E731
    # Qwen3 keeps the layer's window on the module (None for full-attention layers); Mistral and
    # Mixtral read config.sliding_window in forward.
    sliding = getattr(module, "sliding_window") if hasattr(module, "sliding_window") else \
        getattr(cfg, "sliding_window", None)
    sp, target, opts = sequence_options(opts)
    dense = dict(wq=q.weight.detach(), wk=k.weight.detach(), wv=v.weight.detach(), wo=o.weight.detach(), num_heads=nq,
                 num_kv_heads=nkv, bq=det(q.bias), bk=det(k.bias), bv=det(v.bias), bo=det(o.bias),
                 q_norm=_norm_weight(q_norm, d), k_norm=_norm_weight(k_norm, d), rope_theta=None, causal=True,
                 softmax_scale=getattr(module, "scaling", None),
                 dropout_p=float(getattr(module, "attention_dropout", 0.0)))
    layer = ulysses_attention(dense, on(group), opts) if target == "ulysses" else \
        OverlapAttention.from_dense(**dense, **on(group), sequence_parallel=sp, **opts)
    return (HFSequenceAttention if sp else HFAttention)(
        layer, layer_idx=getattr(module, "layer_idx", None),
        sliding_window=sliding if isinstance(sliding, int) else None, source=type(module).__name__)


def _build_moe(module, group, opts) -> nn.Module:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    rw = getattr(gate, "weight", None)
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not all(isinstance(t, torch.Tensor) for t in (rw, gu, dn)) or rw.dim() != 2 or gu.dim() != 3 or dn.dim() != 3:
        raise Unswappable("expected gate.weight [E, H], experts.gate_up_proj [E, 2F, H], experts.down_proj [E, H, F]")
    for flag, want in (("is_transposed", False), ("is_concatenated", True), ("has_bias", False), ("has_gate", True),
                       ("has_post_expert_norm", False)):
        if getattr(experts, flag, want) != want:
            raise Unswappable(f"experts.{flag}={getattr(experts, flag)} (OverlapMoE needs {flag}={want})")
    if getattr(experts, "_is_expert_parallel", False):
        raise Unswappable("the experts are already expert-parallel (HF's own tp_plan)")
    if not _is_silu(getattr(experts, "act_fn", None)):
        raise Unswappable(f"expert activation {getattr(experts, 'act_fn', None)!r} is not SiLU (swiglu)")
    jitter = getattr(module, "jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise Unswappable(f"router_jitter_noise={jitter} > 0 is not implemented by OverlapMoE")
    top_k = getattr(gate, "top_k", None) or getattr(module, "top_k", None)
    if not isinstance(top_k, int):
        raise Unswappable("cannot read top_k from the router")
    # Mixtral always renormalises the top-k probabilities; Qwen3-MoE does when norm_topk_prob;
    # DeepSeek's router, bias and shared experts: hf_deepseek.py
    kw = {"normalize_topk": bool(getattr(gate, "norm_topk_prob", True)), **hf_deepseek.moe_kwargs(module, rw.shape[0])}
    _check_plain([rw, gu, dn] + [v for v in kw.values() if isinstance(v, torch.Tensor)])
    sp, _, opts = sequence_options(opts)
    layer = OverlapMoE.from_dense(rw.detach(), gu.detach(), dn.detach(), top_k=top_k, **on(group),
                                  activation="swiglu", **kw, **opts)
    new = (HFSequenceMoE if sp else HFMoE)(layer, gate, source=type(module).__name__)
    hf_deepseek.tie_bias(new)
    return new


def _block_norm(norm, hidden: int):
    """``(weight, eps)`` of an HF RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``)."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor) or tuple(w.shape) != (hidden,) \
            or not isinstance(eps, float):
        raise Unswappable(f"{type(norm).__name__} is not an RMSNorm with weight [{hidden}] and a float eps")
    _check_plain([w])
    return w.detach(), eps


def _build_block(module, group, opts, known) -> nn.Module:
    attn, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
    n1, n2 = getattr(module, "input_layernorm", None), getattr(module, "post_attention_layernorm", None)
    mlp_kind = kind_by_type(mlp, known, ("mlp", "moe")) if mlp is not None else None
    if kind_by_type(attn, known, ("attention",)) is None or mlp_kind is None or n1 is None or n2 is None:
        raise Unswappable("expected self_attn (a known attention class), mlp (a known MLP / MoE class), "
                           "input_layernorm and post_attention_layernorm")
    for name in ("resid_attn_dropout", "resid_mlp_dropout"):  # Phi-3's residual dropouts
        p = getattr(getattr(module, name, None), "p", 0.0)
        if p:
            raise Unswappable(f"{name}.p={p} (resid_pdrop > 0): OverlapTransformerBlock has no residual dropout")
    hf_attn = _build_attention(attn, group, opts)
    H = hf_attn.layer.hidden_size
    (w1, eps1), (w2, eps2) = _block_norm(n1, H), _block_norm(n2, H)
    if eps1 != eps2:
        raise Unswappable(f"the two norms' eps differ ({eps1}, {eps2})")
    gate = None
    if mlp_kind == "moe":
        hf_moe = _build_moe(mlp, group, opts)
        layer, gate = hf_moe.layer, hf_moe.gate
    else:
        layer = _build_mlp(mlp, group, opts)
    block = OverlapTransformerBlock.from_layers(hf_attn.layer, layer, norm="rmsnorm", norm_eps=eps1,
                                                attn_norm_weight=w1, mlp_norm_weight=w2)
    return (HFSequenceBlock if block.sequence_parallel else HFBlock)(
        block, gate, layer_idx=hf_attn.layer_idx, sliding_window=hf_attn.sliding_window, source=type(module).__name__)


# ---------------------------------------------------------------------------- state-dict layouts
def _mlp_entries(hf: str = "", ours: str = "", module=None) -> list:
    """An HF MLP's entries: gate and up are ``w_in`` / ``b_in`` ``[0]`` and ``[1]``; a fused
    ``gate_up_proj`` (Phi-3) is the whole ``w_in`` / ``b_in``."""
    if module is not None and hasattr(module, "gate_up_proj"):
        rows = (module.gate_up_proj.out_features,)
        return [Entry(f"{hf}gate_up_proj.weight", (f"{ours}w_in",), rows=rows),
                Entry(f"{hf}gate_up_proj.bias", (f"{ours}b_in",), rows=rows),
                Entry(f"{hf}down_proj.weight", (f"{ours}w_out",)), Entry(f"{hf}down_proj.bias", (f"{ours}b_out",))]
    return [Entry(f"{hf}gate_proj.weight", (f"{ours}w_in",), 0), Entry(f"{hf}gate_proj.bias", (f"{ours}b_in",), 0),
            Entry(f"{hf}up_proj.weight", (f"{ours}w_in",), 1), Entry(f"{hf}up_proj.bias", (f"{ours}b_in",), 1),
            Entry(f"{hf}down_proj.weight", (f"{ours}w_out",)), Entry(f"{hf}down_proj.bias", (f"{ours}b_out",))]


_ATTENTION_NAMES = {"q_proj.weight": "wq", "q_proj.bias": "bq", "k_proj.weight": "wk", "k_proj.bias": "bk",
                    "v_proj.weight": "wv", "v_proj.bias": "bv", "o_proj.weight": "wo", "o_proj.bias": "bo",
                    "q_norm.weight": "q_norm", "k_norm.weight": "k_norm"}


def _attention_entries(hf: str = "", ours: str = "layer.", module=None) -> list:
    """An HF attention's entries; a fused ``qkv_proj`` (Phi-3) is ``wq``, ``wk``, ``wv`` one after the other."""
    out = [Entry(hf + theirs, (ours + name,)) for theirs, name in _ATTENTION_NAMES.items()]
    if module is not None and hasattr(module, "qkv_proj"):
        d, cfg = module.head_dim, module.config
        nq = cfg.num_attention_heads
        nkv = cfg.num_key_value_heads or nq
        rows = (nq * d, nkv * d, nkv * d)
        out += [Entry(f"{hf}qkv_proj.{w}", tuple(f"{ours}{w[0]}{x}" for x in "qkv"), rows=rows)
                for w in ("weight", "bias")]
    return out


def _moe_entries(hf: str = "", ours: str = "layer.", router: str = "gate.") -> list:
    """An HF sparse-MoE block's entries: HF's router weight is tied to the layer's ``router_weight``."""
    return [Entry(f"{hf}gate.weight", (f"{router}weight", f"{ours}router_weight")),
            Entry(f"{hf}experts.gate_up_proj", (f"{ours}w_in",)), Entry(f"{hf}experts.down_proj", (f"{ours}w_out",)),
            *hf_deepseek.entries(hf, ours, router)]


def _mlp(module, group, opts) -> nn.Module:
    new = _build_mlp(module, group, opts)
    keep_hf_state(new, module, _mlp_entries(module=module))
    return new


def _attention(module, group, opts) -> nn.Module:
    new = _build_attention(module, group, opts)
    keep_hf_state(new, module, _attention_entries(module=module))
    return new


def _moe(module, group, opts) -> nn.Module:
    new = _build_moe(module, group, opts)
    keep_hf_state(new, module, _moe_entries())
    return new


def build_block(module, group, opts, known) -> nn.Module:
    new = _build_block(module, group, opts, known)
    moe = isinstance(new.block.mlp, OverlapMoE)
    mlp = _moe_entries("mlp.", "block.mlp.") if moe else _mlp_entries("mlp.", "block.mlp.", module.mlp)
    keep_hf_state(new, module, _attention_entries("self_attn.", "block.attention.", module.self_attn) + mlp + [
        Entry("input_layernorm.weight", ("block.attn_norm.weight",)),
        Entry("post_attention_layernorm.weight", ("block.mlp_norm.weight",))])
    return new


BUILDERS = {"mlp": _mlp, "attention": _attention, "moe": _moe}
OURS = (OverlapMLP, OverlapAttention, OverlapMoE, OverlapTransformerBlock, HFAttention, HFMoE, HFBlock)
