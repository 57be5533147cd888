"""The layers' backward passes are first order (they raise under ``create_graph=True``) and keep
what a second backward through the same call needs only under ``retain_graph=True``.

[Note: first-order backward]
Reference: a layer's gradients equal the dense layer's; a second derivative is not offered.
The layers' backward passes run tiled programs: GEMMs into preallocated buffers (``out=``),
collectives and copy-engine transfers, kernels without derivatives. The gradients they return
are exact but carry no graph, so nothing can be differentiated through them. Returning them
under ``create_graph=True`` (double backward, gradient penalties) would be silently wrong: a
penalty on them would add nothing to the parameters' gradients. So the backward raises as soon
as it runs with grad mode on, which autograd does only under ``create_graph=True`` (not for a
plain backward, nor inside activation checkpointing).

What the forward kept outside ``save_for_backward`` (the per-tile graphs of the attention core,
Ulysses and the MoE experts, the fused block's tiles, the MoE rank chunks' pieces) a backward
frees as it consumes it, as autograd frees saved tensors, unless the backward runs with
``retain_graph=True`` (:func:`keeps_graph`): then it differentiates the per-tile graphs with
``retain_graph=True`` too and leaves what it took in place (:func:`take`), so a second backward
through the call gives the same gradients again. A second backward after one without it raises
a clear ``RuntimeError``, as autograd does for its own saved tensors.
"""
from __future__ import annotations

import copy
import functools
from typing import Callable

import torch


def first_order(backward: Callable) -> Callable:
    """``backward`` of an autograd Function that raises ``RuntimeError`` when autograd runs it
    with ``create_graph=True`` ([Note: first-order backward])."""
    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError("overlap_layers' layers have first-order gradients only: backward with "
                               "create_graph=True (double backward, gradient penalties) is not supported")
        return backward(ctx, *grads)
    return checked


def keeps_graph() -> bool:
    """Whether the running backward was asked to keep the graph (``retain_graph=True``, which
    ``create_graph=True`` implies); False where torch cannot tell (before 2.5)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(query()) if query is not None else False


def take(ctx, name: str):
    """``ctx.<name>``, a container the backward consumes: set to None here, or under
    :func:`keeps_graph` left in place and a shallow copy returned; a ``RuntimeError`` if a
    backward without ``retain_graph`` took it already ([Note: first-order backward])."""
    value = getattr(ctx, name)
    if value is None:
        raise RuntimeError("overlap_layers: a second backward through the same layer call needs "
                           "retain_graph=True in the first: without it the first freed the tiles it kept")
    if keeps_graph():
        return copy.copy(value)
    setattr(ctx, name, None)
    return value
