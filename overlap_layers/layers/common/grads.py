"""Gradients that are complete when backward returns: the tensor-parallel partials of a layer's
replicated parameters are summed over the group inside backward.

Reference: after ``loss.backward()``, every parameter of a layer holds the gradient the dense
layer gives it (its shard of it, for a sharded parameter), on every rank, with no call after
backward; :func:`overlap_layers.finalize_grads` has nothing left to do for them.

[Note: gradients complete in backward]
A parameter replicated over a tensor-parallel group whose rank computes with only part of the
work (``b_out`` / ``bo`` under sequence parallelism: the rank's own rows; ``q_norm`` /
``k_norm``: the rank's own heads; a block's norms under sequence parallelism; the router and
shared expert of an MoE inside a block or an HF adapter, which route the rank's share of the
tokens) gets a *partial* gradient from the layer's backward. The layer reads such a parameter
through an identity whose backward all-reduces (sums) the gradient over the group
(:func:`sum_grad_over_group`), so the gradient autograd accumulates into ``.grad`` is already the
sum. KV heads replicated over ``ws / num_kv_heads`` ranks (``num_kv_heads < ws``) are summed over
the ranks holding the same head only (:func:`sum_grad_over_copies`: one all-reduce of a
``[num_kv_heads, ...]`` buffer in which each rank fills its head's row). With DTensor parameters
the identity wraps the parameter's local tensor (``p.to_local()``), before the rank's rows of a
replicated KV head are taken, so a Replicate gradient is the same on every rank.

Why inside backward and not in a call after it: the ordinary training loop (``backward``,
``clip_grad_norm_``, ``optimizer.step``) makes no such call, and a forgotten call is silently
wrong. The reductions are collectives in backward: every rank runs the same backward graph, so
they are issued in the same order on every rank (as the layers' own backward collectives are).
Each is one small all-reduce per parameter and call; gradient accumulation over micro-batches
sums the per-call sums, which is the sum.

Data-parallel style partials (:class:`UlyssesAttention`'s parameters, a bare
:class:`OverlapMoE`'s router and shared expert: each rank's gradient covers its own tokens, like a
data-parallel replica's) are left to the data-parallel reduction (DDP, FSDP) over the same ranks,
or to ``finalize_grads(model, data_parallel=True)``.
"""
from __future__ import annotations

from functools import partial
from typing import Iterable

import torch
import torch.distributed as dist

from ...planning.first_order import first_order


class _SumOverGroup(torch.autograd.Function):
    """Forward: identity (a view). Backward: the gradient all-reduced (summed) over the group."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    @first_order  # [Note: first-order backward]: the all-reduced gradient carries no graph
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _SumOverCopies(torch.autograd.Function):
    """Forward: identity (a view) of this rank's copy of one of ``n`` replicated pieces (``index``).
    Backward: the gradient summed over the ranks holding the same piece: one all-reduce over the
    group of an ``[n, *shape]`` buffer in which each rank fills its piece's row."""

    @staticmethod
    def forward(ctx, w, group, n, index):
        ctx.group, ctx.n, ctx.index = group, n, index
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        buf = g.new_zeros((ctx.n, *g.shape))
        buf[ctx.index] = g
        dist.all_reduce(buf, group=ctx.group)
        return buf[ctx.index], None, None, None


def sum_grad_over_group(w: torch.Tensor, group) -> torch.Tensor:
    """``w`` unchanged (a view); its gradient is summed over ``group`` inside backward."""
    return _SumOverGroup.apply(w, group)


def sum_grad_over_copies(w: torch.Tensor, group, n: int, index: int) -> torch.Tensor:
    """``w`` unchanged (a view) as this rank's copy of piece ``index`` of ``n``; its gradient is
    summed over the ranks of ``group`` holding the same piece inside backward."""
    return _SumOverCopies.apply(w, group, n, index)


def sum_grads_in_backward(layer, names: Iterable[str], *, copies=None) -> None:
    """Have ``layer`` (a planned layer, which reads its parameters through ``_local``) read the
    parameters ``names`` through :func:`sum_grad_over_group` over ``layer.group``; ``copies``
    ``(n, index)``: through :func:`sum_grad_over_copies` instead while the parameters are plain
    (their DTensor form holds every piece on every rank: summed over the group). Absent
    parameters are skipped; a group of one rank needs nothing. Idempotent."""
    group = layer.group
    names = [n for n in names if getattr(layer, n, None) is not None and n not in layer._grad_sums]
    if not names or dist.get_world_size(group) == 1:
        return
    whole = partial(sum_grad_over_group, group=group)
    plain = whole if copies is None else partial(sum_grad_over_copies, group=group, n=copies[0], index=copies[1])
    sums = dict(layer._grad_sums)
    for name in names:
        sums[name] = (plain, whole)  # (plain parameter, DTensor parameter's local tensor)
    layer._grad_sums = sums


def summed_in_backward(layer, name: str) -> bool:
    """Whether ``layer``'s gradient of parameter ``name`` is summed over its group inside backward."""
    return name in getattr(layer, "_grad_sums", {})
