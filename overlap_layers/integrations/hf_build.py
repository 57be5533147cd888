"""How a Hugging Face style module described by a spec (:mod:`.hf_specs`; a plan's, or its
class's in :mod:`.hf_families`) becomes an overlap layer: the builders :func:`.hf.swap` calls,
generic over the specs.

Reference: the replacement equals the replaced module (the spec's forward, :mod:`.hf_specs`) on
its inputs, up to rounding, and holds its weights exactly:

=================  ===================================================================================
spec               replaced by
=================  ===================================================================================
``MLPSpec``        :class:`OverlapMLP` (``sequence_parallel=sp``; ``swiglu`` or ``geglu_tanh``):
                   ``w_in`` = gate rows then up rows (a fused ``gate_up`` as it is), ``w_out`` =
                   down; biases on all three or none
``AttentionSpec``  :class:`HFAttention` around :class:`OverlapAttention` (``sequence_parallel=sp``;
                   GQA; q_norm / k_norm, Gemma's ``(1 + w)`` through ``qk_norm_offset=1``; HF's
                   (cos, sin), so RoPE scaling is exact; the module's ``scaling``; q/k/v biases
                   and the o bias each where present; a fused ``qkv`` split into q, k, v;
                   ``partial_rotary_factor`` must be 1, a logit soft cap None, no ``latent_kv``:
                   DeepSeek's multi-head latent attention stays dense, warned)
``MoESpec``        :class:`HFMoE` around :class:`OverlapMoE` (expert parallel; top-k renormalised
                   where ``normalize_topk``; ``Router.DEEPSEEK``: ``routing=Routing(...)`` and
                   V3's ``e_score_correction_bias`` from the router, :mod:`.hf_deepseek`; a shared
                   expert as ``shared_w_in`` / ``shared_w_out``, its sigmoid gate as ``shared_gate``)
``BlockSpec``      :class:`HFBlock` around :class:`OverlapTransformerBlock` (``swap(..., block=True)``,
                   ``sequence_parallel=sp``): the layer's attention and MLP / MoE as above, its two
                   RMSNorms inside the block (residual dropouts, e.g. Phi-3's ``resid_pdrop``, must be 0)
=================  ===================================================================================

``sp``: ``swap``'s ``sequence_parallel``, which ``swap`` hands the builders in their options with
``attention`` (:func:`.hf_sequence.sequence_options`); with ``sequence_parallel=True`` the adapters
are :mod:`.hf_sequence`'s (:class:`HFSequenceAttention`, :class:`HFSequenceMoE`,
:class:`HFSequenceBlock`), and with ``attention="ulysses"`` the attention is a
:class:`UlyssesAttention` (which has no ``qk_norm_offset``: an ``AttentionSpec`` with
``NormWeight.ONE_PLUS`` q/k norms is then left, warned).

A builder raises :class:`~.replace.Unswappable` for a module it cannot replace (a name the spec
gives that the module lacks, an activation other than the spec's, partial biases, qk-norm eps,
router jitter, ...): it is left, warned.

Each replacement keeps the replaced module's state-dict layout (:mod:`.hf_state`, [Note: swapped
state dicts]); the spec names its entries, the inverse of what the builders read (names below are
the defaults):

==========================================  =========================================================
the replaced module's entry                 the replacement's parameter
==========================================  =========================================================
``gate_proj.weight`` / ``.bias``            ``w_in`` / ``b_in`` ``[0]`` (global form ``[2, F, ...]``)
``up_proj.weight`` / ``.bias``              ``w_in`` / ``b_in`` ``[1]``
``down_proj.weight`` / ``.bias``            ``w_out`` / ``b_out``
``{q,k,v,o}_proj.weight`` / ``.bias``       ``layer.w{q,k,v,o}`` / ``layer.b{q,k,v,o}``
a fused ``gate_up`` (Phi-3's)               ``w_in`` whole (fused entries: ``Entry.rows``, below)
a fused ``qkv`` (Phi-3's)                   ``layer.wq``, ``layer.wk``, ``layer.wv`` (rows in turn)
``q_norm.weight``, ``k_norm.weight``        ``layer.q_norm``, ``layer.k_norm`` (Gemma's offsets as
                                            they are)
``gate.weight`` (the router)                ``gate.weight``, tied to ``layer.router_weight`` once the
                                            replacement is accepted (:func:`.hf_adapters.tie_router`)
``gate.e_score_correction_bias`` (V3)       ``layer.e_score_correction_bias`` (a buffer), tied likewise
``experts.gate_up_proj``, ``.down_proj``    ``layer.w_in``, ``layer.w_out`` (``[E, 2F, H]``, ``[E, H, F]``)
``shared_expert.{gate,up}_proj.weight``     ``layer.shared_w_in`` ``[0]``, ``[1]`` (its global form
(DeepSeek: ``shared_experts.``)             ``[2, sF, H]``), ``down_proj.weight``: ``shared_w_out``
``shared_expert_gate.weight``               ``layer.shared_gate``
a decoder layer's ``self_attn.*``,          ``block.attention.*``, ``block.mlp.*`` (the MoE's router:
``mlp.*``, ``input_layernorm.weight``,      ``gate.weight``), ``block.attn_norm.weight``,
``post_attention_layernorm.weight``         ``block.mlp_norm.weight``
==========================================  =========================================================

A fused entry is the concatenation of several parameters' global values, sharded differently (q
heads, kv heads, gate and up rows), which no one DTensor placement expresses: it is a
``Replicate()`` DTensor gathered in ``state_dict()`` (a collective; with plain parameters the
whole plain tensor), and loads from the whole tensor ([Note: swapped state dicts]).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import nn

from ..layers import OverlapAttention, OverlapMLP, OverlapMoE, OverlapTransformerBlock
from ..layers.attention.core import QK_NORM_EPS
from .hf_adapters import HFAttention, HFBlock, HFMoE, tie_router
from .hf_deepseek import router_kwargs
from .hf_sequence import HFSequenceAttention, HFSequenceBlock, HFSequenceMoE, sequence_options, ulysses_attention
from .hf_specs import Activation, AttentionSpec, BlockSpec, MLPSpec, MoESpec, NormWeight, Router
from .hf_state import Entry, keep_hf_state
from .replace import Unswappable, on

# Class names that look like a swappable module (an unknown one of these is warned about).
_LOOKALIKE_SUFFIXES = {"mlp": ("MLP", "FeedForward", "FFN"), "attention": ("Attention",),
                       "moe": ("MoeBlock", "MoEBlock", "MoE", "Moe", "Experts"), "block": ("DecoderLayer",)}
# the layers' name of each gated activation
_LAYER_ACTIVATION = {Activation.SILU: "swiglu", Activation.GELU_TANH: "geglu_tanh"}


def kind_by_type(module: nn.Module, known: Dict[type, object], kinds: Sequence[str]) -> Optional[str]:
    """The kind of ``module``'s class in ``known`` (class -> spec), if one of ``kinds``."""
    spec = known.get(type(module))
    return spec.kind if spec is not None and spec.kind in kinds else None


