"""Swap the overlap layers into Hugging Face transformers (>= 5) models, in place.

Reference (what a swapped model must equal, up to rounding): the unswapped model, on every rank,
fed the same batch on every rank of the group -- logits, loss, and, when backward returns, every
parameter's gradient (the swapped layers' shards equal the matching slices of the dense
gradients, see their ``to_dense``; with DTensor parameters, the default, every parameter's and
gradient's ``full_tensor()`` is the dense one).

=========================================  ==============================================================
HF module (transformers 5)                 replaced by
=========================================  ==============================================================
LlamaMLP, MistralMLP, Qwen3MLP,            :class:`OverlapMLP` (swiglu, ``sequence_parallel=False``):
Qwen3MoeMLP (dense layers of Qwen3-MoE)    ``w_in`` = gate rows then up rows, ``w_out`` = down; biases
                                           when ``mlp_bias``
LlamaAttention, MistralAttention,          :class:`HFAttention` around :class:`OverlapAttention`
MixtralAttention, Qwen3Attention,          (``sequence_parallel=False``; GQA; Qwen3's q_norm / k_norm;
Qwen3MoeAttention                          HF's (cos, sin) so RoPE scaling is exact; biases when
                                           ``attention_bias``)
MixtralSparseMoeBlock,                     :class:`HFMoE` around :class:`OverlapMoE` (expert parallel;
Qwen3MoeSparseMoeBlock                     Mixtral: top-k renormalised; Qwen3-MoE: ``norm_topk_prob``)
with ``block=True``: LlamaDecoderLayer,    :class:`HFBlock` around :class:`OverlapTransformerBlock`
MistralDecoderLayer, Qwen3DecoderLayer,    (``sequence_parallel=False``): the layer's attention and MLP /
MixtralDecoderLayer, Qwen3MoeDecoderLayer  MoE as above, its two RMSNorms inside the block
=========================================  ==============================================================

Everything else (embeddings, norms outside decoder blocks, the LM head, rotary tables) stays as it
is and runs replicated; with DTensor parameters (``dtensor=True``, the default) its parameters are
``Replicate()`` DTensors it computes on through their local tensors ([Note: DTensor models] in
``integrations/dtensor.py``).
"""
from __future__ import annotations

import fnmatch
import importlib
import logging
import warnings
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import OverlapConfig
from ..layers import OverlapAttention, OverlapMLP, OverlapMoE, OverlapTransformerBlock
from ..layers.attention.core import QK_NORM_EPS
from ..runtime import resolve_group
from .dtensor import distribute_params, tp_mesh
from .hf_adapters import HFAttention, HFBlock, HFMoE

logger = logging.getLogger(__name__)

KINDS = ("mlp", "attention", "moe")
BLOCK_KINDS = ("block",)  # swap(..., block=True): whole decoder layers first
_OPTIONS = ("num_tiles", "config")

# The HF classes recognised by type: kind -> [(module path, class name)]. A family missing from
# the installed transformers is skipped.
_KNOWN = {
    "mlp": [("llama", "LlamaMLP"), ("mistral", "MistralMLP"), ("qwen3", "Qwen3MLP"), ("qwen3_moe", "Qwen3MoeMLP")],
    "attention": [("llama", "LlamaAttention"), ("mistral", "MistralAttention"), ("mixtral", "MixtralAttention"),
                  ("qwen3", "Qwen3Attention"), ("qwen3_moe", "Qwen3MoeAttention")],
    "moe": [("mixtral", "MixtralSparseMoeBlock"), ("qwen3_moe", "Qwen3MoeSparseMoeBlock")],
    # block=True: decoder layers of the pre-norm form input_layernorm -> self_attn -> residual,
    # post_attention_layernorm -> mlp -> residual
    "block": [("llama", "LlamaDecoderLayer"), ("mistral", "MistralDecoderLayer"), ("qwen3", "Qwen3DecoderLayer"),
              ("mixtral", "MixtralDecoderLayer"), ("qwen3_moe", "Qwen3MoeDecoderLayer")],
}
# Class names that look like a swappable module (an unknown one of these is warned about).
_LOOKALIKE_SUFFIXES = {"mlp": ("MLP", "FeedForward", "FFN"), "attention": ("Attention",),
                       "moe": ("MoeBlock", "MoEBlock", "MoE", "Moe", "Experts"), "block": ("DecoderLayer",)}


