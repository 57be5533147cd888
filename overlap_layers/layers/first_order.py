"""The layers' backward passes are first order: they raise under ``create_graph=True``.

[Note: first-order backward]
Reference: a layer's gradients equal the dense layer's; a second derivative is not offered.
The layers' backward passes run tiled programs: GEMMs into preallocated buffers (``out=``),
collectives and copy-engine transfers, kernels without derivatives. The gradients they return
are exact but carry no graph, so nothing can be differentiated through them. Returning them
under ``create_graph=True`` (double backward, gradient penalties) would be silently wrong: a
penalty on them would add nothing to the parameters' gradients. So the backward raises as soon
as it runs with grad mode on, which autograd does only under ``create_graph=True`` (not for a
plain backward, nor inside activation checkpointing).
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