def lookalike_kind(module: nn.Module, kinds: Sequence[str]) -> Optional[str]:
    name = type(module).__name__
    for kind in kinds:
        if name.endswith(_LOOKALIKE_SUFFIXES[kind]):
            return kind
    return None


# ---------------------------------------------------------------------------- reading a module
def _find(module, path: Optional[str]):
    """``module``'s attribute along the dotted ``path``; None where absent (or ``path`` is None)."""
    if path is None:
        return None
    obj = module
    for name in path.split("."):
        obj = getattr(obj, name, None)
    return obj


def _attr(module, path: str, what: str = "sub-module"):
    """``module``'s attribute along the dotted ``path`` (Unswappable where absent)."""
    obj = _find(module, path)
    if obj is None:
        raise Unswappable(f"{type(module).__name__} has no {what} {path!r} (the spec's name)")
    return obj


def _linear(module, path: str) -> nn.Linear:
    lin = _attr(module, path)
    if not isinstance(lin, nn.Linear):
        raise Unswappable(f"{path} is a {type(lin).__name__}, not an nn.Linear")
    return lin


def _check_plain(tensors) -> None:
    for t in tensors:
        if t is not None and type(t) not in (nn.Parameter, torch.Tensor):
            raise Unswappable(f"weights are {type(t).__name__}s (already sharded?); swap a model with plain tensors")


