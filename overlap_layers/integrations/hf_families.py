"""The Hugging Face families ``swap`` recognises by type, without a plan: one row per family, each
class it swaps and the spec (:mod:`.hf_specs`) that describes it -- the same specs a user's plan
writes for a family not listed here. A family missing from the installed transformers is skipped.

Reference: each spec must equal its class's forward in transformers >= 5 (:mod:`.hf_specs`).

===============  =====================================================================================
family           classes and what their specs say beyond the defaults
===============  =====================================================================================
llama, mistral   ``*MLP`` (SwiGLU), ``*Attention`` (q/k/v/o_proj; biases as the config says),
                 ``*DecoderLayer``
qwen3            as llama, with q_norm / k_norm
qwen3_moe        as qwen3; ``Qwen3MoeSparseMoeBlock`` (router ``gate``, ``norm_topk_prob``)
mixtral          ``MixtralAttention``, ``MixtralSparseMoeBlock``, ``MixtralDecoderLayer``
phi3             fused ``qkv_proj`` and ``gate_up_proj``, activation in ``activation_fn``
gemma2           ``Gemma2MLP`` (GeGLU, gelu tanh), ``Gemma2Attention`` (``query_pre_attn_scalar``
                 scaling through ``scaling``; logit soft-capping: left dense, warned, unless the
                 config's ``attn_logit_softcapping`` is None); no decoder layers (four norms)
gemma3           ``Gemma3MLP``, ``Gemma3Attention`` (q_norm / k_norm with Gemma's ``(1 + w)``
                 weights, sliding-window layers alternating with global ones); no decoder layers
qwen2_moe        ``Qwen2MoeMLP``, ``Qwen2MoeAttention`` (q/k/v biases, none on o),
                 ``Qwen2MoeSparseMoeBlock`` (shared expert gated by ``sigmoid(shared_expert_gate)``),
                 ``Qwen2MoeDecoderLayer``
deepseek_v3,     ``DeepseekV3MLP`` / ``DeepseekV2MLP`` (the dense layers), ``DeepseekV3MoE`` /
deepseek_v2      ``DeepseekV2Moe`` (DeepSeek's router read from the module, ``Router.DEEPSEEK``:
                 V3's ``noaux_tc`` with ``e_score_correction_bias``, V2's greedy / group-limited
                 greedy; ``shared_experts``), ``DeepseekV3Attention`` / ``DeepseekV2Attention``
                 (multi-head latent attention: left dense, warned); no decoder layers
===============  =====================================================================================
"""
from __future__ import annotations

import importlib
from typing import Dict, Tuple

from .hf_specs import Activation, AttentionSpec, BlockSpec, MLPSpec, MoESpec, NormWeight, Router, Spec

SWIGLU = MLPSpec()
GEGLU = MLPSpec(activation=Activation.GELU_TANH)
ATTENTION = AttentionSpec()
QK_NORMED = AttentionSpec(q_norm="q_norm", k_norm="k_norm")
MOE = MoESpec()
BLOCK = BlockSpec()
DEEPSEEK_MOE = MoESpec(routing=Router.DEEPSEEK, shared_expert="shared_experts")
MLA = AttentionSpec(latent_kv="kv_lora_rank")

#: (family, ((class name, spec), ...)): the family's module is ``transformers.models.{family}.modeling_{family}``
FAMILIES: Tuple[Tuple[str, Tuple[Tuple[str, Spec], ...]], ...] = (
    ("llama", (("LlamaMLP", SWIGLU), ("LlamaAttention", ATTENTION), ("LlamaDecoderLayer", BLOCK))),
    ("mistral", (("MistralMLP", SWIGLU), ("MistralAttention", ATTENTION), ("MistralDecoderLayer", BLOCK))),
    ("qwen3", (("Qwen3MLP", SWIGLU), ("Qwen3Attention", QK_NORMED), ("Qwen3DecoderLayer", BLOCK))),
    ("qwen3_moe", (("Qwen3MoeMLP", SWIGLU), ("Qwen3MoeAttention", QK_NORMED), ("Qwen3MoeSparseMoeBlock", MOE),
                   ("Qwen3MoeDecoderLayer", BLOCK))),
    ("mixtral", (("MixtralAttention", ATTENTION), ("MixtralSparseMoeBlock", MOE), ("MixtralDecoderLayer", BLOCK))),
    ("phi3", (("Phi3MLP", MLPSpec(gate_up="gate_up_proj", act_fn="activation_fn")),
              ("Phi3Attention", AttentionSpec(qkv="qkv_proj")), ("Phi3DecoderLayer", BLOCK))),
    ("gemma2", (("Gemma2MLP", GEGLU), ("Gemma2Attention", AttentionSpec(logit_softcap="attn_logit_softcapping")))),
    ("gemma3", (("Gemma3MLP", GEGLU),
                ("Gemma3Attention", AttentionSpec(q_norm="q_norm", k_norm="k_norm", norm_weight=NormWeight.ONE_PLUS,
                                                  logit_softcap="attn_logit_softcapping")))),
    ("qwen2_moe", (("Qwen2MoeMLP", SWIGLU), ("Qwen2MoeAttention", ATTENTION),
                   ("Qwen2MoeSparseMoeBlock", MoESpec(shared_expert="shared_expert", shared_gate="shared_expert_gate")),
                   ("Qwen2MoeDecoderLayer", BLOCK))),
    ("deepseek_v3", (("DeepseekV3MLP", SWIGLU), ("DeepseekV3Attention", MLA), ("DeepseekV3MoE", DEEPSEEK_MOE))),
    ("deepseek_v2", (("DeepseekV2MLP", SWIGLU), ("DeepseekV2Attention", MLA), ("DeepseekV2Moe", DEEPSEEK_MOE))),
)


def known_specs() -> Dict[type, Spec]:
    """The installed classes of :data:`FAMILIES`, each with its spec."""
    out = {}
    for family, classes in FAMILIES:
        try:
            mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        for name, spec in classes:
            cls = getattr(mod, name, None)
            if cls is not None:
                out[cls] = spec
    return out