def _known_classes() -> Dict[str, tuple]:
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


def _kind_by_type(module: nn.Module, known: Dict[str, tuple], kinds: Sequence[str]) -> Optional[str]:
    for kind in kinds:
        if known.get(kind) and type(module) in known[kind]:
            return kind
    return None


def _lookalike_kind(module: nn.Module, kinds: Sequence[str]) -> Optional[str]:
    name = type(module).__name__
    for kind in kinds:
        if name.endswith(_LOOKALIKE_SUFFIXES[kind]):
            return kind
    return None


def parse_plan(plan, block: bool = False) -> Optional[List[tuple]]:
    """``[(pattern, kind or None, options)]`` in the plan's order, or None without a plan; the kind
    ``"block"`` (a decoder layer) is valid with ``block=True`` only."""
    if plan is None:
        return None
    kinds = KINDS + BLOCK_KINDS if block else KINDS
    if not isinstance(plan, dict):
        raise ValueError(f"plan={plan!r}; must be a dict from module-name patterns (fnmatch) to a kind "
                         f"({', '.join(kinds)}), a dict {{'kind': ..., 'num_tiles': ..., 'config': ...}}, or None")
    rules = []
    for pattern, spec in plan.items():
        if not isinstance(pattern, str):
            raise ValueError(f"plan key {pattern!r}: must be a module-name pattern (str), e.g. 'model.layers.*.mlp'")
        opts = {}
        if isinstance(spec, dict):
            opts = dict(spec)
            if "kind" not in opts:
                raise ValueError(f"plan[{pattern!r}] = {spec!r}: a dict spec needs 'kind' (one of {kinds})")
            kind = opts.pop("kind")
            bad = sorted(set(opts) - set(_OPTIONS))
            if bad:
                raise ValueError(f"plan[{pattern!r}]: unknown option(s) {bad}; valid: kind, {', '.join(_OPTIONS)}")
            if "config" in opts and opts["config"] is not None and not isinstance(opts["config"], OverlapConfig):
                raise ValueError(f"plan[{pattern!r}]['config'] = {opts['config']!r}: must be an OverlapConfig")
        else:
            kind = spec
        if kind is not None and kind not in kinds:
            raise ValueError(f"plan[{pattern!r}]: kind {kind!r}; valid: {', '.join(kinds)}, or None to leave the "
                             f"matching modules as they are")
        rules.append((pattern, kind, opts))
    return rules


# ---------------------------------------------------------------------------- builders
def on(place) -> dict:
    """The layers' keyword for where they run: ``mesh=`` a 1-D DeviceMesh (DTensor parameters),
    or ``group=`` a ProcessGroup (plain parameters)."""
    return {"mesh": place} if isinstance(place, DeviceMesh) else {"group": place}


def group_of(place):
    """The ProcessGroup of ``place`` (a 1-D DeviceMesh or a ProcessGroup)."""
    return place.get_group() if isinstance(place, DeviceMesh) else place