def _check_activation(module, attr: Optional[str], activation: Activation) -> None:
    """The module's activation (its attribute ``attr``) equals ``activation`` on a few points."""
    if attr is None:
        return
    fn = _find(module, attr)
    t = torch.tensor([-2.0, -0.5, 0.0, 0.7, 3.0])
    try:
        out = fn(t)
        same = isinstance(out, torch.Tensor) and torch.allclose(out, activation.reference(t), atol=1e-6)
    except Exception:  # noqa: BLE001 - anything that is not the activation
        same = False
    if not same:
        raise Unswappable(f"activation {fn!r} ({attr}) is not {activation} (the spec's)")


def _gated_weights(module, spec: MLPSpec):
    """``(w_in, b_in, w_out, b_out)`` of a gated MLP: gate rows then up rows."""
    ins = [_linear(module, spec.gate_up)] if spec.gate_up else [_linear(module, n) for n in (spec.gate, spec.up)]
    down = _linear(module, spec.down)
    biases = [lin.bias for lin in ins] + [down.bias]
    if len({b is None for b in biases}) > 1:
        raise Unswappable("some but not all of the MLP's projections have a bias")
    if spec.gate_up and ins[0].out_features != 2 * down.in_features:
        raise Unswappable(f"{spec.gate_up} {tuple(ins[0].weight.shape)} is not [2 * {down.in_features}, hidden]")
    _check_plain([lin.weight for lin in ins] + [down.weight, *biases])
    has_bias = down.bias is not None
    with torch.no_grad():
        w_in = torch.cat([lin.weight for lin in ins])
        b_in = torch.cat([lin.bias for lin in ins]) if has_bias else None
    return w_in, b_in, down.weight.detach(), down.bias.detach() if has_bias else None


# ---------------------------------------------------------------------------- builders
def _build_mlp(module, spec: MLPSpec, group, opts) -> OverlapMLP:
    _check_activation(module, spec.act_fn, spec.activation)
    w_in, b_in, w_out, b_out = _gated_weights(module, spec)
    sp, _, opts = sequence_options(opts)
    return OverlapMLP.from_dense(w_in, w_out, b_in=b_in, b_out=b_out, **on(group), sequence_parallel=sp,
                                 activation=_LAYER_ACTIVATION[spec.activation], **opts)


def _norm_weight(module, path: Optional[str], head_dim: int):
    if path is None:
        return None
    norm = _attr(module, path)
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (head_dim,):
        raise Unswappable(f"{path}.weight must have shape ({head_dim},)")
    if eps is None or abs(eps - QK_NORM_EPS) > 1e-12:
        raise Unswappable(f"{path} eps={eps}; OverlapAttention's qk-norm uses eps={QK_NORM_EPS}")
    return w.detach()


class _Rows:
    """q, k or v rows of a fused qkv projection, with an ``nn.Linear``'s ``weight`` / ``bias``."""

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


def _heads(module, spec: AttentionSpec) -> tuple:
    """``(num_heads, num_kv_heads, head_dim)``: the spec's, else the module's config / ``head_dim``."""
    cfg = getattr(module, "config", None)
    nq = spec.num_heads or getattr(cfg, "num_attention_heads", None)
    nkv = spec.num_kv_heads or getattr(cfg, "num_key_value_heads", None) or nq
    return nq, nkv, spec.head_dim or getattr(module, "head_dim", None)


def _qkv(module, spec: AttentionSpec, nq: int, nkv: int, d) -> tuple:
    """The q, k, v projections (a fused one's rows, laid out as ``spec.qkv_layout``)."""
    if spec.qkv is None:
        return tuple(_linear(module, n) for n in (spec.q, spec.k, spec.v))
    qkv = _linear(module, spec.qkv)
    if not (isinstance(d, int) and isinstance(nq, int) and qkv.out_features == (nq + 2 * nkv) * d):
        raise Unswappable(f"cannot read the head layout (head_dim={d}, num_attention_heads={nq}, "
                           f"num_key_value_heads={nkv}, {spec.qkv} {tuple(qkv.weight.shape)})")
    _check_plain([qkv.weight, qkv.bias])
    return tuple(_Rows(qkv, a * d, b * d) for a, b in ((0, nq), (nq, nq + nkv), (nq + nkv, nq + 2 * nkv)))


