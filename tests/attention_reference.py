"""Independent dense attention for the attention layers' tests (one process, plain formulas), and
the bad inputs both layers must refuse.

Written from the Hugging Face Llama / Qwen3 definitions, not from the library: explicit softmax
(no SDPA), KV heads expanded by index, RoPE by the rotate-half formula, RMSNorm in the input dtype.
Dense nn.Linear layouts: wq [nq*d, H], wk/wv [nkv*d, H], wo [H, nq*d].
"""
import math

import torch


def rope_tables(position_ids, head_dim, theta):
    """cos, sin [b, S, d] for integer positions [b, S] (float64)."""
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=position_ids.device)
    inv = 1.0 / (theta ** (2 * i / head_dim))
    ang = position_ids.to(torch.float64)[..., None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def _rot(x):
    d = x.shape[-1] // 2
    return torch.cat([-x[..., d:], x[..., :d]], -1)


def dense_attention(x, wq, wk, wv, wo, *, num_heads, num_kv_heads, bq=None, bk=None, bv=None, bo=None,
                    q_norm=None, k_norm=None, rope_theta=10000.0, position_ids=None, position_embeddings=None,
                    causal=True, softmax_scale=None, eps=1e-6):
    """y [b, S, H] for the full sequence x [b, S, H] (any float dtype; computes in x's dtype)."""
    b, S, H = x.shape
    d = wq.shape[0] // num_heads
    lin = lambda t, w, bias: t @ w.T + (0 if bias is None else bias)  # noqa: E731
    q = lin(x, wq, bq).view(b, S, num_heads, d)
    k = lin(x, wk, bk).view(b, S, num_kv_heads, d)
    v = lin(x, wv, bv).view(b, S, num_kv_heads, d)
    if q_norm is not None:
        rms = lambda t: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)  # noqa: E731
        q, k = rms(q) * q_norm, rms(k) * k_norm
    if position_embeddings is not None:
        cos, sin = position_embeddings
    elif rope_theta is not None:
        pos = position_ids if position_ids is not None else torch.arange(S, device=x.device)[None].expand(b, S)
        cos, sin = rope_tables(pos, d, rope_theta)
    else:
        cos = sin = None
    if cos is not None:
        cos, sin = cos.to(x.dtype)[:, :, None], sin.to(x.dtype)[:, :, None]
        q, k = q * cos + _rot(q) * sin, k * cos + _rot(k) * sin
    group = num_heads // num_kv_heads
    kv_of = torch.arange(num_heads, device=x.device) // group
    k, v = k[:, :, kv_of], v[:, :, kv_of]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(b, S, num_heads * d)
    return lin(o, wo, bo)


def bad_call_input(rank, ws, name):
    """``(x, kwargs)`` for a call of an attention layer built with hidden 8, 2 heads (head_dim 4)
    whose input is wrong in the way ``name`` says, on one or every rank (local seq 4)."""
    x, kw = torch.randn(2, 4, 8), {}
    if name == "seq":
        x = torch.randn(2, 4 + rank, 8)
    elif name == "batch":
        x = torch.randn(1 + rank, 4, 8)
    elif name == "rank0_2d":
        x = torch.randn(8, 8) if rank == 0 else x
    elif name == "rank0_none":
        x = None if rank == 0 else x
    elif name == "hidden":
        x = torch.randn(2, 4, 6)
    elif name == "hidden_rank1":
        x = torch.randn(2, 4, 6) if rank == 1 else x
    elif name == "int":
        x = torch.ones(2, 4, 8, dtype=torch.int64)
    elif name == "dtype":
        x = x.double()
    elif name == "dtype_rank1":
        x = x.double() if rank == 1 else x
    elif name == "device":
        x = torch.randn(2, 4, 8, device="meta")
    elif name == "attention_mask":
        kw["attention_mask"] = torch.ones(2, 1, 4 * ws, 4 * ws, dtype=torch.bool)
    elif name == "attention_mask_rank1":  # a padding mask on rank 1 only (an all-ones one is accepted)
        pad = torch.ones(2, 4 * ws)
        pad[0, 0] = 0
        kw["attention_mask"] = pad if rank == 1 else None
    elif name == "position_ids":
        kw["position_ids"] = torch.arange(4)[None].expand(2, 4)  # local length, not the global sequence
    elif name == "position_ids_float":
        kw["position_ids"] = torch.arange(4.0 * ws)[None]
    elif name == "position_embeddings":
        kw["position_embeddings"] = (torch.randn(2, 4 * ws, 3), torch.randn(2, 4 * ws, 3))  # head_dim is 4
    elif name == "position_embeddings_grad_rank1":  # learned tables: the layer would drop their gradient
        kw["position_embeddings"] = tuple(torch.randn(2, 4 * ws, 4, requires_grad=rank == 1) for _ in range(2))
    return x, kw
