"""The attention core shared by the attention layers: per-head RMSNorm, RoPE, SDPA.

Reference (what :func:`attention` must equal), for one batch of whole sequences, with
``q [b, S, nq, d]``, ``k, v [b, S, nkv, d]`` and query head h reading KV head ``h // (nq/nkv)``::

    q, k = rms_norm(q) * q_norm, rms_norm(k) * k_norm          # only with qk_norm (Qwen3 style)
    q, k = q * cos + rotate_half(q) * sin, (same for k)        # only with RoPE
    o = softmax(q k^T * scale + causal mask) v                  # per head, scale = 1/sqrt(d) by default

``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])`` and ``cos, sin [b or 1, S, d]`` as Hugging
Face Llama builds them: ``inv_freq = theta ** -(arange(0, d, 2) / d)``, ``emb = cat(pos * inv_freq,
pos * inv_freq)``, computed in float32 and cast to the activations' dtype. RMSNorm computes in
float32 for half types (in the input dtype otherwise) with ``eps = 1e-6`` (Qwen3's default) and
casts back.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ...kernels.heads import move_heads, move_heads_reference, rope_into
from ...kernels.triton_gate import LAUNCH_BOUND_ELEMENTS
from ...planning.first_order import first_order

QK_NORM_EPS = 1e-6


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[b, S, head_dim]`` for integer ``position_ids [b, S]``, computed in float32
    (as Hugging Face does) or in float64 for float64 activations."""
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=ct, device=position_ids.device) / head_dim)
    freqs = position_ids.to(ct)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x_bhSd: torch.Tensor, cos_bSd: torch.Tensor, sin_bSd: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (tables cast to ``x``'s dtype) as a new tensor,
    differentiable in ``x`` (:class:`_Rope`) and, where they require it, in the tables
    (:func:`rope_heads` on the tables made ``[b or 1, 1, S, d]``)."""
    return rope_heads(x_bhSd, cos_bSd.to(x_bhSd.dtype)[:, None], sin_bSd.to(x_bhSd.dtype)[:, None])


def rope_heads(x_bhSd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` with the tables already in ``x``'s dtype and broadcast over the heads
    (``[b or 1, 1, S, d]``). A tensor too small for its kernels' device time to matter
    (:data:`~overlap_layers.kernels.triton_gate.LAUNCH_BOUND_ELEMENTS`) takes the formula's
    autograd, which costs the host less than a hand-written backward's Python."""
    if cos.requires_grad or sin.requires_grad or x_bhSd.numel() < LAUNCH_BOUND_ELEMENTS:
        x1, x2 = x_bhSd.chunk(2, dim=-1)
        return x_bhSd * cos + torch.cat((-x2, x1), dim=-1) * sin
    return _Rope.apply(x_bhSd, cos, sin)


class _Rope(torch.autograd.Function):
    """RoPE with a hand-written backward, its transpose
    (:func:`~overlap_layers.kernels.heads.rope_into`). Autograd of the forward's slices would
    instead build a zero-filled full-size gradient per slice and add them (about a dozen
    full-width kernels per tensor); this takes four half-width ones."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_into(torch.empty(x.shape, dtype=x.dtype, device=x.device), x, cos, sin)

    @staticmethod
    @first_order  # [Note: first-order backward]: rope_into's gradient carries no graph
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return rope_into(torch.empty(g.shape, dtype=g.dtype, device=g.device), g, cos, sin, transpose=True), \
            None, None


def _move_heads(rows_gbsC: torch.Tensor, heads, cos_sin, nq: int, nkv: int, d: int, backward: bool) -> None:
    """Rank-major rows ``[g, b, s, C]`` to the heads ``(q, k, v) [b, n, g, s, d]`` with RoPE on q
    and k, or (``backward``) the heads' gradients back to the rows with RoPE's transpose."""
    g, s = rows_gbsC.shape[0], rows_gbsC.shape[2]
    tables = None if cos_sin is None else tuple(t.unflatten(1, (g, s)) for t in cos_sin)
    if not move_heads(rows_gbsC, heads, tables, nq, nkv, d, backward):  # one Triton kernel for q, k and v (CUDA)
        move_heads_reference(rows_gbsC, heads, tables, nq, nkv, d, backward)


def heads_into(qkv_gbsC: torch.Tensor, q, k, v, cos_sin, nq: int, nkv: int, d: int) -> None:
    """The core's input from projected rows: ``q, k`` RoPE'd (``cos_sin``: tables ``[b or 1, g*s, d]``
    of these rows' positions, in the rows' dtype, or None) and ``v``, written into ``q, k, v
    [b, n, g, s, d]`` from rank-major ``qkv [g, b, s, C]`` (C = (nq + 2*nkv)*d; row (i, j, t) is
    position i*s + t of sequence j). One pass over ``qkv``: no whole-tile permute, no
    concatenation. Equals ``attention``'s RoPE of the permuted rows."""
    _move_heads(qkv_gbsC, (q, k, v), cos_sin, nq, nkv, d, backward=False)


def heads_backward_into(dqkv_gbsC: torch.Tensor, dq, dk, dv, cos_sin, nq: int, nkv: int, d: int) -> None:
    """The transpose of :func:`heads_into`: ``dq, dk, dv [b, n, g, s, d]`` to rank-major
    ``dqkv [g, b, s, C]`` (RoPE's transpose on dq, dk)."""
    _move_heads(dqkv_gbsC, (dq, dk, dv), cos_sin, nq, nkv, d, backward=True)


def heads_backward(dq, dk, dv, shape, cos_sin) -> torch.Tensor:
    """Rank-major ``dqkv [g*b*s, C]`` of the heads' gradients ``dq [b, nq, g*s, d]``, ``dk, dv
    [b, nkv, g*s, d]`` (:func:`heads_backward_into`; ``shape`` as :class:`Heads` takes it)."""
    g, b, s, nq, nkv, d = shape
    dqkv = torch.empty((g * b * s, (nq + 2 * nkv) * d), dtype=dq.dtype, device=dq.device)
    heads_backward_into(dqkv.view(g, b, s, -1), *(t.unflatten(2, (g, s)) for t in (dq, dk, dv)), cos_sin, nq, nkv, d)
    return dqkv


class Heads(torch.autograd.Function):
    """``(q, k, v) [b, n, g*s, d]`` (contiguous) of rank-major rows ``qkv_MC [g*b*s, C]``
    (:func:`heads_into`), differentiable in ``qkv_MC`` (:func:`heads_backward_into` into one
    rank-major gradient). ``pre``: buffers :func:`heads_into` has already filled from these rows
    (chunk by chunk, as they arrived), returned as they are. No qk-norm; tables take no gradient."""

    @staticmethod
    def forward(ctx, qkv_MC, shape, cos_sin, pre):
        g, b, s, nq, nkv, d = shape
        ctx.shape, ctx.cos_sin = shape, cos_sin
        if pre is not None:
            return pre
        q, k, v = empty_heads(qkv_MC, shape)
        heads_into(qkv_MC.view(g, b, s, -1), *(t.view(b, -1, g, s, d) for t in (q, k, v)), cos_sin, nq, nkv, d)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return heads_backward(dq, dk, dv, ctx.shape, ctx.cos_sin), None, None, None


def empty_heads(like: torch.Tensor, shape) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous ``q [b, nq, g*s, d]``, ``k, v [b, nkv, g*s, d]`` for :func:`heads_into`."""
    g, b, s, nq, nkv, d = shape
    return tuple(like.new_empty((b, n, g * s, d)) for n in (nq, nkv, nkv))


def sdpa(q, k, v, *, causal: bool, scale: Optional[float], dropout_p: float = 0.0,
         attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``[b, n, S, d]`` heads, with ``enable_gqa`` when nq != nkv,
    under ``attn_mask`` (SDPA's: boolean, True = attend, or additive) where given; ``causal``
    without a mask: SDPA's ``is_causal`` (query i attends to keys 0..i, as Hugging Face's SDPA
    attention passes it, also over a static cache's longer key buffer), none for a single query
    (a decoding step attends to every key it is given). On CUDA the output's gradient reaches
    SDPA's backward in the output's own layout (:class:`_GradLikeOutput`)."""
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                       is_causal=causal and attn_mask is None and q.shape[2] > 1,
                                       scale=scale, dropout_p=dropout_p, enable_gqa=q.shape[1] != k.shape[1])
    return _GradLikeOutput.apply(o) if o.is_cuda and o.requires_grad else o


