"""One call of :class:`~overlap_layers.layers.attention.layer.OverlapAttention`: what its passes
read besides tensors (:class:`AttentionCall`: the core of a tile's rows, the RoPE tables, the
query-chunk core of the rank chunks), the head-count rules, and the core's ops as the planner
measures them (:func:`core_op_setups`).

Legend: ``layers/attention/layer.py``'s.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...planning.calls import LayerCall
from ...planning.plan import TilePlan
from . import query_chunks
from .common import cos_sin as cos_sin_of
from .core import Heads, attention, empty_heads, heads_backward, heads_into, sdpa


def check_heads(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """The head-count rules of the tensor-parallel attention layers (ValueError otherwise)."""
    if num_heads % world_size:
        raise ValueError(f"num_heads={num_heads} must be divisible by the group size {world_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads}: must be divisible by the group size {world_size}, "
                         f"or divide it (then KV heads are replicated)")


class AttentionCall(LayerCall):
    """Everything one call of ``layer`` (an ``OverlapAttention``) needs besides tensors (passed
    through the autograd Function)."""

    def __init__(self, layer, plan: TilePlan, save: bool, streams, cos_sin, batch: int,
                 seq_local: int):
        super().__init__(layer.group, plan, save, streams, layer.launch_log)
        self.sp = layer.sequence_parallel
        self.g = layer.world_size if layer.sequence_parallel else 1
        self.nq, self.nkv, self.d = layer.num_heads_local, layer.num_kv_heads_local, layer.head_dim
        self.causal, self.scale = layer.causal, layer.softmax_scale
        self.dropout_p = layer.dropout_p if layer.training else 0.0
        self.q_norm, self.k_norm = layer._local("q_norm"), layer._local("k_norm")
        self.cos_sin, self.batch, self.s = cos_sin, batch, seq_local
        self.query_chunks = False  # rank chunks run the core by query chunks (set by the layer's call)
        self.diagonal_first = False  # ... each chunk's diagonal piece in its QKV piece (set likewise)

    def tables(self, b0: int, b1: int, dtype: torch.dtype):
        """RoPE's cos, sin ``[b or 1, g*s, d]`` of batch rows b0..b1 in ``dtype``, or None."""
        if self.cos_sin is None:
            return None
        return tuple((t if t.shape[0] == 1 else t[b0:b1]).to(dtype) for t in self.cos_sin)

    def heads_shape(self, b0: int, b1: int) -> tuple:
        return self.g, b1 - b0, self.s, self.nq, self.nkv, self.d

    def tile_heads(self, like: torch.Tensor, b0: int, b1: int) -> tuple:
        """``(buffers, tables)`` for :meth:`chunk_heads` and :meth:`core`'s ``pre``: the core's
        empty q, k, v (:func:`empty_heads`, ``like``'s dtype and device) of batch rows b0..b1 and
        their RoPE tables."""
        return empty_heads(like, self.heads_shape(b0, b1)), self.tables(b0, b1, like.dtype)

    def chunk_heads(self, qkv_gbsC: torch.Tensor, q: int, bufs, tables) -> None:
        """Fill the core's q, k, v buffers ``bufs`` (:meth:`tile_heads`) from one rank's rows
        ``qkv[q]`` ``[b, s, C]`` of a tile, as they arrive (rank chunks, no qk-norm)."""
        g, s, d = self.g, self.s, self.d
        tq = None if tables is None else tuple(t[:, q * s:(q + 1) * s] for t in tables)
        heads_into(qkv_gbsC[q:q + 1], *(t.view(t.shape[0], t.shape[1], g, s, d)[:, :, q:q + 1] for t in bufs), tq,
                   self.nq, self.nkv, d)

    def diagonal_chunk(self, bufs, c: int):
        """Causal query chunk c's diagonal piece (:func:`query_chunks.diagonal`) from the buffers
        ``bufs`` (:meth:`tile_heads`) once rank c's rows are in them."""
        return query_chunks.diagonal(*bufs, c, self.s, scale=self.scale)

    def core_chunk(self, bufs, c: int, o_gbsnd: torch.Tensor, lse: torch.Tensor, diag=None) -> None:
        """Rank c's rows of the core (query chunk c, :func:`query_chunks.query_chunk`) from the
        filled buffers ``bufs`` (:meth:`tile_heads`) into rank-major ``o [g, b, s, nq, d]`` and
        ``lse [b, nq, g*s]``; ``diag``: its :meth:`diagonal_chunk` if that ran."""
        s = self.s
        query_chunks.query_chunk(*bufs, c, s, causal=self.causal, scale=self.scale,
                                 o_out=o_gbsnd[c].permute(0, 2, 1, 3), lse_out=lse[:, :, c * s:(c + 1) * s],
                                 diag=diag)

    def rows_to_heads(self, rows: torch.Tensor, out: torch.Tensor, c: Optional[int] = None) -> None:
        """Copy rank-major rows ``[g*b*s, A]`` (or rank c's ``[b*s, A]``) into head-major ``out [b,
        nq, g*s, d]`` (its chunk c): the layout the core's backward reads."""
        b, nq, d = out.shape[0], self.nq, self.d
        dst = out.unflatten(2, (self.g, self.s))
        if c is None:
            dst.copy_(rows.view(self.g, b, self.s, nq, d).permute(1, 3, 0, 2, 4))
        else:
            dst[:, :, c].copy_(rows.view(b, self.s, nq, d).permute(0, 2, 1, 3))

    def core_chunks_backward(self, do, o, bufs, lse, tables) -> torch.Tensor:
        """Rank-major ``dqkv [M, C]`` of the query-chunk core (:meth:`core_chunk` over every chunk)
        given head-major ``do, o [b, nq, g*s, d]`` (:meth:`rows_to_heads`): the flash backward
        from the merged ``o`` and ``lse``, then the heads step's transpose (:func:`heads_backward`)."""
        dq, dk, dv = query_chunks.core_backward(do, *bufs, o, lse, causal=self.causal, scale=self.scale)
        return heads_backward(dq, dk, dv, (self.g, do.shape[0], self.s, self.nq, self.nkv, self.d), tables)

    def core(self, qkv_MC: torch.Tensor, b0: int, b1: int, pre=None) -> torch.Tensor:
        """o ``[M, A]`` (rank-major rows) of one tile's qkv ``[M, C]``: batch rows b0..b1. ``pre``:
        :meth:`tile_heads`' ``(buffers, tables)``, the buffers already filled by
        :meth:`chunk_heads` (only without qk-norm)."""
        if self.q_norm is not None:
            return self.core_by_ops(qkv_MC, b0, b1)
        g, b, s, d = self.g, b1 - b0, self.s, self.d
        # RoPE and the head layout in one pass each way (attention_core.Heads)
        bufs, tables = pre if pre is not None else (None, self.tables(b0, b1, qkv_MC.dtype))
        q, k, v = Heads.apply(qkv_MC, self.heads_shape(b0, b1), tables, bufs)
        o = sdpa(q, k, v, causal=self.causal, scale=self.scale, dropout_p=self.dropout_p).transpose(1, 2)
        # [b, g*s, nq, d] -> rank-major [g*b*s, A] in one copy (the sequence split into (g, s) is a view)
        return o.unflatten(1, (g, s)).transpose(0, 1).reshape(g * b * s, self.nq * d)

    def core_by_ops(self, qkv_MC: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
        """:meth:`core` as the reference's ops under autograd (:func:`~.core.attention`): q, k, v as
        views of the rows (one copy where ``g > 1``), without the heads step (which has no
        qk-norm)."""
        g, b, s, d = self.g, b1 - b0, self.s, self.d
        qkv = qkv_MC.view(b, s, -1) if g == 1 else qkv_MC.view(g, b, s, -1).transpose(0, 1).reshape(b, g * s, -1)
        q, k, v = qkv.split([self.nq * d, self.nkv * d, self.nkv * d], dim=-1)
        o = attention(q.unflatten(-1, (self.nq, d)), k.unflatten(-1, (self.nkv, d)), v.unflatten(-1, (self.nkv, d)),
                      cos_sin=self.tables(b0, b1, qkv_MC.dtype), q_norm=self.q_norm, k_norm=self.k_norm,
                      causal=self.causal, scale=self.scale, dropout_p=self.dropout_p)
        # [b, g*s, nq, d] -> rank-major [g*b*s, A] (a view where g == 1)
        return o.reshape(b * s, self.nq * d) if g == 1 else \
            o.unflatten(1, (g, s)).transpose(0, 1).reshape(g * b * s, self.nq * d)


def core_op_setups(layer, cm, dtype: torch.dtype) -> dict:
    """The attention core of an ``OverlapAttention`` (forward, its heads step alone, one rank's rows
    of the query-chunk core, and backward of a recorded graph) per tile batch size, as the planner
    measures it: key -> setup returning the callable to time."""
    dev, S, C = layer.wq.device, cm.g * cm.s, cm.C

    def setup(name, b):
        cos_sin = cos_sin_of(layer.rope_theta, layer.head_dim, S, dev, dtype, None, None)
        call = AttentionCall(layer, TilePlan(1), name == "core_bwd", None, cos_sin, b, cm.s)
        if call.q_norm is not None:
            call.q_norm, call.k_norm = (p.detach().to(dtype) for p in (call.q_norm, call.k_norm))
        qkv = torch.randn(cm.g * b * cm.s, C, dtype=dtype, device=dev)
        if name == "heads":  # the core's RoPE and head layout alone (rank chunks run it per chunk)
            g, _, s, nq, nkv, d = shape = call.heads_shape(0, b)
            bufs, tables = empty_heads(qkv, shape), call.tables(0, b, dtype)
            return lambda: heads_into(qkv.view(g, b, s, -1), *(t.view(b, -1, g, s, d) for t in bufs), tables,
                                      nq, nkv, d)
        if name == "core":
            return lambda: call.core(qkv, 0, b)
        if name.startswith("chunk"):  # one rank's rows of the query-chunk core
            bufs = tuple(torch.randn_like(t) for t in empty_heads(qkv, call.heads_shape(0, b)))
            o = qkv.new_empty((cm.g, b, cm.s, call.nq, call.d))
            lse = qkv.new_empty((b, call.nq, S), dtype=query_chunks.lse_dtype(dtype))
            return lambda: call.core_chunk(bufs, int(name[5:]), o, lse)
        leaf = qkv.requires_grad_()
        with torch.enable_grad():
            o = call.core(leaf, 0, b)
        do = torch.randn_like(o)
        return lambda: torch.autograd.grad(o, leaf, do, retain_graph=True)

    return {key: (lambda spec=spec: setup(*spec)) for key, spec in cm.core_ops().items()}