def _build_attention(module, spec: AttentionSpec, group, opts) -> HFAttention:
    rank = _find(module, spec.latent_kv)
    if rank is not None:
        raise Unswappable(f"multi-head latent attention ({spec.latent_kv}={rank}: low-rank q / kv projections, "
                          f"rotary and non-rotary head parts) is not OverlapAttention's; it stays dense, replicated")
    cfg = getattr(module, "config", None)
    nq, nkv, d = _heads(module, spec)
    o = _linear(module, spec.o)
    q, k, v = _qkv(module, spec, nq, nkv, d)
    if not (isinstance(d, int) and isinstance(nq, int) and q.out_features == nq * d and k.out_features == nkv * d):
        raise Unswappable(f"cannot read the head layout (head_dim={d}, num_attention_heads={nq}, "
                           f"num_key_value_heads={nkv}, q {tuple(q.weight.shape)})")
    if partial_rotary_factor(cfg) != 1.0:
        raise Unswappable(f"partial_rotary_factor={partial_rotary_factor(cfg)} (RoPE on part of head_dim); "
                           f"OverlapAttention rotates the whole head")
    cap = _find(module, spec.logit_softcap)
    if cap is not None:
        raise Unswappable(f"attention logit soft-capping ({spec.logit_softcap}={cap}): OverlapAttention runs SDPA, "
                           f"which has no soft cap (a config with attn_logit_softcapping=None swaps)")
    if not getattr(module, "is_causal", True):
        raise Unswappable("is_causal=False (OverlapAttention is swapped in for causal decoders only)")
    if len({b is None for b in (q.bias, k.bias, v.bias)}) > 1:
        raise Unswappable("some but not all of the q/k/v projections have a bias (OverlapAttention takes all "
                           "three or none)")
    _check_plain([q.weight, k.weight, v.weight, o.weight, q.bias, k.bias, v.bias, o.bias])
    det = lambda t: t.detach() if t is not None else None  # noqa: E731
    # Qwen3 and Gemma keep the layer's window on the module (None for full-attention layers);
    # Mistral and Mixtral read config.sliding_window in forward.
    sliding = getattr(module, "sliding_window") if hasattr(module, "sliding_window") else \
        getattr(cfg, "sliding_window", None)
    sp, target, opts = sequence_options(opts)
    offset = 1.0 if spec.norm_weight is NormWeight.ONE_PLUS and spec.q_norm is not None else 0.0
    dense = dict(wq=q.weight.detach(), wk=k.weight.detach(), wv=v.weight.detach(), wo=o.weight.detach(), num_heads=nq,
                 num_kv_heads=nkv, bq=det(q.bias), bk=det(k.bias), bv=det(v.bias), bo=det(o.bias),
                 q_norm=_norm_weight(module, spec.q_norm, d), k_norm=_norm_weight(module, spec.k_norm, d),
                 rope_theta=None, causal=True, softmax_scale=_find(module, spec.scaling),
                 dropout_p=float(getattr(module, "attention_dropout", 0.0)))
    if target == "ulysses":
        if offset:
            raise Unswappable("q_norm / k_norm weights (1 + w) (NormWeight.ONE_PLUS): UlyssesAttention applies w; "
                              "swap with attention='overlap'")
        layer = ulysses_attention(dense, on(group), opts)
    else:
        layer = OverlapAttention.from_dense(**dense, **on(group), sequence_parallel=sp, qk_norm_offset=offset, **opts)
    return (HFSequenceAttention if sp else HFAttention)(
        layer, layer_idx=getattr(module, "layer_idx", None),
        sliding_window=sliding if isinstance(sliding, int) else None, source=type(module).__name__)