class _GradLikeOutput(torch.autograd.Function):
    """The identity, whose backward hands the gradient on in its input's strides. cuDNN's SDPA
    backward (torch 2.11) returns wrong gradients when the output's gradient has other strides
    than the output: a [b, S, n, d] storage for a [b, n, S, d] output, as the transpose to rows
    gives it (the CUDA tier checks it in bf16)."""

    @staticmethod
    def forward(ctx, o):
        ctx.strides = o.stride()
        return o.view_as(o)

    @staticmethod
    def backward(ctx, g):
        if g.stride() == ctx.strides:
            return g
        return torch.empty_strided(g.shape, ctx.strides, dtype=g.dtype, device=g.device).copy_(g)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float() if x.element_size() < 4 else x  # half types in float32, as Hugging Face does
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + QK_NORM_EPS)
    return weight * xf.to(x.dtype)


def attention(q_bSnd: torch.Tensor, k_bSnd: torch.Tensor, v_bSnd: torch.Tensor, *,
              cos_sin: Optional[Tuple[torch.Tensor, torch.Tensor]], q_norm: Optional[torch.Tensor],
              k_norm: Optional[torch.Tensor], causal: bool, scale: Optional[float],
              dropout_p: float = 0.0, attn_mask: Optional[torch.Tensor] = None,
              kv_update: Optional[Callable] = None) -> torch.Tensor:
    """``o [b, S, nq, d]`` from projected ``q [b, S, nq, d]``, ``k, v [b, S, nkv, d]`` (see the
    module docstring). Uses ``scaled_dot_product_attention`` (flash / memory-efficient kernels on
    GPU) with ``enable_gqa`` when nq != nkv. ``kv_update(k, v)``: a KV cache's, with the new
    keys (after qk-norm and RoPE) and values ``[b, nkv, S, d]``, returning every cached key and
    value to attend to; ``attn_mask``: SDPA's mask over those (:func:`sdpa`)."""
    if q_norm is not None:
        q_bSnd, k_bSnd = rms_norm(q_bSnd, q_norm), rms_norm(k_bSnd, k_norm)
    q, k, v = q_bSnd.transpose(1, 2), k_bSnd.transpose(1, 2), v_bSnd.transpose(1, 2)
    if cos_sin is not None:
        cos, sin = cos_sin
        if cos.dtype != q.dtype:  # once for q and k
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = rope_heads(q, cos, sin), rope_heads(k, cos, sin)
    if kv_update is not None:
        k, v = kv_update(k, v)
    return sdpa(q, k, v, causal=causal, scale=scale, dropout_p=dropout_p, attn_mask=attn_mask).transpose(1, 2)
