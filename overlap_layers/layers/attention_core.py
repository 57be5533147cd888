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

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

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
    """``x * cos + rotate_half(x) * sin`` (tables cast to ``x``'s dtype), computed per half
    without building the rotated copy: ``[x1*c1 - x2*s1, x2*c2 + x1*s2]`` for ``x = [x1, x2]``
    (four half-width kernels and the concatenation; the rotated form takes four full-width
    kernels and a concatenation, about three times the memory traffic)."""
    h = x_bhSd.shape[-1] // 2
    cos, sin = cos_bSd.to(x_bhSd.dtype)[:, None], sin_bSd.to(x_bhSd.dtype)[:, None]
    x1, x2 = x_bhSd[..., :h], x_bhSd[..., h:]
    return torch.cat([torch.addcmul(x1 * cos[..., :h], x2, sin[..., :h], value=-1),
                      torch.addcmul(x2 * cos[..., h:], x1, sin[..., h:])], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float() if x.element_size() < 4 else x  # half types in float32, as Hugging Face does
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + QK_NORM_EPS)
    return weight * xf.to(x.dtype)


def attention(q_bSnd: torch.Tensor, k_bSnd: torch.Tensor, v_bSnd: torch.Tensor, *,
              cos_sin: Optional[Tuple[torch.Tensor, torch.Tensor]], q_norm: Optional[torch.Tensor],
              k_norm: Optional[torch.Tensor], causal: bool, scale: Optional[float],
              dropout_p: float = 0.0) -> torch.Tensor:
    """``o [b, S, nq, d]`` from projected ``q [b, S, nq, d]``, ``k, v [b, S, nkv, d]`` (see the
    module docstring). Uses ``scaled_dot_product_attention`` (flash / memory-efficient kernels on
    GPU) with ``enable_gqa`` when nq != nkv."""
    if q_norm is not None:
        q_bSnd, k_bSnd = rms_norm(q_bSnd, q_norm), rms_norm(k_bSnd, k_norm)
    q, k, v = (t.transpose(1, 2) for t in (q_bSnd, k_bSnd, v_bSnd))
    if cos_sin is not None:
        cos, sin = (t.to(q.dtype) for t in cos_sin)  # once for q and k (apply_rope's cast is then a no-op)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p,
                                       enable_gqa=gqa)
    return o.transpose(1, 2)
