"""Which plan a layer call runs under activation checkpointing: its forward's plan again when it is
that forward's recomputation ([Note: recompute]).

[Note: recompute]
Under activation checkpointing the forward runs again inside the backward, and must run the
plan its original forward ran (the saved tensors must match). A forward inside a backward pass
therefore replays the plan recorded for its input tensor (the checkpoint passes the same
object; for a DTensor input, the DTensor, not the fresh local view the layer computes on),
consuming no verification trial and not advancing the plan cache; every rank recomputes in
the same order, so the agreement gather still matches.
When the checkpointed region holds more than the layer (a norm before it, a whole decoder
block), the recomputation feeds the layer a new tensor, so identity cannot find the plan. The
forwards that run under saved-tensor hooks (what a checkpoint installs) are therefore queued
per plan key with their plans, until their recomputation: a recomputation the identity lookup
misses takes the oldest queued plan (one found by identity leaves the queue too). A
checkpointed forward may take a verification trial only while no other checkpointed forward of
its key awaits recomputation; otherwise it runs the plan queued last. The queued plans are
thus all equal, and whichever order the recomputations come in, each gets its forward's plan.
(A forward under hooks whose recomputation never comes, e.g. activation offloading, keeps its
entry; later checkpointed forwards of that key then run its plan and take no trials.)
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Callable, NamedTuple, Optional

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .calls import in_backward_pass, saved_tensor_hooks_active


class Chosen(NamedTuple):
    """A call's plan, the verification trial it times (or None), and where it runs: under
    saved-tensor hooks (``hooked``: a checkpointed region) and inside a backward pass."""

    plan: object
    trial: Optional[object]
    hooked: bool
    in_backward: bool


class RecomputePlans:
    """The plans of a layer's forwards that a recomputation must find again ([Note: recompute])."""

    def __init__(self) -> None:
        self.of_input = WeakTensorKeyDictionary()  # input -> its auto plan
        self.checkpointed: dict = {}  # plan key -> deque of (plan, weakref to input) of checkpointed forwards
        self.replay_key = None  # the caller's input when forward runs on a view of it (a DTensor's local)

    def choose(self, x: torch.Tensor, pkey, save: bool, fixed, auto: Callable[[], tuple]) -> Chosen:
        """The plan of a call on ``x`` (plan key ``pkey``): ``fixed`` if not None, else a recorded
        plan where this call recomputes a forward, else ``auto()``'s ``(plan, trial)``, recorded
        for a later recomputation where the call is checkpointed (saves under saved-tensor hooks)."""
        trial = None
        key = self.replay_key if self.replay_key is not None else x
        in_backward = in_backward_pass()
        replay = self.of_input.get(key) if in_backward and isinstance(key, torch.Tensor) else None
        hooked = save and saved_tensor_hooks_active()  # a checkpointed region
        queue = self.checkpointed.setdefault(pkey, deque()) if hooked else None
        if fixed is not None:
            plan = fixed
        elif replay is not None:
            plan = replay
            if queue:
                self.checkpointed[pkey] = deque(e for e in queue if e[1]() is not key)
        elif hooked and in_backward and queue:
            plan = queue.popleft()[0]
        elif hooked and queue:  # forwards whose recomputations are pending: all run the same plan
            plan = queue[-1][0]
            queue.append((plan, weakref.ref(key)))
            self.of_input[key] = plan
        else:
            plan, trial = auto()
            if hooked and not in_backward:  # only a checkpointed forward is recomputed
                self.of_input[key] = plan
                queue.append((plan, weakref.ref(key)))
        return Chosen(plan, trial, hooked, in_backward)