class Unswappable(Exception):
    """A recognised module that cannot be replaced (the message says why); it is left, warned."""


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
    gate, up, down = (_linear(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
    if not _is_silu(getattr(module, "act_fn", None)):
        raise Unswappable(f"activation {getattr(module, 'act_fn', None)!r} is not SiLU (OverlapMLP's swiglu)")
    biases = [gate.bias, up.bias, down.bias]
    if len({b is None for b in biases}) > 1:
        raise Unswappable("some but not all of gate/up/down_proj have a bias")
    _check_plain([gate.weight, up.weight, down.weight, *biases])
    has_bias = gate.bias is not None
    with torch.no_grad():
        w_in = torch.cat([gate.weight, up.weight])
        b_in = torch.cat([gate.bias, up.bias]) if has_bias else None
    return OverlapMLP.from_dense(w_in, down.weight.detach(), b_in=b_in, b_out=down.bias.detach() if has_bias else None,
                                 **on(group), sequence_parallel=False, activation="swiglu", **opts)


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


def _build_attention(module, group, opts) -> nn.Module:
    q, k, v, o = (_linear(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    cfg = getattr(module, "config", None)
    d = getattr(module, "head_dim", None)
    nq = getattr(cfg, "num_attention_heads", None)
    nkv = getattr(cfg, "num_key_value_heads", None) or nq
    if not (isinstance(d, int) and isinstance(nq, int) and q.out_features == nq * d and k.out_features == nkv * d):
        raise Unswappable(f"cannot read the head layout (head_dim={d}, num_attention_heads={nq}, "
                           f"num_key_value_heads={nkv}, q_proj {tuple(q.weight.shape)})")
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
    layer = OverlapAttention.from_dense(
        q.weight.detach(), k.weight.detach(), v.weight.detach(), o.weight.detach(), num_heads=nq, num_kv_heads=nkv,
        bq=det(q.bias), bk=det(k.bias), bv=det(v.bias), bo=det(o.bias), q_norm=_norm_weight(q_norm, d),
        k_norm=_norm_weight(k_norm, d), **on(group), sequence_parallel=False, rope_theta=None, causal=True,
        softmax_scale=getattr(module, "scaling", None), dropout_p=float(getattr(module, "attention_dropout", 0.0)),
        **opts)
    return HFAttention(layer, layer_idx=getattr(module, "layer_idx", None),
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
    # Mixtral always renormalises the top-k probabilities; Qwen3-MoE does when norm_topk_prob.
    normalize = bool(getattr(gate, "norm_topk_prob", True))
    _check_plain([rw, gu, dn])
    layer = OverlapMoE.from_dense(rw.detach(), gu.detach(), dn.detach(), top_k=top_k, **on(group),
                                  activation="swiglu", normalize_topk=normalize, **opts)
    return HFMoE(layer, gate, source=type(module).__name__)


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
    mlp_kind = _kind_by_type(mlp, known, ("mlp", "moe")) if mlp is not None else None
    if _kind_by_type(attn, known, ("attention",)) is None or mlp_kind is None or n1 is None or n2 is None:
        raise Unswappable("expected self_attn (a known attention class), mlp (a known MLP / MoE class), "
                           "input_layernorm and post_attention_layernorm")
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
    return HFBlock(block, gate, layer_idx=hf_attn.layer_idx, sliding_window=hf_attn.sliding_window,
                   source=type(module).__name__)


_BUILDERS = {"mlp": _build_mlp, "attention": _build_attention, "moe": _build_moe}
_TARGETS = {"mlp": "OverlapMLP", "attention": "OverlapAttention", "moe": "OverlapMoE",
            "block": "OverlapTransformerBlock"}
_OURS = (OverlapMLP, OverlapAttention, OverlapMoE, OverlapTransformerBlock, HFAttention, HFMoE, HFBlock)


def _names(names: List[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def _set_parent(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


# ---------------------------------------------------------------------------- swap
def check_swap_args(model, block: bool, config, what: str) -> None:
    """The arguments every ``swap`` shares (ValueError otherwise)."""
    if not isinstance(block, bool):
        raise ValueError(f"block={block!r}; must be True or False")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__}: must be a torch.nn.Module ({what})")
    if config is not None and not isinstance(config, OverlapConfig):
        raise ValueError(f"config={config!r}: must be an OverlapConfig or None")


def replace_modules(model: nn.Module, group, rules, config, *, kind_of: Callable, lookalike: Callable,
                    build: Callable, ours: tuple, nothing: Optional[str], before_build: Optional[Callable] = None,
                    kinds: Sequence[str] = KINDS, log: logging.Logger = logger, stacklevel: int = 4):
    """Replace, in place, the modules of ``model`` that ``kind_of`` recognises (or ``rules``
    select) by ``build(module, kind, opts)``; all built before any is put in, so an error leaves
    the model as it was. Modules left in place are logged and warned about (never a silent
    half-swap; one log line per kind of ``kinds``, and per other kind met); ``before_build(todo)``
    may raise first; ``nothing`` (None: no warning) says what was looked for when nothing was
    replaced. Returns ``(replaced, already)``:
    kind -> [(name, class)], and how many modules were already ours. Logs go to ``log``."""
    todo = []  # (name, module, kind, opts)
    left = defaultdict(list)  # kind -> [(name, class name, reason)]
    warned = defaultdict(list)  # (kind, class, reason) -> [names]
    handled = set()  # modules decided on: their descendants are not looked at
    already = 0
    pattern_hits = defaultdict(int)

    def inside(name):
        parts = name.split(".")
        return any(".".join(parts[:i]) in handled for i in range(1, len(parts)))

    for name, module in model.named_modules():
        if not name or inside(name):
            continue
        if isinstance(module, ours):
            already += 1
            handled.add(name)
            continue
        kind, cls = kind_of(module), type(module).__name__
        if rules is not None:
            rule = next((r for r in rules if fnmatch.fnmatchcase(name, r[0])), None)
            if rule is None:
                if kind is not None:
                    left[kind].append((name, cls, "not in the plan"))
                    handled.add(name)
                continue
            pattern, want, opts = rule
            pattern_hits[pattern] += 1
            if want is None:
                if kind is not None:
                    left[kind].append((name, cls, f"excluded by plan[{pattern!r}]"))
                handled.add(name)
                continue
            if kind is None:
                reason = f"plan[{pattern!r}] asks for {want!r} but {cls} is not a recognised {want} class"
                left[want].append((name, cls, "unknown class"))
                warned[(want, cls, reason)].append(name)
                handled.add(name)
                continue
            if kind != want:
                raise ValueError(f"plan[{pattern!r}] = {want!r} matches {name} ({cls}), which is a known {kind} "
                                 f"module; map it to {kind!r}, or narrow the pattern")
            opts = dict(opts)
        else:
            if kind is None:
                look = lookalike(module)
                if look is not None:
                    reason = f"{cls} looks like a {look} module but is not a recognised class"
                    left[look].append((name, cls, "unknown class"))
                    warned[(look, cls, reason)].append(name)
                    handled.add(name)
                continue
            opts = {}
        if config is not None and "config" not in opts:
            opts["config"] = config
        todo.append((name, module, kind, opts))
        handled.add(name)

    if before_build is not None:
        before_build(todo)
    built = []  # every replacement is built before the first is put in: an error leaves the model as it was
    for name, module, kind, opts in todo:
        cls = type(module).__name__
        try:
            new = build(module, kind, opts)
        except (Unswappable, ValueError) as e:  # ValueError: the layer's own checks (e.g. heads % group size)
            left[kind].append((name, cls, str(e)))
            warned[(kind, cls, str(e))].append(name)
            continue
        new.train(module.training)
        if not any(p.requires_grad for p in module.parameters()):
            new.requires_grad_(False)
        built.append((name, module, kind, new))
    replaced = defaultdict(list)  # kind -> [(name, class)]
    for name, module, kind, new in built:
        _set_parent(model, name, new)
        replaced[kind].append((name, type(module).__name__))
    del built, todo

    if rules is not None:
        for pattern, _, _ in rules:
            if not pattern_hits[pattern]:
                warnings.warn(f"overlap_layers.swap: plan pattern {pattern!r} matched no module", UserWarning,
                              stacklevel=stacklevel)
    for (kind, cls, reason), names in warned.items():
        warnings.warn(f"overlap_layers.swap: left {len(names)} {kind} module(s) of class {cls} unswapped ({reason}): "
                      f"{_names(names)}", UserWarning, stacklevel=stacklevel)
    ws = dist.get_world_size(group)
    for kind in dict.fromkeys(list(kinds) + list(KINDS)):
        rep, lft = replaced[kind], left[kind]
        if kind not in kinds and not rep and not lft:
            continue
        by_cls = defaultdict(int)
        for _, c in rep:
            by_cls[c] += 1
        line = f"overlap_layers.swap: {kind}: replaced {len(rep)}"
        if rep:
            line += f" ({', '.join(f'{c} x{n}' for c, n in by_cls.items())} -> {_TARGETS[kind]} over {ws} ranks)"
        line += f", left {len(lft)}"
        if lft:
            reasons = defaultdict(list)
            for n, c, r in lft:
                reasons[f"{c}: {r}"].append(n)
            line += " (" + "; ".join(f"{r}: {_names(ns, 2)}" for r, ns in reasons.items()) + ")"
        log.info(line)
    if already:
        log.info(f"overlap_layers.swap: {already} module(s) were already overlap layers (left as they are)")
    if nothing is not None and not any(replaced.values()) and not already:
        warnings.warn(f"overlap_layers.swap: nothing was replaced ({nothing}"
                      + (" matched the plan" if rules is not None else "") + ")", UserWarning, stacklevel=stacklevel)
    return replaced, already


def swap(model: nn.Module, group=None, *, mesh=None, axis=None, plan: Optional[dict] = None,
         config: Optional[OverlapConfig] = None, block: bool = False, dtensor: bool = True) -> nn.Module:
    """Replace, in place, the MLP / attention / MoE modules of a Hugging Face transformers (>= 5)
    model with the overlap layers over ``group`` (the tensor- and expert-parallel group; or
    ``mesh`` + ``axis``), carrying the weights; returns ``model``.

    Reference: the swapped model equals the unswapped one on every rank (logits, loss, and every
    gradient when backward returns), given **the same batch on every rank of the group**: the
    hidden states are replicated. Attention and MLP run tensor parallel on the full sequence
    (``sequence_parallel=False``: replicated input, all-reduced output). An MoE block splits the
    tokens over the group, runs each rank's 1/ws share through ``OverlapMoE`` (expert parallel)
    and all-gathers the outputs, so no token is computed twice. See the module table for what is
    recognised (by type, without a ``plan``) and :mod:`.hf_adapters` for the adapters' contracts
    (HF call signatures and return values; causal masks only, no KV cache -- ``swap`` sets
    ``config.use_cache=False``).

    Parameters (``dtensor=True``, the default): every parameter of the swapped model is a DTensor
    on the tensor-parallel mesh axis (``mesh``'s ``axis``, or a 1-D mesh over ``group``'s ranks),
    whose ``full_tensor()`` is the dense model's parameter: the swapped layers' in their documented
    placements ([Note: DTensor parameters] in ``planning/dtensor.py``), every other one (embeddings,
    norms, LM head) ``Replicate()`` (:func:`overlap_layers.distribute_params`, [Note: DTensor
    models] in ``integrations/dtensor.py``). So the ordinary loop -- ``loss.backward()``,
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, ``optimizer.step()`` (any torch
    optimizer, foreach or fused) -- gives the dense model's result with no other call; FSDP2 over
    another axis of ``mesh`` composes, and DCP checkpoints reshard to other tensor-parallel sizes.
    ``dtensor=False`` keeps plain parameters (shards and replicas), for loops that handle tensor
    parallelism themselves (Megatron's); ``clip_grad_norm_`` then sees only each rank's shards.

    Gradients: complete when backward returns, on every rank (no ``finalize_grads`` call; it is a
    no-op here). The attention layers' per-rank partials (``q_norm`` / ``k_norm``, and the KV heads
    when ``num_key_value_heads`` < group size) and the MoE adapters' router gradient (the group's
    ranks hold the same tokens here, so that partial is a tensor-parallel one, which no
    data-parallel wrapper would sum) are summed over the group inside backward ([Note: gradients
    complete in backward] in ``layers/common/grads.py``); the norms, embeddings and LM head run
    replicated on full gradients; experts and the MLP / attention shards get complete shard
    gradients. Data parallelism goes across groups (a DP wrapper over the ranks that hold the
    same shard), as with any TP layer.

    ``plan``: a dict from module-name patterns (``fnmatch`` on the qualified name, e.g.
    ``"model.layers.*.mlp"``) to a kind (``"mlp"``, ``"attention"``, ``"moe"``; ``"block"`` with
    ``block=True``), to
    ``{"kind": ..., "num_tiles": ..., "config": OverlapConfig(...)}``, or to None (leave those
    modules). The first matching pattern wins; only matched modules are replaced. A matched module
    must be of a recognised class of that kind (a known class of another kind raises ValueError; an
    unknown class is left, with a warning). ``config`` applies to every swapped layer unless a
    plan entry gives its own.

    Logging (``logging.getLogger("overlap_layers.integrations.hf")``, INFO): one line per kind
    with what was replaced and left. Warnings (``UserWarning``): recognised modules that cannot be
    replaced (unsupported activation, partial biases, qk-norm eps, router jitter, a group size that
    does not divide the heads/experts, ...) and modules whose class looks like an MLP / attention /
    MoE but is unknown -- never a silent half-swap.

    ``block=True``: each recognised decoder layer becomes one ``OverlapTransformerBlock`` (in an
    :class:`HFBlock`, holding its norms, attention and MLP / MoE; ``plan`` may map patterns to the
    kind ``"block"``); modules of decoder layers that cannot be swapped whole are then swapped one
    by one as without it. The block's MoE router gradient is summed inside backward, as
    ``HFMoE``'s is. Its sublayers still run one after the other (one tiled program across them is
    future work).
    Decisions depend only on the model's structure, so every rank of the group swaps alike.
    """
    check_swap_args(model, block, config, "a transformers model")
    group = resolve_group(group, mesh, axis)
    if not isinstance(dtensor, bool):
        raise ValueError(f"dtensor={dtensor!r}; must be True (DTensor parameters) or False (plain)")
    place = tp_mesh(None if mesh is not None else group, mesh, axis, model) if dtensor else group
    rules = parse_plan(plan, block)
    known = _known_classes()
    if not any(known.values()):
        raise ValueError("no known transformers model classes could be imported; install transformers>=5 "
                         "(pip install 'overlap_layers[hf]')")

    replaced = {}
    if block:  # decoder layers first; the second pass swaps what the blocks left, module by module
        done, _ = replace_modules(
            model, group, None if rules is None else [r for r in rules if r[1] in BLOCK_KINDS + (None,)], config,
            kind_of=lambda m: _kind_by_type(m, known, BLOCK_KINDS),
            lookalike=lambda m: _lookalike_kind(m, BLOCK_KINDS),
            build=lambda module, kind, opts: _build_block(module, place, opts, known), ours=_OURS, nothing=None,
            kinds=BLOCK_KINDS)
        replaced.update(done)
    done, already = replace_modules(
        model, group, None if rules is None else [r for r in rules if r[1] not in BLOCK_KINDS], config,
        kind_of=lambda m: _kind_by_type(m, known, KINDS),
        lookalike=lambda m: _lookalike_kind(m, KINDS),
        build=lambda module, kind, opts: _BUILDERS[kind](module, place, opts), ours=_OURS,
        nothing="no recognised decoder layer / MLP / attention / MoE module" if block else
        "no recognised MLP / attention / MoE module")
    replaced.update({k: v for k, v in done.items() if v})
    if replaced.get("attention") or replaced.get("block"):
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if getattr(cfg, "use_cache", False):
                cfg.use_cache = False
        logger.info("overlap_layers.swap: set config.use_cache=False (the swapped attention keeps no KV cache)")
    if dtensor and (any(replaced.values()) or already):
        distribute_params(model, mesh=place)
        logger.info(f"overlap_layers.swap: every parameter is a DTensor on {place}")
    return model
