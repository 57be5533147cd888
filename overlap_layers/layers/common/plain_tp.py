"""The serial plan (K=1) of a tensor-parallel layer as plain torch ops that autograd records, with
the group's collectives at its two ends, as Megatron's tensor-parallel mappings place them.

Reference: :func:`enter` and :func:`leave` around a layer's local math equal the tiled path at
K=1, with the local rows of ``x [T, H]`` (``T`` tokens on this rank; a ``[B, s, H]`` tensor is
gathered and scattered along its batch dim, whose rank-major blocks are the same rows):

===============  ===========================================  ==========================================
                 forward                                      backward
===============  ===========================================  ==========================================
enter, SP        ``[ws*T, H]`` all-gathered rows, rank-major  reduce-scatter of the gradient
enter, no SP     ``x`` (the replicated input)                 all-reduce of the gradient
leave, SP        reduce-scatter of ``[ws*T, H]`` to ``[T, H]``  all-gather of the gradient
leave, no SP     all-reduce                                   the gradient (replicated)
===============  ===========================================  ==========================================

At world size 1 both are the identity and issue nothing.

[Note: plain serial calls]
A serial plan runs no tile program: there is nothing to overlap, and the executor's streams,
events and per-tile environments cost host time a plain module does not pay (measured:
docs/measurements.md, Host overhead). A layer runs its serial plan this way unless the call
records its ops (``export_trace(measured=True)``, a ``launch_log``: :meth:`TilePlan.runs_plain`).
The collectives are issued directly through ``torch.distributed`` on the current stream (c10d's
``wait`` orders the stream on NCCL; gloo returns when done). A verification trial of the serial
plan times this path, as steady state runs it: its forward around the call, its backward from
the output's gradient (:func:`timed_output`) to the node that gives the first projection's
input and weight their gradients (:func:`timed_inputs`). A checkpoint's recomputation therefore
runs the path its forward ran (the same plan, and a trace is never taken by a checkpointed
call: ``LayerPlanner.call``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...planning.first_order import first_order
from ...runtime.collectives import gathered_rows, scattered_rows
from .grads import sum_grad_over_group


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gathered_rows(x, group)

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, g):
        return scattered_rows(g, ctx.group), None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return scattered_rows(y, group)

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, g):
        return gathered_rows(g, ctx.group), None


class _SumOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, g):
        return g, None


def enter(x_TH: torch.Tensor, group, ws: int, sequence_parallel: bool) -> torch.Tensor:
    """The rows a column-parallel projection reads (module docstring); ``x`` at world size 1, and
    without sequence parallelism where grad mode is off (the all-reduce is backward's)."""
    if ws == 1 or not (sequence_parallel or torch.is_grad_enabled()):
        return x_TH
    return _GatherRows.apply(x_TH, group) if sequence_parallel else sum_grad_over_group(x_TH, group)


def leave(y: torch.Tensor, group, ws: int, sequence_parallel: bool) -> torch.Tensor:
    """A row-parallel projection's partial output reduced over the group (module docstring). ``y``
    is the caller's own (a projection's fresh output): without sequence parallelism and grad mode
    it is all-reduced in place, with no copy and no autograd node."""
    if ws == 1:
        return y
    if sequence_parallel:
        return _ScatterRows.apply(y, group)
    if torch.is_grad_enabled():
        return _SumOutput.apply(y, group)
    y = y.contiguous()
    dist.all_reduce(y, group=group)
    return y


class _StartBackwardClock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, trial):
        ctx.trial = trial
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        trial = ctx.trial
        trial.bwd = trial.fwd.sibling()
        trial.bwd.start()
        return g, None


class _StopBackwardClock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, trial, *tensors):
        ctx.trial = trial
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.trial.bwd is not None:
            ctx.trial.bwd.stop()
        return (None, *grads)


def timed_output(y: torch.Tensor, trial) -> torch.Tensor:
    """``y``, whose gradient starts the backward stopwatch of verification ``trial`` (None: ``y``)."""
    if trial is None or not y.requires_grad:
        return y
    return _StartBackwardClock.apply(y, trial)


def timed_inputs(trial, *tensors: torch.Tensor) -> tuple:
    """``tensors`` (the first projection's input and weight), whose gradients, once all are
    computed, stop ``trial``'s backward stopwatch (None: the tensors themselves)."""
    if trial is None or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return tensors
    return _StopBackwardClock.apply(trial, *tensors)
