"""Eager calls replayed from CUDA graphs the layer captures itself (``config.graph_calls``).

Reference: :meth:`CallGraphs.run` returns what ``fn(*inputs)`` returns, and its backward gives
the gradients the eager call's backward gives: the same kernels, replayed from graphs captured on
static copies of the inputs.

[Note: graph calls]
On a host slower than the device, an eager call of an overlapped plan is host-bound: a rank-chunk
forward of the llama3-8b MLP (TP 4, 8192 tokens) or attention launches about 100 ops, for two to
four times its device time (measured: see docs/measurements.md, Host overhead), so the planner
keeps the serial plan. Replayed from a CUDA graph, the same call costs one launch. With ``config.graph_calls``, a layer's eager calls replay
graphs per call signature once the call's plan is settled ([Note: first-call verification] done,
or a fixed plan), and verification compares contenders as replays run (``prequeue_ms``, as with
``config.cuda_graphs``):

* the signature is the plan key (grad mode included), the plan, each input's shape and dtype
  (``None`` for an absent one) and the autocast state; the parameters' storage is agreed with
  each call (a parameter replaced by a new tensor, e.g. ``load_state_dict(assign=True)``, drops
  the graphs on every rank; in-place updates are read by the replays). Parameters that move
  again and again (a wrapper that gathers them into new memory every call) would recapture every
  call: after ``MAX_MOVES`` drops with no replay between them the layer stops capturing, with a
  warning;
* the first call of a signature copies its inputs into static tensors, runs the call once on a
  side stream (lazy initialisation stays out of the graphs; with autograd, forward and backward),
  captures it, and every rank then gathers whether its capture succeeded: one failure anywhere
  leaves that signature eager on every rank (a warning says why), so all ranks keep issuing the
  same collectives;
* a call that needs no autograd replays one graph: its inputs are copied into the static
  tensors, and a copy of the static output is returned (the next replay overwrites it). Its first
  input's static tensor may be a place the layer names (``stage``: [Note: staged input]), as may
  a training call's static output gradient;
* a call that saves for backward replays a forward graph and, at its backward, a backward graph
  (captured with ``torch.autograd.grad`` of the static output for the inputs that require grad
  and the parameters), as ``torch.cuda.make_graphed_callables`` does: the saved activations stay
  in the graphs' shared memory pool. So a second forward of a signature whose backward has not
  run yet (pipeline schedules, several micro-batches in flight, or a grad-mode forward whose
  backward never runs, which leaves the signature eager from then on) runs eagerly, and a second
  backward through a replayed call (``retain_graph``) raises ``RuntimeError``: the backward graph
  was captured as a first and only backward, which may consume what it reads (the MLP's rank
  chunks and the MoE's device path write gradients over their saved pre-activations), and a later
  forward of the signature may have overwritten its activations. Eager too: every call under
  activation checkpointing (its recomputation must rerun the forward). A layer with DTensor
  parameters passes them as they are: the captured backward differentiates them through their
  local views, so the replay hands autograd DTensor gradients with their placements;
* at most ``size`` signatures are kept per layer, least recently used first out: each graph keeps
  its memory pool while it is kept: for training the call's intermediates, its saved activations
  and its gradients (as much again as the parameters that require grad, but those it leaves to
  run after the replay: [Note: deferred gradients]), which the backward copies out; without
  autograd its output, in a pool the layers share ([Note: shared no-grad pool]).

[Note: deferred gradients]
A gradient a backward graph computes lands in the graph's memory, so the replay must copy it out
(the next replay overwrites it), and the pool holds it between replays: for the MoE device path
([Note: MoE training graphs] in ``layers/moe/device.py``) the experts' weight gradients, 300 MB per layer
of qwen3-30b-a3b at EP 4, copied out at every replay. A
layer's backward may instead hand such gradients to :meth:`CallGraphs.defer` while its backward
is captured: it gets placeholders to return (zeros broadcast to the gradients' shapes, no memory),
and the closure it gave runs after each replay of that backward, on the calling stream, its
results taking the placeholders' places among the gradients: computed into fresh memory, which
autograd then takes as it is. What the closure reads must stay valid from the replay to its run:
memory of the graph's pool it keeps referenced (the pool then gives it to nothing else), or
memory no other work writes in between. Each placeholder must come back from the capture as the
gradient of an input or a parameter (a placeholder that went through another op, e.g. a cast
under autocast, would give that op's result of zeros): otherwise the capture fails, and the
signature runs eagerly on every rank, as any failed capture does.

[Note: shared no-grad pool]
A graph keeps its pool between replays. With a pool per layer, a model's graph memory would be the
sum over its layers of each call's intermediates (TP 4, llama3-8b, 16384 tokens: about half a GB
per layer's no-grad graph, about 33 GB for 32 blocks).
A no-grad replay uses its pool only while it runs: its inputs are copied into static tensors
outside the pool, and its output is copied out before the call returns, on the same stream; what
stays allocated in the pool between replays is each graph's output, which no other capture is
given. So the no-grad graphs of all layers of a group (its shared agreement) on one device
capture into one pool (:func:`~overlap_layers.runtime.graph_capture.shared_pool`), and a model holds its largest call's intermediates
and each graph's output, not the sum, at the same speed (measured with
docs/measurements.md, CUDA graphs). A
capture is given only blocks freed on its own stream, so what a plan's side streams (each
layer's own) freed is not shared. Sharing needs the group's layers to run one after another on
one stream, which the copy-engine exchange asks already ([Note: exchange signals]): two layers
replayed at once on two streams would write the same memory. (The stream cannot be part of the
signature: it differs between ranks, and a new signature captures, which gathers.) Training
graphs keep a pool each: their saved activations live from the forward replay to the backward,
across other layers' replays.

[Note: staged input]
A copy-engine rank-chunk call first copies its input into this rank's symmetric buffer, where
peers pull it from ([Note: exchange signals] in ``runtime/exchange.py``). Replayed from a graph,
the input would be copied twice: into the static input, then, inside the graph, into the buffer,
where the copy runs as a kernel (``memcpy128``) that the first GEMM's SMs delay, and the peers'
pulls wait for it. So a no-grad capture takes the layer's ``stage()`` (the exchange's place for its
first source, :func:`~overlap_layers.runtime.symmetric.staged_source`) as that input's static
tensor: a replay copies the input there, on the calling stream, and the exchange, finding its
source already in place, copies nothing. Writing there before the replay is what the graph's own
copy did at its start: the stream has finished every earlier call, and each peer's last read of
this buffer precedes the push that call waited for.

A training graph's backward runs after other layers have used the buffer, so its input is staged
("training_input") only where the backward never reads it: the MLP's rank chunks and the
one-tile attention's, without re-gather, keep the own rows in the gathered buffer they save for
the weight gradients anyway and read them there. Its output gradient is read only while the
backward graph runs, and the backward's exchange takes it as its first source, so it is staged
the same way ("output_grad"): the copy into it before the backward replay is the only one. In
both passes the peers' first pulls then wait for no copy inside the graph (a kernel beside the
first GEMMs, tens of microseconds; measured: see docs/measurements.md, CUDA graphs). A layer whose exchange starts from
another tensor stages nothing: its copy into the place would overwrite a tensor it still reads.

A call being captured by the caller (``torch.cuda.graph``), a traced or timed call, the MoE's
calls but those of its device path ([Note: MoE graph calls] in ``layers/moe/device.py``; its eager
calls read their split sizes on the host) and Ulysses attention (no GPU check of its replays
yet) stay eager. Decisions use agreed values and the call
history only, so every rank captures and replays at the same calls.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, Hashable, List, Optional, Sequence

import torch

from ..runtime.graph_capture import Captured, capture, capture_error, copy_in
from .first_order import first_order


class _TrainingGraph:
    """One captured call with autograd: forward and backward graphs sharing a pool, the static
    inputs, output, output gradient and gradients (``grads``: one per input then parameter, None
    where none is taken or where ``deferred`` gives it); ``deferred``: ``(compute, indices)`` pairs,
    ``compute()`` returning after the backward replay the gradients at ``indices`` of ``grads``
    ([Note: deferred gradients]); ``pending`` while a forward replay awaits its backward."""

    def __init__(self, fwd, bwd, inputs: list, output, grad_output, grads: list, nbytes: int,
                 deferred: Sequence[tuple] = ()) -> None:
        self.fwd, self.bwd, self.inputs, self.output = fwd, bwd, inputs, output
        self.grad_output, self.grads, self.nbytes = grad_output, grads, nbytes
        self.deferred = list(deferred)
        self.pending = False

    def call(self, inputs: Sequence[Optional[torch.Tensor]], params: Sequence[torch.Tensor]) -> torch.Tensor:
        return _Replayed.apply(self, len(inputs), *inputs, *params)


class _Replayed(torch.autograd.Function):
    """The output of a :class:`_TrainingGraph`'s forward replay for ``tensors`` (the call's
    inputs, then the parameters that require grad); its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, entry: _TrainingGraph, n: int, *tensors):
        copy_in(entry.inputs, tensors[:n])
        entry.fwd.replay()
        entry.pending = True
        ctx.entry, ctx.done = entry, False
        # the backward graph reads the parameters where they are now: keep them (a parameter replaced
        # before the backward stays alive, and one changed in place raises, as in an eager backward)
        ctx.save_for_backward(*tensors[n:])
        return entry.output.detach().clone()

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, grad):
        entry = ctx.entry
        _ = ctx.saved_tensors  # unpacking checks that no parameter changed in place since the forward
        if ctx.done:  # a second backward (retain_graph): [Note: graph calls]
            raise RuntimeError("overlap_layers graph_calls: a second backward through a replayed call "
                               "(retain_graph=True) is not supported: its captured backward may have consumed "
                               "the saved activations it reads, or a later forward overwritten them; run such "
                               "calls with graph_calls=False")
        ctx.done = True
        entry.grad_output.copy_(grad)
        entry.bwd.replay()
        entry.pending = False
        grads = [None if g is None else g.clone() for g in entry.grads]
        for compute, indices in entry.deferred:  # [Note: deferred gradients]
            for i, g in zip(indices, compute()):
                grads[i] = g
        return (None, None, *grads)


