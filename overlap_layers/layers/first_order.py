"""The layers' backward passes run once and are first order: they raise under
``create_graph=True`` and on a second backward through the same graph.

[Note: first-order backward]
Reference: a layer's gradients equal the dense layer's; a second derivative is not offered.
The layers' backward passes run tiled programs: GEMMs into preallocated buffers (``out=``),
collectives and copy-engine transfers, kernels without derivatives. The gradients they return
are exact but carry no graph, so nothing can be differentiated through them. Returning them
under ``create_graph=True`` (double backward, gradient penalties) would be silently wrong: a
penalty on them would add nothing to the parameters' gradients. So the backward raises as soon
as it runs with grad mode on, which autograd does only under ``create_graph=True`` (not for a
plain backward, nor inside activation checkpointing).

A backward also frees what the forward kept outside ``save_for_backward`` (the per-tile graphs
of the attention core and the MoE experts, the fused block's tiles) as it consumes it. A second
backward through the same graph (``retain_graph=True`` the first time) finds it gone and raises
(:func:`take`); layers that keep only saved tensors (the MLP) run it again.
"""
from __future__ import annotations

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


def take(ctx, name: str):
    """``ctx.<name>``, which the backward consumes: set to None here, and a ``RuntimeError`` if
    a previous backward through this graph took it already ([Note: first-order backward])."""
    value = getattr(ctx, name)
    if value is None:
        raise RuntimeError("overlap_layers: a second backward through the same layer call is not supported "
                           "(retain_graph=True): its first backward freed the tiles it kept; run the "
                           "forward again")
    setattr(ctx, name, None)
    return value
