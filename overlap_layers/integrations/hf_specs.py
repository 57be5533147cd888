"""The specs of ``swap``'s declarative plan: what a Hugging Face style module's weights are called
and which conventions its forward follows, so that a family the library does not know is swapped
from a plan its user writes (in the spirit of ``torch.distributed.tensor.parallel.parallelize_module``'s
plans), and the families it knows are each one row of specs (:mod:`.hf_families`).

Reference: a spec must equal the module it describes -- the forward written in each class's
docstring, with the module's own tensors under the spec's names -- for the swapped layer to equal
that module. The builders (:mod:`.hf_build`) check what they can (names, shapes, biases, the
activation where the module holds it, eps) and leave the module, warned, where a check fails;
they cannot check the forward itself.

Each spec is a frozen dataclass; its variants are enums (:class:`Activation`, :class:`NormWeight`,
:class:`QKVLayout`, :class:`ExpertsLayout`, :class:`Router`). A field naming a sub-module or tensor
takes a dotted path relative to the module (``"ffn.fc1"``). Constructing a spec checks its fields:
ValueError naming the field, the value given and what is valid.

=================  ===========================================================================
spec               the module it describes (x the module's input, names the spec's fields)
=================  ===========================================================================
:class:`MLPSpec`   ``down(act(gate(x)) * up(x))`` (``gate_up``: one projection whose rows are
                   gate's, then up's); ``nn.Linear`` projections, biases on all or none
AttentionSpec      HF's attention call: ``q, k, v`` projections (or one ``qkv``), per-head
                   ``q_norm`` / ``k_norm`` RMSNorms before RoPE (HF's ``(cos, sin)``), causal
                   SDPA scaled by the module's ``scaling``, ``o``; biases on q, k, v (all or
                   none) and on o, independently
:class:`MoESpec`   a router ``router.weight [E, H]`` picking ``top_k`` experts as ``routing``
                   says (a softmax top-k, renormalised where ``normalize_topk``; or DeepSeek-V2 /
                   V3's), experts ``act(x @ gate_up[e].T) @ down[e].T`` weighted by the router's
                   weights, plus ``shared_expert(x)``, scaled by ``sigmoid(shared_gate(x))`` where
                   there is one
:class:`BlockSpec` a pre-norm decoder layer: ``h = x + attn(norm1(x))``, ``h + mlp(norm2(h))``,
                   RMSNorms ``weight * x / sqrt(mean(x^2) + eps)``
=================  ===========================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import ClassVar, Optional, Union

import torch
import torch.nn.functional as F


class Activation(Enum):
    """A gated MLP's activation: ``act(gate) * up``."""

    SILU = "silu"  # SwiGLU (Llama, Qwen, Mistral, Phi-3)
    GELU_TANH = "gelu_tanh"  # GeGLU with gelu's tanh approximation (Gemma's gelu_pytorch_tanh)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x)`` (of the gate rows) as torch computes it."""
        return F.silu(x) if self is Activation.SILU else F.gelu(x, approximate="tanh")


class NormWeight(Enum):
    """How an RMSNorm applies its weight ``w`` to ``x / sqrt(mean(x^2) + eps)``."""

    WEIGHT = "w * x"  # Llama, Qwen3
    ONE_PLUS = "(1 + w) * x"  # Gemma (the weight is stored as an offset from 1)


class QKVLayout(Enum):
    """The rows of a fused qkv projection."""

    CONCATENATED = "q heads, then k heads, then v heads"  # Phi-3


class ExpertsLayout(Enum):
    """The experts' tensors."""

    GATE_UP_DOWN = "gate_up [E, 2F, H] (gate rows, then up rows), down [E, H, F]"  # transformers 5's experts


class Router(Enum):
    """How an MoE's router picks and weights the experts."""

    SOFTMAX_TOPK = "softmax(x @ router.weight.T), top-k"  # Mixtral, Qwen-MoE
    # DeepSeek-V2's greedy / group-limited greedy, DeepSeek-V3's noaux_tc (sigmoid, selection bias
    # e_score_correction_bias), each scaled: read from the router module (hf_deepseek.py)
    DEEPSEEK = "DeepSeek-V2 / V3's, read from the router module"