def _deferred_slots(grads: list, deferred: Sequence[tuple]) -> list:
    """``(compute, indices)`` for each ``(compute, marks)`` that :meth:`CallGraphs.defer` handed
    out during a backward capture: where in ``grads`` (the capture's gradients) each placeholder
    came back, those places set to None. Raises ``RuntimeError`` for a placeholder that is not one
    of ``grads`` (another op took it: [Note: deferred gradients])."""
    out = []
    for compute, marks in deferred:
        indices = [next((i for i, g in enumerate(grads) if g is m), None) for m in marks]
        if None in indices:
            raise RuntimeError("graph_calls: a deferred gradient's placeholder went through another op (a cast "
                               "of the parameter?) instead of reaching an input or parameter")
        for i in indices:
            grads[i] = None
        out.append((compute, indices))
    return out


MAX_MOVES = 3  # parameter moves without a replay between them after which a layer stops capturing


class CallGraphs:
    """The captured calls of one layer, by signature (see the module docstring)."""

    def __init__(self, agreement, size: int = 8) -> None:
        self._agreement = agreement
        self._size = size
        self._moves = 0  # parameter moves since the last replay (every rank counts alike)
        self._graphs: "OrderedDict[Hashable, object]" = OrderedDict()  # None: stays eager
        self._params: Optional[tuple] = None  # where the parameters were when the graphs were captured
        self._where: Optional[tuple] = None  # where they are at this call (params_kept's argument)
        self.last_nbytes = 0  # device memory the graph of the last call keeps (0: ran eagerly)
        self._last_key: Optional[Hashable] = None  # the signature of the last call that asked for a graph
        self._deferring: Optional[list] = None  # during a capture: what defer() handed out

    def __len__(self) -> int:
        return sum(g is not None for g in self._graphs.values())

    def params_kept(self, params: tuple) -> int:
        """1 if the kept graphs read the parameters at ``params`` (or none is kept), else 0; the
        layer gathers it with its agreement, before every call, and calls :meth:`moved` on every
        rank if any rank has 0. A capture at this call records ``params`` as its graphs'."""
        self._where = params
        return int(not self._graphs or params == self._params)

    @property
    def last_key(self):
        """The last call's signature."""
        return self._last_key

    def forget_last(self, key=None) -> None:
        """Drop the graph of the signature ``key`` (default: the last call's; a layer that found it
        slower than the eager call; its next calls of that signature do not ask again)."""
        self._graphs.pop(self._last_key if key is None else key, None)

    def clear(self) -> None:
        """Drop every graph (their memory pools go with them once no pending backward holds them)."""
        self._graphs.clear()
        self._params = None

    def moved(self) -> None:
        """Some rank's parameters moved under the kept graphs (agreed): drop them, and after
        :data:`MAX_MOVES` of these with no replay between them stop capturing."""
        self.clear()
        self._moves += 1
        if self._moves == MAX_MOVES:
            warnings.warn(f"graph_calls: the layer's parameters moved to new memory at {MAX_MOVES} calls in a row "
                          "(a wrapper that gathers them every call?); its calls run eagerly from now on", stacklevel=4)

    def defer(self, compute: Callable[[], Sequence[torch.Tensor]], like: Sequence[torch.Tensor]) -> Optional[tuple]:
        """[Note: deferred gradients]: while this object captures a backward, placeholders for the
        gradients ``compute()`` will return (one per tensor of ``like``, of its shape, dtype and
        device) for the caller's backward to return; ``compute`` then runs after each replay of
        that backward. None otherwise (the caller computes them itself)."""
        if self._deferring is None or not torch.cuda.is_current_stream_capturing():
            return None
        marks = tuple(t.new_zeros(()).expand(t.shape) for t in like)
        self._deferring.append((compute, marks))
        return marks

    @property
    def capturing(self) -> bool:
        """Whether calls still capture and replay (False once the parameters moved too often)."""
        return self._moves < MAX_MOVES

    def run(self, key: Hashable, inputs: Sequence[Optional[torch.Tensor]], fn: Callable,
            params: Optional[List[torch.Tensor]] = None,
            stage: Optional[Callable[[torch.Tensor, str], Optional[torch.Tensor]]] = None) -> torch.Tensor:
        """``fn(*inputs)``, replayed from the graphs of ``key`` (captured at its first call, after
        this call's :meth:`params_kept`). ``params``: for a call that saves for backward, the
        parameters that require grad (also differentiated by the graphs); None for a call without
        autograd. ``stage(t, role)``: where the static tensor standing for ``t`` may live (asked
        at a capture; None: a tensor of its own), [Note: staged input]; ``role`` is "input" (the
        first input of a call without autograd), "training_input" (that of a call with autograd)
        or "output_grad" (the output gradient of a call with autograd)."""
        if not self.capturing:
            self.last_nbytes = 0
            return fn(*inputs)
        self._last_key = key
        if key in self._graphs:
            self._graphs.move_to_end(key)
            graph = self._graphs[key]
            self._moves = 0  # the kept graphs outlived a call: the parameters stay put
        else:
            self._deferring = []
            try:
                graph, error = self._capture(inputs, fn, params, self._agreement, stage, self._deferring)
            finally:
                self._deferring = None
            if not min(row[0] for row in self._agreement.gather((int(graph is not None),))):
                graph = None
                warnings.warn(f"graph_calls: capturing a call failed on some rank ({error or 'not this one'}); "
                              "calls of this signature run eagerly", stacklevel=4)
            self._graphs[key] = graph
            self._params = self._where
            if len(self._graphs) > self._size:
                self._graphs.popitem(last=False)
        if graph is None or graph.pending:  # [Note: graph calls]: eager
            self.last_nbytes = 0
            return fn(*inputs)
        self.last_nbytes = graph.nbytes
        return graph.call(inputs, params or ())

    @staticmethod
    def _capture(inputs: Sequence[Optional[torch.Tensor]], fn: Callable, params: Optional[List[torch.Tensor]],
                 owner, stage: Optional[Callable[[torch.Tensor, str], Optional[torch.Tensor]]] = None,
                 deferred: Sequence[tuple] = ()):
        """``(graph or None, error text)``: the call captured
        (:func:`~overlap_layers.runtime.graph_capture.capture`), with ``params`` as a
        :class:`_TrainingGraph` whose deferred gradients are those :meth:`defer` appended to
        ``deferred`` during the backward's capture."""
        captured, error = capture(inputs, fn, params, owner, stage)
        if not isinstance(captured, Captured):
            return captured, error
        try:
            later = _deferred_slots(captured.grads, deferred)
        except Exception as e:  # noqa: BLE001 - every rank must reach the outcome's gather
            return None, capture_error(e)
        return _TrainingGraph(captured.fwd, captured.bwd, captured.inputs, captured.output, captured.grad_output,
                              captured.grads, captured.nbytes, later), ""
