"""``copy.deepcopy`` of the layers and the block.

[Note: copying a layer]
Reference: ``copy.deepcopy(layer)`` is a layer like the original just after its construction
and weight loading: its own copies of the parameters, buffers, submodules and settings (sizes,
``config``, a pinned plan, the launch log), on the same process group. It plans afresh at its
first call, as a new layer does; every rank copies alike, so the copies plan alike.

A layer also holds what is not its own to copy: the process group (not copyable), the group's
shared agreement and symmetric workspace, and with ``mesh=`` the mesh and its parameters' local
views, and the identities that sum gradients over the group. The copy shares those with the
original. Its planner (plans, streams, the recompute tables) and everything else private is
per-call state (the last aux loss, index caches): the copy starts it anew, as the constructor does.
"""
from __future__ import annotations

import copy
from typing import Sequence

from torch import nn
from torch.distributed.tensor import DTensor

_MODULE_STATE = frozenset(nn.Module().__dict__)  # nn.Module's own attributes: parameters, hooks, ...
# the group's or the mesh's (the local views, the gradient sums over the group): shared with the copy
_SHARED = ("group", "_input_mesh", "_local_views", "_grad_sums")


def copy_module(module: nn.Module, memo: dict, keep: Sequence[str] = (), fresh: Sequence[str] = ()) -> nn.Module:
    """A deep copy of ``module``'s nn.Module state, public attributes but those named in
    ``fresh`` and the private ones named in ``keep``, with :data:`_SHARED` the same objects as
    ``module``'s ([Note: copying a layer]); the caller starts the per-call state (and ``fresh``)."""
    new = type(module).__new__(type(module))
    memo[id(module)] = new
    for name in _SHARED:
        value = module.__dict__.get(name)
        if value is not None:
            memo.setdefault(id(value), value)
    for p in module._parameters.values():
        if isinstance(getattr(p, "grad", None), DTensor):
            # a DTensor gradient whose local tensor is a view at an offset (the attention's k and v
            # gradients are views of one q-k-v buffer) fails torch's deepcopy: copy it whole
            memo.setdefault(id(p.grad), p.grad.clone())
    state = {k: v for k, v in module.__dict__.items() if k not in fresh and (
        k in _MODULE_STATE or k in _SHARED or k in keep or not k.startswith("_"))}
    new.__dict__.update(copy.deepcopy(state, memo))
    return new