def _shared_expert(module, spec: MoESpec) -> tuple:
    """``(shared_w_in, shared_w_out, shared_gate)`` (None each without a shared expert)."""
    if spec.shared_expert is None:
        return None, None, None
    mlp = _attr(module, spec.shared_expert)
    _check_activation(mlp, spec.shared_mlp.act_fn, spec.activation)
    if spec.shared_mlp.activation is not spec.activation:
        raise Unswappable(f"the shared expert's activation {spec.shared_mlp.activation} is not the experts' "
                           f"{spec.activation} (OverlapMoE runs one activation)")
    w_in, b_in, w_out, _ = _gated_weights(mlp, spec.shared_mlp)
    if b_in is not None:
        raise Unswappable("the shared expert has biases (OverlapMoE's shared expert has none)")
    gate = None
    if spec.shared_gate is not None:
        lin = _linear(module, spec.shared_gate)
        if lin.out_features != 1 or lin.bias is not None:
            raise Unswappable(f"{spec.shared_gate} is {lin}; the shared expert's gate must be nn.Linear(H, 1) "
                               f"without bias")
        _check_plain([lin.weight])
        gate = lin.weight.detach()
    return w_in.detach(), w_out, gate


def _build_moe(module, spec: MoESpec, group, opts) -> HFMoE:
    router, experts = _attr(module, spec.router), _attr(module, spec.experts)
    rw = getattr(router, "weight", None)
    gu, dn = _attr(experts, spec.gate_up, "tensor"), _attr(experts, spec.down, "tensor")
    if not all(isinstance(t, torch.Tensor) for t in (rw, gu, dn)) or rw.dim() != 2 or gu.dim() != 3 or dn.dim() != 3:
        raise Unswappable(f"expected {spec.router}.weight [E, H], {spec.experts}.{spec.gate_up} [E, 2F, H], "
                           f"{spec.experts}.{spec.down} [E, H, F]")
    for flag, want in (("is_transposed", False), ("is_concatenated", True), ("has_bias", False), ("has_gate", True),
                       ("has_post_expert_norm", False)):
        if getattr(experts, flag, want) != want:
            raise Unswappable(f"experts.{flag}={getattr(experts, flag)} (OverlapMoE needs {flag}={want})")
    if getattr(experts, "_is_expert_parallel", False):
        raise Unswappable("the experts are already expert-parallel (HF's own tp_plan)")
    _check_activation(experts, spec.act_fn, spec.activation)
    jitter = getattr(module, "jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise Unswappable(f"router_jitter_noise={jitter} > 0 is not implemented by OverlapMoE")
    top_k = spec.top_k or getattr(router, "top_k", None) or getattr(module, "top_k", None)
    if not isinstance(top_k, int):
        raise Unswappable("cannot read top_k from the router")
    # Mixtral always renormalises the top-k probabilities; Qwen-MoE does when norm_topk_prob;
    # DeepSeek's router: hf_deepseek.py
    kw = router_kwargs(router, rw.shape[0]) if spec.routing is Router.DEEPSEEK else \
        {"normalize_topk": bool(getattr(router, "norm_topk_prob", True))}
    if spec.normalize_topk is not None:
        kw["normalize_topk"] = spec.normalize_topk
    _check_plain([rw, gu, dn, kw.get("e_score_correction_bias")])
    sw_in, sw_out, sgate = _shared_expert(module, spec)
    sp, _, opts = sequence_options(opts)
    layer = OverlapMoE.from_dense(rw.detach(), gu.detach(), dn.detach(), top_k=top_k, shared_w_in=sw_in,
                                  shared_w_out=sw_out, shared_gate=sgate, **on(group),
                                  activation=_LAYER_ACTIVATION[spec.activation], **kw, **opts)
    return (HFSequenceMoE if sp else HFMoE)(layer, router, source=type(module).__name__)


def _block_norm(module, path: str, hidden: int):
    """``(weight, eps)`` of an HF RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``)."""
    norm = _attr(module, path)
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor) or tuple(w.shape) != (hidden,) \
            or not isinstance(eps, float):
        raise Unswappable(f"{path} ({type(norm).__name__}) is not an RMSNorm with weight [{hidden}] and a float eps")
    _check_plain([w])
    return w.detach(), eps


