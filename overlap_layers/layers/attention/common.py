"""What the two attention layers share besides the core: argument checks, dense weight checks,
the parameters' registration (their initialisation is ``layers/common/init.py``'s, as
``nn.Linear(in, out)`` initialises), per-call input checks, the RoPE tables of a call and the call
after its agreement (:func:`call_with_positions`).

Reference: every check raises ``ValueError`` naming the argument and what is valid; :func:`cos_sin`
equals the Hugging Face Llama tables for the global positions (or the given
``position_embeddings``).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from ...config import check_positive_int
from ...planning.checks import X_ERRORS, finite_number, x_error
from .core import rope_cos_sin

INPUT_ERRORS = {
    **X_ERRORS,
    5: "position_ids must be an integer tensor [batch or 1, global seq]",
    6: "position_embeddings must be (cos, sin), each [batch or 1, global seq, head_dim] with an even head_dim",
    7: "attention_mask must be None (the layer is causal with causal=True, full with causal=False) or, "
       "with causal=True, a mask equal to the standard causal one; padding, packed-sequence and sliding-"
       "window masks are not supported",
    8: "position_embeddings must not require grad: the layer passes no gradient into the RoPE tables "
       "(detach them; Hugging Face's rotary embedding builds them without grad)",
}
WHAT = "x / position_ids / position_embeddings / attention_mask"
#: Every attention parameter, in the order the layers read them (None where a layer has none).
PARAMS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm")


def check_args(hidden_size, num_heads, num_kv_heads, head_dim, rope_theta, softmax_scale,
               dropout_p) -> Tuple[int, int]:
    """The constructor arguments both layers share; returns ``(num_kv_heads, head_dim)`` with
    their defaults filled in (num_heads; hidden_size // num_heads)."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    for name, v in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        check_positive_int(v, name)
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}; "
                             f"pass head_dim explicitly")
        head_dim = hidden_size // num_heads
    check_positive_int(head_dim, "head_dim")
    if rope_theta is not None:
        if not finite_number(rope_theta):
            raise ValueError(f"rope_theta={rope_theta!r}; must be a positive finite number or None (no RoPE)")
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even with RoPE (it rotates halves); "
                             f"pass rope_theta=None for no RoPE")
    if softmax_scale is not None and not finite_number(softmax_scale):
        raise ValueError(f"softmax_scale={softmax_scale!r}; must be a positive finite number or None "
                         f"(1/sqrt(head_dim))")
    if isinstance(dropout_p, bool) or not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p={dropout_p!r}; must be in [0, 1)")
    return num_kv_heads, head_dim