def _valid(cls, name: str, value, valid: str) -> ValueError:
    return ValueError(f"{cls.__name__}({name}={value!r}): must be {valid}")


def _check_names(spec, optional: tuple = ()) -> None:
    """Every str field of ``spec`` a non-empty dotted path (``optional`` ones may be None)."""
    for f in fields(spec):
        v = getattr(spec, f.name)
        if f.type in ("str", "Optional[str]"):
            if v is None and f.name in optional:
                continue
            if not isinstance(v, str) or not v or any(not p.isidentifier() for p in v.split(".")):
                raise _valid(type(spec), f.name, v, "a sub-module / tensor name (a dotted path of identifiers)"
                             + (" or None" if f.name in optional else ""))


def _check_enum(spec, name: str, enum) -> None:
    v = getattr(spec, name)
    if not isinstance(v, enum):
        raise _valid(type(spec), name, v, f"one of {', '.join(f'{enum.__name__}.{m.name}' for m in enum)}")


def _check_count(spec, name: str) -> None:
    v = getattr(spec, name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise _valid(type(spec), name, v, "a positive int, or None to read it from the module")


@dataclass(frozen=True)
class MLPSpec:
    """A gated MLP ``down(act(gate(x)) * up(x))`` (module docstring). ``gate_up``: one fused
    projection, gate rows then up rows, in place of ``gate`` and ``up`` (leave those at their
    defaults). ``act_fn``: the module's attribute holding its activation, compared with
    ``activation`` when built (None: not compared; the spec vouches for it)."""

    kind: ClassVar[str] = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    gate_up: Optional[str] = None
    activation: Activation = Activation.SILU
    act_fn: Optional[str] = "act_fn"

    def __post_init__(self):
        _check_names(self, ("gate_up", "act_fn"))
        _check_enum(self, "activation", Activation)
        if self.gate_up is not None and (self.gate, self.up) != ("gate_proj", "up_proj"):
            raise _valid(type(self), "gate_up", self.gate_up, f"None when gate={self.gate!r} / up={self.up!r} "
                         f"are given (a fused gate_up replaces both)")


@dataclass(frozen=True)
class AttentionSpec:
    """An attention module called as HF's are (module docstring). ``qkv``: one fused projection
    laid out as ``qkv_layout`` in place of ``q``, ``k``, ``v`` (leave those at their defaults).
    ``q_norm`` / ``k_norm``: per-head RMSNorms (both or neither), applying their weight as
    ``norm_weight``. ``scaling``: the module's attribute holding the softmax scale (None, or
    absent on the module: ``head_dim ** -0.5``). ``logit_softcap``: the module's attribute
    holding an attention-logit soft cap (Gemma 2's ``tanh(s / cap) * cap``); where it is not
    None the module is left dense, warned (the overlap attention runs SDPA). ``num_heads``,
    ``num_kv_heads``, ``head_dim``: None reads ``config.num_attention_heads``,
    ``config.num_key_value_heads`` and ``head_dim`` from the module. ``latent_kv``: the module's
    attribute holding the kv rank of a multi-head latent attention (DeepSeek's MLA,
    ``kv_lora_rank``); where it is not None the module is left dense, warned (OverlapAttention
    has no low-rank projections)."""

    kind: ClassVar[str] = "attention"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: Optional[str] = None
    qkv_layout: QKVLayout = QKVLayout.CONCATENATED
    q_norm: Optional[str] = None
    k_norm: Optional[str] = None
    norm_weight: NormWeight = NormWeight.WEIGHT
    scaling: Optional[str] = "scaling"
    logit_softcap: Optional[str] = None
    latent_kv: Optional[str] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None

    def __post_init__(self):
        _check_names(self, ("qkv", "q_norm", "k_norm", "scaling", "logit_softcap", "latent_kv"))
        _check_enum(self, "qkv_layout", QKVLayout)
        _check_enum(self, "norm_weight", NormWeight)
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            _check_count(self, name)
        if self.qkv is not None and (self.q, self.k, self.v) != ("q_proj", "k_proj", "v_proj"):
            raise _valid(type(self), "qkv", self.qkv, f"None when q={self.q!r} / k={self.k!r} / v={self.v!r} are "
                         f"given (a fused qkv replaces all three)")
        if (self.q_norm is None) != (self.k_norm is None):
            raise _valid(type(self), "q_norm", self.q_norm, f"given together with k_norm (k_norm={self.k_norm!r}): "
                         f"both or neither")


@dataclass(frozen=True)
class MoESpec:
    """A sparse-MoE block (module docstring): ``router`` a module with ``weight [E, H]``; the
    ``experts`` module's tensors ``gate_up`` and ``down`` laid out as ``layout``, its activation
    in ``act_fn`` (None: not compared); ``top_k`` and ``normalize_topk`` None read the router's (or
    the block's) ``top_k`` and the router's ``norm_topk_prob`` (where it has none: True with
    ``Router.SOFTMAX_TOPK``, False with ``Router.DEEPSEEK``). ``routing``: ``Router.DEEPSEEK``
    reads the router kind, expert groups, scaling factor and ``e_score_correction_bias`` (a
    buffer of the router, DeepSeek-V3's) from the router module (:mod:`.hf_deepseek`).
    ``shared_expert``: an MLP described by ``shared_mlp`` (no biases) added to every token's
    output (DeepSeek's ``shared_experts``); ``shared_gate``: an ``nn.Linear(H, 1)`` without bias
    whose sigmoid scales it (Qwen2-MoE)."""

    kind: ClassVar[str] = "moe"
    router: str = "gate"
    experts: str = "experts"
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    layout: ExpertsLayout = ExpertsLayout.GATE_UP_DOWN
    routing: Router = Router.SOFTMAX_TOPK
    activation: Activation = Activation.SILU
    act_fn: Optional[str] = "act_fn"
    top_k: Optional[int] = None
    normalize_topk: Optional[bool] = None
    shared_expert: Optional[str] = None
    shared_mlp: MLPSpec = MLPSpec()
    shared_gate: Optional[str] = None

    def __post_init__(self):
        _check_names(self, ("act_fn", "shared_expert", "shared_gate"))
        _check_enum(self, "layout", ExpertsLayout)
        _check_enum(self, "routing", Router)
        _check_enum(self, "activation", Activation)
        _check_count(self, "top_k")
        if self.normalize_topk not in (None, True, False):
            raise _valid(type(self), "normalize_topk", self.normalize_topk,
                         "True, False, or None to read the router's norm_topk_prob")
        if not isinstance(self.shared_mlp, MLPSpec):
            raise _valid(type(self), "shared_mlp", self.shared_mlp, "an MLPSpec")
        if self.shared_gate is not None and self.shared_expert is None:
            raise _valid(type(self), "shared_gate", self.shared_gate, "None without a shared_expert")


@dataclass(frozen=True)
class BlockSpec:
    """A pre-norm decoder layer (module docstring; ``swap(..., block=True)``): its sub-modules
    ``self_attn``, ``mlp`` and RMSNorms ``attn_norm``, ``mlp_norm`` (weight ``w * x``, one eps).
    ``attention`` / ``mlp_spec`` describe the sub-modules; None takes the spec of the sub-module's
    class from the families' table (:mod:`.hf_families`), so one spec serves layers whose MLP
    is dense in some and an MoE in others."""

    kind: ClassVar[str] = "block"
    self_attn: str = "self_attn"
    mlp: str = "mlp"
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    attention: Optional[AttentionSpec] = None
    mlp_spec: Optional[Union[MLPSpec, MoESpec]] = None

    def __post_init__(self):
        _check_names(self)
        if self.attention is not None and not isinstance(self.attention, AttentionSpec):
            raise _valid(type(self), "attention", self.attention, "an AttentionSpec, or None (by the class)")
        if self.mlp_spec is not None and not isinstance(self.mlp_spec, (MLPSpec, MoESpec)):
            raise _valid(type(self), "mlp_spec", self.mlp_spec, "an MLPSpec or MoESpec, or None (by the class)")


Spec = Union[MLPSpec, AttentionSpec, MoESpec, BlockSpec]
#: spec class -> the plan kind it swaps
SPEC_KINDS = {MLPSpec: MLPSpec.kind, AttentionSpec: AttentionSpec.kind, MoESpec: MoESpec.kind,
              BlockSpec: BlockSpec.kind}
