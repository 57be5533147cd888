"""Reducing the gradients that the tensor-parallel layers leave as per-rank partials.

Reference: after :func:`reduce_replicated_grads`, every parameter replicated inside a layer's
group holds the gradient the dense layer would give it, on every rank: the sum over the ranks
that hold a copy of the rank partials left by backward (DESIGN.md, conventions).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .attention import OverlapAttention
from .mlp import OverlapMLP


def _sum_kv_copies(layer: OverlapAttention, grad: torch.Tensor) -> None:
    """KV heads replicated over ``ws / nkv`` ranks: sum the copies' gradients in one all-reduce of
    a ``[nkv, ...]`` buffer where each rank fills its head's slot."""
    buf = grad.new_zeros((layer.num_kv_heads, *grad.shape))
    buf[layer._kv_heads().start] = grad
    dist.all_reduce(buf, group=layer.group)
    grad.copy_(buf[layer._kv_heads().start])


def reduce_replicated_grads(module: nn.Module) -> None:
    """Sum, over each layer's group, the gradients that hold rank partials, for every layer in
    ``module``: :class:`OverlapMLP` ``b_out`` under sequence parallelism; :class:`OverlapAttention`
    ``bo`` under sequence parallelism, ``q_norm`` / ``k_norm``, and ``wk``, ``wv``, ``bk``,
    ``bv`` when ``num_kv_heads < world_size`` (over the ranks sharing each KV head).
    A collective: call it on every rank, after backward, before the optimizer step."""
    for m in module.modules():
        if isinstance(m, OverlapMLP):
            if m.sequence_parallel and m.b_out is not None and m.b_out.grad is not None:
                dist.all_reduce(m.b_out.grad, group=m.group)
        elif isinstance(m, OverlapAttention):
            full = [m.q_norm, m.k_norm] + ([m.bo] if m.sequence_parallel else [])
            for p in full:
                if p is not None and p.grad is not None:
                    dist.all_reduce(p.grad, group=m.group)
            if m.num_kv_heads < m.world_size:
                for p in (m.wk, m.wv, m.bk, m.bv):
                    if p is not None and p.grad is not None:
                        _sum_kv_copies(m, p.grad)