def check_dense(wq, wk, wv, wo, *, num_heads, num_kv_heads, bq, bk, bv, bo, q_norm, k_norm) -> Tuple[int, int, int]:
    """Dense ``nn.Linear``-layout weights of ``from_dense``: ``wq [nq*d, H]``, ``wk``/``wv
    [nkv*d, H]``, ``wo [H, nq*d]``; bq/bk/bv all or none (bo checked for shape only);
    q_norm/k_norm ``[d]`` both or neither. Returns ``(H, d, num_kv_heads)``."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    for name, t in (("wq", wq), ("wk", wk), ("wv", wv), ("wo", wo)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor (nn.Linear layout); got {getattr(t, 'shape', t)!r}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or wq.shape[0] % num_heads:
        raise ValueError(f"num_heads={num_heads!r} must be a positive int dividing wq's rows {wq.shape[0]}")
    check_positive_int(num_kv_heads, "num_kv_heads")
    H, d = wq.shape[1], wq.shape[0] // num_heads
    want = {"wk": (num_kv_heads * d, H), "wv": (num_kv_heads * d, H), "wo": (H, num_heads * d)}
    for name, t in (("wk", wk), ("wv", wv), ("wo", wo)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; with wq {tuple(wq.shape)}, num_heads={num_heads} "
                             f"and num_kv_heads={num_kv_heads} it must be {want[name]}")
    if len({b is None for b in (bq, bk, bv)}) > 1:
        raise ValueError("pass all of bq, bk, bv, or none")
    for name, b, n in (("bq", bq, num_heads * d), ("bk", bk, num_kv_heads * d), ("bv", bv, num_kv_heads * d),
                       ("bo", bo, H)):
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (n,)):
            raise ValueError(f"{name} has shape {tuple(getattr(b, 'shape', ()))}; must be ({n},)")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm, or neither")
    if q_norm is not None and (tuple(q_norm.shape) != (d,) or tuple(k_norm.shape) != (d,)):
        raise ValueError(f"q_norm and k_norm must have shape ({d},) (head_dim); got {tuple(q_norm.shape)}, "
                         f"{tuple(k_norm.shape)}")
    return H, d, num_kv_heads


def register_params(module: nn.Module, *, hidden: int, q_heads: int, kv_heads: int, head_dim: int, bias: bool,
                    qk_norm: bool, dtype=None, device=None) -> None:
    """Create (uninitialised) ``wq [q_heads*d, H]``, ``wk``/``wv [kv_heads*d, H]``,
    ``wo [H, q_heads*d]``, biases ``bq``, ``bk``, ``bv``, ``bo`` (or None) and ``q_norm``,
    ``k_norm [d]`` (or None) on ``module``."""
    kw, d = {"dtype": dtype, "device": device}, head_dim
    module.wq = nn.Parameter(torch.empty(q_heads * d, hidden, **kw))
    module.wk = nn.Parameter(torch.empty(kv_heads * d, hidden, **kw))
    module.wv = nn.Parameter(torch.empty(kv_heads * d, hidden, **kw))
    module.wo = nn.Parameter(torch.empty(hidden, q_heads * d, **kw))
    for name, n in (("bq", q_heads * d), ("bk", kv_heads * d), ("bv", kv_heads * d), ("bo", hidden)):
        setattr(module, name, nn.Parameter(torch.empty(n, **kw)) if bias else None)
    module.q_norm = nn.Parameter(torch.empty(d, **kw)) if qk_norm else None
    module.k_norm = nn.Parameter(torch.empty(d, **kw)) if qk_norm else None


def config_fields(layer) -> tuple:
    """The construction arguments both attention layers' ranks must share ([Note: layer config] in
    ``planning/cross_checks.py``)."""
    return (("hidden_size", layer.hidden_size), ("num_heads", layer.num_heads), ("num_kv_heads", layer.num_kv_heads),
            ("head_dim", layer.head_dim), ("causal", layer.causal), ("rope_theta", layer.rope_theta),
            ("qk_norm", layer.qk_norm), ("bias", layer.bias), ("softmax_scale", layer.softmax_scale),
            ("dropout_p", layer.dropout_p), ("o_bias", layer.bo is not None),
            ("qk_norm_offset", getattr(layer, "qk_norm_offset", 0.0)))


def replicated_positions(position_ids, position_embeddings) -> tuple:
    """The position inputs every rank must hold equal, by name (``config.check_inputs``)."""
    cos, sin = position_embeddings if isinstance(position_embeddings, (tuple, list)) and \
        len(position_embeddings) == 2 else (None, None)
    return (("position_ids", position_ids if isinstance(position_ids, torch.Tensor) else None),
            ("position_embeddings[0] (cos)", cos if isinstance(cos, torch.Tensor) else None),
            ("position_embeddings[1] (sin)", sin if isinstance(sin, torch.Tensor) else None))


@torch.no_grad()
def input_error(x, *, hidden_size: int, weight: torch.Tensor, seq_factor: int, head_dim: int, position_ids,
                position_embeddings, attention_mask, causal: bool) -> int:
    """This rank's input-error code (0 if fine; keys of :data:`INPUT_ERRORS`). The global sequence
    is ``x.shape[1] * seq_factor``; a mask is accepted only if it equals the causal one
    (:func:`is_causal_mask`) and the layer is causal."""
    if attention_mask is not None and not (causal and isinstance(attention_mask, torch.Tensor)):
        return 7
    err = x_error(x, hidden_size, weight)
    if err:
        return err
    S = x.shape[1] * seq_factor
    if attention_mask is not None and not is_causal_mask(attention_mask, S):
        return 7
    if position_ids is not None and not (
            isinstance(position_ids, torch.Tensor) and not position_ids.is_floating_point()
            and not position_ids.is_complex() and position_ids.dim() == 2
            and position_ids.shape[0] in (1, x.shape[0]) and position_ids.shape[1] == S):
        return 5
    if position_embeddings is not None:
        ok = isinstance(position_embeddings, (tuple, list)) and len(position_embeddings) == 2 and all(
            isinstance(t, torch.Tensor) and t.dim() == 3 and tuple(t.shape[1:]) == (S, head_dim)
            and t.shape[0] in (1, x.shape[0]) for t in position_embeddings) and head_dim % 2 == 0
        if not ok:
            return 6
        if any(t.requires_grad for t in position_embeddings):
            return 8
    return 0


def _causal_verdict(mask, q_len: int, masked_is_true: bool) -> bool:
    """Whether ``mask`` is the standard causal mask over ``q_len`` positions (or no mask at all):
    None; a ``[batch, q_len]`` mask with no padding (every entry nonzero); a ``[batch, 1 or heads,
    q_len, q_len]`` boolean mask equal to the lower triangle (True = attend), or an additive float
    mask with 0 on the lower triangle and <= finfo.min/2 or -inf above it (HF's mask forms, see
    [Note: HF attention mask] in overlap_layers.integrations.hf_adapters). With
    ``masked_is_true`` (Megatron's form) only a 4-D boolean mask equal to the strict upper
    triangle (True = masked out)."""
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor):
        return False  # e.g. a flex-attention BlockMask
    if masked_is_true:
        return mask.dtype == torch.bool and mask.dim() == 4 and tuple(mask.shape[-2:]) == (q_len, q_len) and bool(
            (mask == torch.ones(q_len, q_len, dtype=torch.bool, device=mask.device).triu_(1)).all())
    if mask.dim() == 2:  # flash attention's [batch, seq] padding mask
        return mask.shape[-1] == q_len and bool((mask != 0).all())
    if mask.dim() != 4 or mask.shape[-1] != q_len or mask.shape[-2] != q_len:
        return False
    tril = torch.ones(q_len, q_len, dtype=torch.bool, device=mask.device).tril_()
    if mask.dtype == torch.bool:
        return bool((mask == tril).all())
    if not mask.is_floating_point():
        return False
    allowed = mask == 0
    blocked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min / 2)
    return bool((allowed == tril).all()) and bool((allowed | blocked).all())


def derived_from_mask(mask: torch.Tensor, what: str, args: tuple, make: Callable):
    """``make(mask, *args)``, kept on ``mask`` itself (an attribute named for ``what``) for the next
    call with the same ``args`` while the mask is unmodified (its ``_version``): HF and Megatron
    hand one mask tensor to every layer of a forward, so what a layer derives from it (an O(S^2)
    comparison and its device-to-host read, a band) is made once per forward, not once per layer.
    The value lives and dies with the mask: no state outside the call's own tensors."""
    name = f"_overlap_{what}"
    key = (mask._version, args)
    kept = mask.__dict__.get(name)
    if kept is not None and kept[0] == key:
        return kept[1]
    value = make(mask, *args)
    setattr(mask, name, (key, value))
    return value


def is_causal_mask(mask, q_len: int, masked_is_true: bool = False) -> bool:
    """:func:`_causal_verdict`, kept on the mask tensor (:func:`derived_from_mask`)."""
    if not isinstance(mask, torch.Tensor):
        return _causal_verdict(mask, q_len, masked_is_true)
    return derived_from_mask(mask, "causal_verdict", (q_len, masked_is_true), _causal_verdict)


def _form(t):
    """A call argument's form as its checks read it: a tensor's shape and dtype, else its type."""
    return (t.shape, t.dtype) if isinstance(t, torch.Tensor) else type(t)


def call_forms(position_ids, position_embeddings, attention_mask) -> tuple:
    """The forms (:func:`_form`) of an attention call's arguments besides ``x`` that decide its
    input checks: a direct call's signature ([Note: direct calls] in ``planning/planner.py``). A
    mask's keys are left out (no check reads them, and a decoding step's mask over a growing cache
    has one more each step)."""
    pe = position_embeddings
    pe = (_form(pe[0]), _form(pe[1])) if isinstance(pe, (tuple, list)) and len(pe) == 2 else type(pe)
    mask = (attention_mask.shape[:-1], attention_mask.dtype) if isinstance(attention_mask, torch.Tensor) \
        else type(attention_mask)
    return _form(position_ids), pe, mask


def compiled_position_args(position_ids=None, position_embeddings=None, attention_mask=None) -> Optional[list]:
    """An attention call's other arguments as ``[position_ids, cos, sin, attention_mask]`` for the
    compiled op ([Note: compiled calls] in .compiled); None (the eager path, which rejects them)
    for malformed ones. A mask tensor goes into the op, where the eager call checks that it is the
    causal one (a data-dependent check that tracing could not make)."""
    pe = position_embeddings
    if (attention_mask is not None and not isinstance(attention_mask, torch.Tensor)) or (pe is not None and not (
            isinstance(pe, (tuple, list)) and len(pe) == 2 and all(isinstance(t, torch.Tensor) for t in pe))):
        return None
    cos, sin = pe if pe is not None else (None, None)
    return [position_ids, cos, sin, attention_mask]


def position_kwargs(extras) -> dict:
    """The keyword arguments of :func:`compiled_position_args`' list."""
    position_ids, cos, sin, attention_mask = extras
    return {"position_ids": position_ids, "attention_mask": attention_mask,
            "position_embeddings": None if cos is None and sin is None else (cos, sin)}


def cos_sin(rope_theta, head_dim: int, S: int, device, dtype, position_ids, position_embeddings):
    """The call's RoPE tables ``(cos, sin)`` ``[batch or 1, S, head_dim]``, or None without RoPE."""
    if position_embeddings is not None:
        cos, sin = position_embeddings
        return (cos, sin) if cos.device == sin.device == device else (cos.to(device), sin.to(device))
    if rope_theta is None:
        return None
    pos = position_ids if position_ids is not None else torch.arange(S, device=device)[None]
    return rope_cos_sin(pos.to(device), head_dim, rope_theta, dtype)


def call_with_positions(layer, x, agreed, position_ids, position_embeddings):
    """An attention layer's call after its agreement ``agreed`` (``LayerPlanner.call``) of its
    ``_run(x, plan, save, position_ids, position_embeddings, trial, trace)``, with the positions
    among the call's inputs (a replayed call copies them too). The layers' own calls and the
    block's unfused call share it."""
    save = agreed.save
    return layer.planner.call(
        x, agreed, lambda plan, trial, trace, x, ids, *pe: layer._run(x, plan, save, ids, pe or None, trial, trace),
        inputs=(x, position_ids, *(position_embeddings or ())))