def _sub_specs(module, spec: BlockSpec, known: dict) -> tuple:
    """The block's attention and MLP / MoE specs: the block spec's, else their classes'."""
    attn, mlp = _attr(module, spec.self_attn), _attr(module, spec.mlp)
    a_spec = spec.attention or known.get(type(attn))
    m_spec = spec.mlp_spec or known.get(type(mlp))
    if not isinstance(a_spec, AttentionSpec) or not isinstance(m_spec, (MLPSpec, MoESpec)):
        raise Unswappable(f"expected {spec.self_attn} (a known attention class, or BlockSpec.attention) and "
                           f"{spec.mlp} (a known MLP / MoE class, or BlockSpec.mlp_spec)")
    return attn, a_spec, mlp, m_spec


def _build_block(module, spec: BlockSpec, group, opts, known) -> HFBlock:
    attn, a_spec, mlp, m_spec = _sub_specs(module, spec, known)
    for name in ("resid_attn_dropout", "resid_mlp_dropout"):  # Phi-3's residual dropouts
        p = getattr(getattr(module, name, None), "p", 0.0)
        if p:
            raise Unswappable(f"{name}.p={p} (resid_pdrop > 0): OverlapTransformerBlock has no residual dropout")
    hf_attn = _build_attention(attn, a_spec, group, opts)
    H = hf_attn.layer.hidden_size
    (w1, eps1), (w2, eps2) = _block_norm(module, spec.attn_norm, H), _block_norm(module, spec.mlp_norm, H)
    if eps1 != eps2:
        raise Unswappable(f"the two norms' eps differ ({eps1}, {eps2})")
    gate = None
    if isinstance(m_spec, MoESpec):
        hf_moe = _build_moe(mlp, m_spec, group, opts)
        layer, gate = hf_moe.layer, hf_moe.gate
    else:
        layer = _build_mlp(mlp, m_spec, group, opts)
    block = OverlapTransformerBlock.from_layers(hf_attn.layer, layer, norm="rmsnorm", norm_eps=eps1,
                                                attn_norm_weight=w1, mlp_norm_weight=w2)
    return (HFSequenceBlock if block.sequence_parallel else HFBlock)(
        block, gate, layer_idx=hf_attn.layer_idx, sliding_window=hf_attn.sliding_window, source=type(module).__name__)


# ---------------------------------------------------------------------------- state-dict layouts
def _gated_entries(spec: MLPSpec, module, hf: str, ours: str, w_in: str, w_out: str) -> list:
    """A gated MLP's entries: gate and up are ``w_in[0]`` / ``[1]`` of its global form ``[2, F,
    H]`` (the layer's layout: OverlapMLP's ``w_in``, OverlapMoE's ``shared_w_in``); a fused
    ``gate_up`` the whole ``w_in``."""
    b_in, b_out = w_in.replace("w_", "b_"), w_out.replace("w_", "b_")
    down = [Entry(f"{hf}{spec.down}.weight", (f"{ours}{w_out}",)), Entry(f"{hf}{spec.down}.bias", (f"{ours}{b_out}",))]
    if spec.gate_up:
        rows = (_attr(module, spec.gate_up).out_features,)
        return [Entry(f"{hf}{spec.gate_up}.weight", (f"{ours}{w_in}",), rows=rows),
                Entry(f"{hf}{spec.gate_up}.bias", (f"{ours}{b_in}",), rows=rows)] + down
    return [Entry(f"{hf}{spec.gate}.weight", (f"{ours}{w_in}",), 0),
            Entry(f"{hf}{spec.gate}.bias", (f"{ours}{b_in}",), 0),
            Entry(f"{hf}{spec.up}.weight", (f"{ours}{w_in}",), 1),
            Entry(f"{hf}{spec.up}.bias", (f"{ours}{b_in}",), 1)] + down


