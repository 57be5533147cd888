"""One call of a planned layer: what it asks of autograd and of the stream (recorded or not,
inside a backward, under saved-tensor hooks, captured), and its passes run as recorded passes
(:func:`run_tiles`)."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from ..runtime import execute
from ..runtime.carveout import gemm_sm_carveout


class LayerCall:
    """What one call of a planned layer carries besides tensors (through its autograd Function),
    the part every layer's call shares, which :func:`run_tiles` and :func:`recorded_pass` read: its
    process ``group``, ``plan``, whether it saves for backward (``save``), its compute ``streams``
    (None off CUDA) and the layer's ``launch_log``; where the call has them, ``trial`` (first-call
    verification times its backward), ``trace`` (``export_trace(measured=True)`` records every
    op) and ``exchange`` (a rank-chunk plan's exchange factory), else None. Each layer's call
    class adds what its programs read."""

    def __init__(self, group, plan, save: bool, streams: Optional[list], launch_log: Optional[list]) -> None:
        self.group, self.plan, self.save, self.streams, self.launch_log = group, plan, save, streams, launch_log
        self.trial = self.trace = None  # first-call verification / export_trace(measured=True)
        self.exchange: Optional[Callable] = None  # (sources, partial_shape, keep, recorder) -> an exchange


def apply_saving(fn, save: bool, *args):
    """``fn.apply(*args)`` (an autograd Function), recording its graph only when ``save``."""
    if save:
        return fn.apply(*args)
    with torch.no_grad():
        return fn.apply(*args)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are installed (a checkpointed region, or activation offloading)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def in_backward_pass() -> bool:
    """Whether autograd is running a backward node now (e.g. a checkpoint's recomputation)."""
    return torch._C._current_autograd_node() is not None


def capturing_graph(x: torch.Tensor) -> bool:
    """Whether this call on ``x`` is being captured into a CUDA graph ([Note: CUDA graphs])."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def recorded_pass(call, *, backward: bool, device: torch.device):
    """One pass of a layer call: yields the ``OpRecorder`` for ``export_trace(measured=True)``
    (None unless ``call.trace`` is set); in backward, times the pass for first-call verification
    when ``call.trial`` is set, and writes the trace at the end."""
    trace, trial = call.trace, (call.trial if backward else None)
    recorder = None if trace is None else (trace.start_backward() if backward else trace.fwd)
    if trial is not None:
        trial.bwd = trial.fwd.sibling()
        trial.bwd.start()
    yield recorder
    if trial is not None:
        trial.bwd.stop()
    if backward and trace is not None:
        trace.write()


def run_tiles(call, schedule, envs, label: str, *, backward: bool, device: torch.device) -> None:
    """``execute`` one pass of a layer call on ``call.streams`` (``call.group``, ``call.launch_log``)
    as a :func:`recorded_pass`."""
    with recorded_pass(call, backward=backward, device=device) as recorder, \
            gemm_sm_carveout(call.plan.carved_sms(backward)):
        execute(schedule, envs, call.group, streams=call.streams, label=label, trace=call.launch_log,
                recorder=recorder)
