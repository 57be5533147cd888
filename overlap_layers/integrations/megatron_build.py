"""The megatron-core modules ``swap`` recognises, and how each becomes an overlap layer (the
builders :func:`.megatron.swap` calls):

=====================================================  ==============================================
megatron-core module (local spec)                      replaced by
=====================================================  ==============================================
``MLP`` (not an expert): ``linear_fc1``                :class:`MegatronMLP` around :class:`OverlapMLP`
ColumnParallelLinear, ``linear_fc2`` RowParallelLinear  (swiglu = ``gated_linear_unit`` + silu; gelu
                                                       / relu without gating; biases when
                                                       ``add_bias_linear``)
``SelfAttention``: ``linear_qkv`` ColumnParallelLinear  :class:`MegatronAttention` around
(interleaved per query group), ``DotProductAttention``  :class:`OverlapAttention` (GQA, causal, RoPE
core, ``linear_proj`` RowParallelLinear                from Megatron's ``rotary_pos_emb``; biases when
                                                       ``add_bias_linear``)
with ``block=True``: ``TransformerLayer`` (torch        :class:`MegatronBlock` around
LayerNorm / RMSNorm, no cross-attention, no hidden     :class:`OverlapTransformerBlock`: the two above
dropout)                                               and the layer's norms
=====================================================  ==============================================

Megatron's ``config.sequence_parallel`` (with a tensor-parallel size > 1) maps to
``sequence_parallel=True``: the input ``[s/tp, b, h]`` is rank r's positions ``r*s/tp ..``, as
our layers expect. Everything else (embeddings, norms, the output layer, the rotary module, MoE
layers) stays as it is. Not swapped, left with a warning: Transformer Engine linears (which may
fuse the layernorm), experts / MoE, q/k layernorm, interleaved or partial RoPE, sliding windows,
non-vanilla softmax, an attention output gate, context parallelism, ``num_query_groups`` smaller
than the group, GLU variants other than swiglu, clamped activations, Megatron's fused (tanh) gelu.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..layers import OverlapAttention, OverlapMLP, OverlapTransformerBlock
from .megatron_adapters import MegatronAttention, MegatronBlock, MegatronMLP
from .megatron_weights import check_group, copy_tp_attrs, megatron_dense
from .replace import Unswappable, group_of, on

_LOOKALIKE_SUFFIXES = {"mlp": ("MLP", "FeedForward", "FFN"), "attention": ("Attention",),
                       "moe": ("MoELayer", "MoE", "Experts")}


def _linears(module, names, M):
    out = []
    for name, want in names:
        lin = getattr(module, name, None)
        if type(lin) is not M[want]:
            raise Unswappable(f"{name} is {type(lin).__name__}, not megatron-core's {want} (only the local spec's "
                               f"linears are swapped; Transformer Engine linears, which may fuse the layernorm, "
                               f"are not)")
        if getattr(lin, "is_expert", False):
            raise Unswappable(f"{name} is an expert linear (MoE)")
        if getattr(lin, "weight", None) is None:
            raise Unswappable(f"{name} has no weight of its own (skip_weight_param_allocation)")
        out.append(lin)
    return out


def _check_plain(tensors) -> None:
    for t in tensors:
        if t is not None and type(t) not in (nn.Parameter, torch.Tensor):
            raise Unswappable(f"weights are {type(t).__name__}s; swap a model with plain tensors")


def _activation(cfg) -> str:
    f = cfg.activation_func
    if getattr(cfg, "use_te_activation_func", False):
        raise Unswappable("use_te_activation_func=True (Transformer Engine activation)")
    if getattr(cfg, "activation_func_clamp_value", None) is not None:
        raise Unswappable(f"activation_func_clamp_value={cfg.activation_func_clamp_value} (clamped GLU)")
    if cfg.gated_linear_unit:
        if getattr(cfg, "glu_linear_offset", 0.0):
            raise Unswappable(f"glu_linear_offset={cfg.glu_linear_offset}")
        if f is F.silu:
            return "swiglu"
        raise Unswappable(f"gated_linear_unit with activation {getattr(f, '__name__', f)!r} (only silu: swiglu)")
    if f is F.gelu:
        if cfg.bias_activation_fusion:
            raise Unswappable("bias_activation_fusion=True with gelu (Megatron's fused gelu is the tanh "
                               "approximation; OverlapMLP's gelu is exact)")
        return "gelu"
    if f is F.relu:
        return "relu"
    raise Unswappable(f"activation {getattr(f, '__name__', f)!r} (OverlapMLP has swiglu, gelu, relu)")


def _tp_size(lin) -> int:
    return dist.get_world_size(lin.tp_group)


def _build_mlp(module, group, opts, M) -> nn.Module:
    fc1, fc2 = _linears(module, (("linear_fc1", "ColumnParallelLinear"), ("linear_fc2", "RowParallelLinear")), M)
    cfg = module.config
    act = _activation(cfg)
    if (fc1.bias is None) != (fc2.bias is None):
        raise Unswappable("only one of linear_fc1 / linear_fc2 has a bias")
    _check_plain([fc1.weight, fc2.weight, fc1.bias, fc2.bias])
    meg_tp = _tp_size(fc1)
    w = megatron_dense(module)
    sp = bool(cfg.sequence_parallel) and meg_tp > 1
    layer = OverlapMLP.from_dense(w["w_in"], w["w_out"], b_in=w["b_in"], b_out=w["b_out"], **on(group),
                                  sequence_parallel=sp, activation=act, **opts)
    if meg_tp > 1:  # [Note: Megatron weights]: the same shards as Megatron's, the same attributes
        for src, dst in ((fc1.weight, layer.w_in), (fc1.bias, layer.b_in), (fc2.weight, layer.w_out),
                         (fc2.bias, layer.b_out)):
            copy_tp_attrs(src, dst)
    return MegatronMLP(layer, source=type(module).__name__)


def _build_attention(module, group, opts, M) -> nn.Module:
    qkv, proj = _linears(module, (("linear_qkv", "ColumnParallelLinear"), ("linear_proj", "RowParallelLinear")), M)
    cfg = module.config
    if type(getattr(module, "core_attention", None)) is not M["DotProductAttention"]:
        raise Unswappable(f"core_attention is {type(getattr(module, 'core_attention', None)).__name__}, not "
                           f"megatron-core's DotProductAttention")
    if module.attn_mask_type != M["AttnMaskType"].causal:
        raise Unswappable(f"attn_mask_type={module.attn_mask_type} (only causal)")
    for flag, bad in (("attention_output_gate", True), ("rotary_interleaved", True), ("multi_latent_attention", True)):
        if getattr(cfg, flag, False) == bad:
            raise Unswappable(f"{flag}={bad}" + (" (interleaved RoPE; OverlapAttention rotates halves)"
                                                  if flag == "rotary_interleaved" else ""))
    if getattr(cfg, "window_size", None) is not None:
        raise Unswappable(f"window_size={cfg.window_size} (sliding-window attention)")
    if getattr(cfg, "softmax_type", "vanilla") != "vanilla":
        raise Unswappable(f"softmax_type={cfg.softmax_type!r} (only 'vanilla')")
    cp = getattr(getattr(module, "pg_collection", None), "cp", None)
    if (cp is not None and dist.get_world_size(cp) > 1) or getattr(cfg, "context_parallel_size", 1) > 1:
        raise Unswappable("context parallelism (context_parallel_size > 1)")
    for name in ("q_layernorm", "k_layernorm"):
        norm = getattr(module, name, None)
        if norm is not None and not isinstance(norm, M["IdentityOp"]):
            raise Unswappable(f"{name} ({type(norm).__name__}): q/k layernorm is not swapped (Megatron's norm "
                               f"modules are not mapped to OverlapAttention's qk-norm)")
    nq, ng = cfg.num_attention_heads, cfg.num_query_groups
    ws = dist.get_world_size(group_of(group))
    if ng < ws:
        raise Unswappable(f"num_query_groups={ng} < group size {ws} (KV heads replicated over the group are not "
                           f"swapped into Megatron models)")
    if (qkv.bias is None) != (proj.bias is None):
        raise Unswappable("only one of linear_qkv / linear_proj has a bias (add_qkv_bias without add_bias_linear); "
                           "OverlapAttention takes all biases or none")
    _check_plain([qkv.weight, proj.weight, qkv.bias, proj.bias])
    meg_tp = _tp_size(qkv)
    w = megatron_dense(module)
    sp = bool(cfg.sequence_parallel) and meg_tp > 1
    layer = OverlapAttention.from_dense(
        w["wq"], w["wk"], w["wv"], w["wo"], num_heads=nq, num_kv_heads=ng, bq=w["bq"], bk=w["bk"], bv=w["bv"],
        bo=w["bo"], **on(group), sequence_parallel=sp, rope_theta=None, causal=True, softmax_scale=cfg.softmax_scale,
        dropout_p=float(cfg.attention_dropout), **opts)
    if meg_tp > 1:
        for src, dst in ((qkv.weight, layer.wq), (qkv.weight, layer.wk), (qkv.weight, layer.wv),
                         (qkv.bias, layer.bq), (qkv.bias, layer.bk), (qkv.bias, layer.bv),
                         (proj.weight, layer.wo), (proj.bias, layer.bo)):
            copy_tp_attrs(src, dst)
    layer_number = getattr(module, "layer_number", 1)
    no_rope = bool(cfg.no_rope_freq[layer_number - 1]) if getattr(cfg, "no_rope_freq", None) else False
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import \
            _yarn_get_concentration_factor_from_config as yarn_m
        mscale = float(yarn_m(cfg))
    except ImportError:  # pragma: no cover - moved in another megatron-core version
        mscale = 1.0
    return MegatronAttention(layer, layer_number=layer_number, no_rope=no_rope, mscale=mscale,
                             source=type(module).__name__)


def _block_norm(norm) -> tuple:
    """``(kind, weight, bias, eps)`` of a torch LayerNorm / RMSNorm (Megatron's torch norms)."""
    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and norm.bias is not None:
        return "layernorm", norm.weight, norm.bias, float(norm.eps)
    if isinstance(norm, nn.RMSNorm) and norm.elementwise_affine and isinstance(norm.eps, float):
        return "rmsnorm", norm.weight, None, norm.eps
    raise Unswappable(f"{type(norm).__name__} is not a torch LayerNorm (with bias) / RMSNorm (with a float eps)")


def build_block(module, group, opts, M) -> nn.Module:
    cfg = module.config
    for name in ("pre_cross_attn_layernorm", "cross_attention"):
        if not isinstance(getattr(module, name, None), (M["IdentityOp"], type(None))):
            raise Unswappable(f"{name} is {type(getattr(module, name)).__name__} (cross-attention)")
    for what, bad in (("hidden_dropout", float(module.hidden_dropout) != 0.0),
                      ("apply_residual_connection_post_layernorm", cfg.apply_residual_connection_post_layernorm),
                      ("fp32_residual_connection", cfg.fp32_residual_connection)):
        if bad:
            raise Unswappable(f"{what}={getattr(module, what, getattr(cfg, what, None))} (the block adds plain "
                               f"residuals in the activations' dtype)")
    if type(module.self_attention) is not M["SelfAttention"] or type(module.mlp) is not M["MLP"]:
        raise Unswappable(f"self_attention {type(module.self_attention).__name__} / mlp "
                           f"{type(module.mlp).__name__}: need megatron-core's SelfAttention and (dense) MLP")
    (k1, w1, b1, e1), (k2, w2, b2, e2) = _block_norm(module.input_layernorm), _block_norm(module.pre_mlp_layernorm)
    if (k1, e1) != (k2, e2):
        raise Unswappable(f"the two norms differ ({k1}, eps={e1}; {k2}, eps={e2})")
    _check_plain([w1, b1, w2, b2])
    attn = _build_attention(module.self_attention, group, opts, M)
    mlp = _build_mlp(module.mlp, group, opts, M)
    det = lambda t: None if t is None else t.detach()  # noqa: E731
    block = OverlapTransformerBlock.from_layers(attn.layer, mlp.layer, norm=k1, norm_eps=e1,
                                                attn_norm_weight=det(w1), attn_norm_bias=det(b1),
                                                mlp_norm_weight=det(w2), mlp_norm_bias=det(b2))
    for src, dst in ((w1, block.attn_norm.weight), (b1, block.attn_norm.bias), (w2, block.mlp_norm.weight),
                     (b2, block.mlp_norm.bias)):
        copy_tp_attrs(src, dst)  # Megatron tags its norms sequence_parallel: its reduction covers ours
    return MegatronBlock(block, layer_number=attn.layer_number, no_rope=attn.no_rope, mscale=attn.rope.mscale,
                         source=type(module).__name__)


BUILDERS = {"mlp": _build_mlp, "attention": _build_attention}
OURS = (OverlapMLP, OverlapAttention, OverlapTransformerBlock, MegatronMLP, MegatronAttention, MegatronBlock)


# ---------------------------------------------------------------------------- recognition
def known_classes(M) -> dict:
    """kind -> the megatron-core classes of that kind ``swap`` replaces module by module."""
    return {"mlp": (M["MLP"],), "attention": (M["SelfAttention"],), "moe": ()}


def kind_by_type(module, known: dict):
    return next((k for k, classes in known.items() if type(module) in classes), None)


def lookalike_kind(module):
    name = type(module).__name__
    return next((k for k, suf in _LOOKALIKE_SUFFIXES.items() if name.endswith(suf)), None)


def block_kind(module, M):
    """``"block"`` for a megatron-core ``TransformerLayer`` (``swap(..., block=True)``), else None."""
    return "block" if type(module) is M["TransformerLayer"] else None


def block_lookalike(module):
    return "block" if type(module).__name__.endswith("TransformerLayer") else None


def check_groups(todo, group) -> None:
    """[Note: Megatron weights]: ``group`` is Megatron's TP group for every module to build (a wrong
    group is the caller's error: raised before anything is built)."""
    for name, module, kind, opts in todo:
        sub = {"mlp": (module,), "attention": (module,)}.get(kind) or (module.mlp, module.self_attention)
        for m, k in zip(sub, ("mlp", "attention") if kind == "block" else (kind,)):
            if all(hasattr(m, a) for a in (("linear_fc1",) if k == "mlp" else ("linear_qkv",))):
                check_group(m, k, group)