def _attention_entries(spec: AttentionSpec, module, hf: str = "", ours: str = "layer.") -> list:
    """An attention's entries; a fused qkv is ``wq``, ``wk``, ``wv`` one after the other."""
    names = {spec.o: "o"} if spec.qkv else {spec.q: "q", spec.k: "k", spec.v: "v", spec.o: "o"}
    out = [Entry(f"{hf}{lin}.{w}", (f"{ours}{w[0]}{x}",)) for lin, x in names.items() for w in ("weight", "bias")]
    out += [Entry(f"{hf}{n}.weight", (f"{ours}{x}",)) for n, x in ((spec.q_norm, "q_norm"), (spec.k_norm, "k_norm"))
            if n is not None]
    if spec.qkv:
        nq, nkv, d = _heads(module, spec)
        rows = (nq * d, nkv * d, nkv * d)
        out += [Entry(f"{hf}{spec.qkv}.{w}", tuple(f"{ours}{w[0]}{x}" for x in "qkv"), rows=rows)
                for w in ("weight", "bias")]
    return out


def _moe_entries(spec: MoESpec, module, hf: str = "", ours: str = "layer.", router: str = "gate.") -> list:
    """A sparse-MoE block's entries: the router's weight is tied to the layer's ``router_weight``
    (and DeepSeek-V3's ``e_score_correction_bias`` to the layer's buffer)."""
    out = [Entry(f"{hf}{spec.router}.weight", (f"{router}weight", f"{ours}router_weight")),
           Entry(f"{hf}{spec.experts}.{spec.gate_up}", (f"{ours}w_in",)),
           Entry(f"{hf}{spec.experts}.{spec.down}", (f"{ours}w_out",))]
    if spec.routing is Router.DEEPSEEK:
        out.append(Entry(f"{hf}{spec.router}.e_score_correction_bias",
                         (f"{ours}e_score_correction_bias", f"{router}e_score_correction_bias")))
    if spec.shared_expert is not None:
        out += _gated_entries(spec.shared_mlp, _attr(module, spec.shared_expert), f"{hf}{spec.shared_expert}.", ours,
                              "shared_w_in", "shared_w_out")
    if spec.shared_gate is not None:
        out.append(Entry(f"{hf}{spec.shared_gate}.weight", (f"{ours}shared_gate",)))
    return out


def build(module, kind: str, spec, group, opts) -> nn.Module:
    """``module`` (of ``kind``: mlp, attention, moe) replaced as ``spec`` describes it, keeping its
    state-dict layout; an MoE's router tied to the layer once that layout is accepted."""
    if kind == "mlp":
        new, entries = _build_mlp(module, spec, group, opts), _gated_entries(spec, module, "", "", "w_in", "w_out")
    elif kind == "attention":
        new, entries = _build_attention(module, spec, group, opts), _attention_entries(spec, module)
    else:
        new, entries = _build_moe(module, spec, group, opts), _moe_entries(spec, module)
    keep_hf_state(new, module, entries)
    if kind == "moe":
        tie_router(new.gate, new.layer)
    return new


def build_block(module, spec: BlockSpec, group, opts, known) -> nn.Module:
    """A decoder layer replaced as ``spec`` describes it (sub-specs by class from ``known``),
    keeping its state-dict layout; an MoE's router tied to the block's once that layout is accepted."""
    new = _build_block(module, spec, group, opts, known)
    attn, a_spec, mlp, m_spec = _sub_specs(module, spec, known)
    mlp_entries = _moe_entries(m_spec, mlp, f"{spec.mlp}.", "block.mlp.") if isinstance(m_spec, MoESpec) else \
        _gated_entries(m_spec, mlp, f"{spec.mlp}.", "block.mlp.", "w_in", "w_out")
    keep_hf_state(new, module, _attention_entries(a_spec, attn, f"{spec.self_attn}.", "block.attention.")
                  + mlp_entries + [Entry(f"{spec.attn_norm}.weight", ("block.attn_norm.weight",)),
                                   Entry(f"{spec.mlp_norm}.weight", ("block.mlp_norm.weight",))])
    tie_router(new.gate, new.block.mlp)
    return new


OURS = (OverlapMLP, OverlapAttention, OverlapMoE, OverlapTransformerBlock, HFAttention, HFMoE, HFBlock)
