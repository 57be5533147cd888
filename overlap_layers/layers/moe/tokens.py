"""Splitting replicated tokens across a group and gathering them back (autograd both ways).

Reference (per rank; T tokens of a replicated input, t_r = rank r's share, the first ``T % ws``
ranks hold one more):

=====================  ==================================  ==================================================
function               forward                             backward
=====================  ==================================  ==================================================
:func:`split_tokens`   x ``[T, H]`` -> own rows ``[t_r, H]``  all-gather the ranks' ``dx`` slices -> full
                                                           ``dx [T, H]`` (the gradient of a replicated input
                                                           is the full gradient on every rank)
:func:`gather_tokens`  own rows ``[t_r, H]`` -> all-gather  ``dy [T, H]`` (full, identical on every rank)
                       ``[T, H]``                          -> own rows ``dy[own]``
=====================  ==================================  ==================================================

Used where an expert-parallel MoE sees replicated tokens (the HF adapter; a block without
sequence parallelism), so that no token is computed twice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...runtime.collectives import all_gather_single as all_gather_rows


def token_bounds(n: int, ws: int, rank: int):
    """``[start, stop)`` of rank's share of ``n`` replicated tokens (``tensor_split`` style: the
    first ``n % ws`` ranks hold one more; a share may be empty)."""
    base, extra = divmod(n, ws)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _gather_rows(x_tH: torch.Tensor, n: int, group) -> torch.Tensor:
    """All ranks' shares (``token_bounds``) of ``n`` rows, in rank order: ``[n, H]``."""
    ws = dist.get_world_size(group)
    if ws == 1:
        return x_tH.contiguous()
    m = -(-n // ws)
    pad = x_tH.new_zeros((m, *x_tH.shape[1:]))
    pad[:x_tH.shape[0]] = x_tH
    out = x_tH.new_empty((ws * m, *x_tH.shape[1:]))
    all_gather_rows(out, pad, group=group)
    parts = []
    for r in range(ws):
        a, b = token_bounds(n, ws, r)
        parts.append(out[r * m:r * m + (b - a)])
    return torch.cat(parts)


class _SplitTokens(torch.autograd.Function):
    """Forward: this rank's rows of the replicated ``x [T, H]``. Backward: all-gather of every
    rank's ``dx`` rows (the full gradient, on every rank)."""

    @staticmethod
    def forward(ctx, x_TH, group):
        ctx.group, ctx.n = group, x_TH.shape[0]
        a, b = token_bounds(x_TH.shape[0], dist.get_world_size(group), dist.get_rank(group))
        return x_TH[a:b].clone()

    @staticmethod
    def backward(ctx, dx_tH):
        return _gather_rows(dx_tH.contiguous(), ctx.n, ctx.group), None


class _GatherTokens(torch.autograd.Function):
    """Forward: all-gather every rank's rows into ``[T, H]``. Backward: this rank's rows of the
    (replicated, full) ``dy``."""

    @staticmethod
    def forward(ctx, y_tH, group, n):
        ctx.group, ctx.n = group, n
        return _gather_rows(y_tH.contiguous(), n, group)

    @staticmethod
    def backward(ctx, dy_TH):
        a, b = token_bounds(ctx.n, dist.get_world_size(ctx.group), dist.get_rank(ctx.group))
        return dy_TH[a:b].contiguous(), None, None


def split_tokens(x_TH: torch.Tensor, group) -> torch.Tensor:
    """This rank's share of the replicated tokens ``x [T, H]``; see the module table."""
    return _SplitTokens.apply(x_TH, group)


def gather_tokens(y_tH: torch.Tensor, group, n: int) -> torch.Tensor:
    """Every rank's share of ``n`` tokens, all-gathered to ``[n, H]``; see the module table."""
    return _GatherTokens.apply(y_tH, group, n)
