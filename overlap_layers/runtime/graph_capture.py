"""CUDA-graph capture of a layer's call (``config.graph_calls``; the bookkeeping of which calls
capture and replay, and its Notes, are in ``planning/call_graphs.py``): the call run once on a
side stream, then captured, into a pool of its own (with autograd: forward and backward graphs)
or into the pool the no-grad graphs of one owner share per device ([Note: shared no-grad pool]);
the static inputs a replay copies into; the replay of a call without autograd."""
from __future__ import annotations

import weakref
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch


_NO_GRAD_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # owner -> {device: _SharedPool}


class _SharedPool:
    """A pool handle and the graphs captured into it (weakly). The allocator keeps a pool only
    while a graph captured into it lives: a capture into the handle of a pool whose graphs are all
    gone fails an internal assert (``use_count > 0`` in ``beginAllocateToPool``; seen when a
    benchmark freed one layer and built the next), so such a handle is never handed out again."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self.graphs: "weakref.WeakSet" = weakref.WeakSet()


def shared_pool(owner, device: torch.device) -> _SharedPool:
    """The memory pool the no-grad graphs of ``owner``'s layers (their group's shared agreement)
    capture into on ``device`` ([Note: shared no-grad pool] in ``planning/call_graphs.py``): made
    at the first capture, and again once every graph captured into it is gone; dropped with
    ``owner``. A capture adds its graph to the pool's ``graphs``."""
    pools = _NO_GRAD_POOLS.setdefault(owner, {})
    pool = pools.get(device)
    if pool is None or not pool.graphs:
        pool = pools[device] = _SharedPool()
    return pool


def _static(inputs: Sequence[Optional[torch.Tensor]], grad: bool) -> list:
    """Copies of ``inputs`` the graphs read (with ``grad``, requiring grad where the input does)."""
    return [None if t is None else t.detach().clone().requires_grad_(grad and t.requires_grad) for t in inputs]


def _needs(static: Sequence[Optional[torch.Tensor]], params: Optional[List[torch.Tensor]]) -> list:
    """What a training call's backward differentiates: the static inputs that require grad, then
    the parameters."""
    return [t for t in static if t is not None and t.requires_grad] + list(params or ())


def copy_in(static: Sequence[Optional[torch.Tensor]], inputs: Sequence[Optional[torch.Tensor]]) -> None:
    with torch.no_grad():
        for s, t in zip(static, inputs):
            if s is not None:
                s.copy_(t)


def _nbytes(static: Sequence[Optional[torch.Tensor]], reserved_before: int, device) -> int:
    """What a capture keeps: the pool's growth since ``reserved_before`` and the static inputs
    it made."""
    return torch.cuda.memory_reserved(device) - reserved_before + sum(
        t.numel() * t.element_size() for t in static if t is not None)


class _Graph:
    """One captured call without autograd: the graph, its static inputs and output; ``nbytes``
    the device memory it keeps (its pool, which holds the call's intermediates, and the inputs)."""

    pending = False  # never: a call without autograd has no backward to wait for

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list, output: torch.Tensor, nbytes: int) -> None:
        self.graph, self.inputs, self.output, self.nbytes = graph, inputs, output, nbytes

    def call(self, inputs: Sequence[Optional[torch.Tensor]], params: Sequence[torch.Tensor]) -> torch.Tensor:
        copy_in(self.inputs, inputs)
        self.graph.replay()
        return self.output.clone()


class Captured(NamedTuple):
    """A call captured with autograd: the forward and backward graphs (one pool), the static
    inputs, output and output gradient, the gradients the backward graph computes (one per input
    that requires grad, then per parameter; None where none is taken) and the memory kept."""

    fwd: torch.cuda.CUDAGraph
    bwd: torch.cuda.CUDAGraph
    inputs: list
    output: torch.Tensor
    grad_output: torch.Tensor
    grads: list
    nbytes: int


def capture_error(e: BaseException) -> str:
    """The text a failed capture reports: a failed op inside a capture surfaces as the capture's
    end failing, so the op's error is named too."""
    first = e.__context__
    during = f" (during: {type(first).__name__}: {str(first)[:200]})" if first is not None else ""
    return f"{type(e).__name__}: {str(e)[:200]}{during}"


def capture(inputs: Sequence[Optional[torch.Tensor]], fn: Callable, params: Optional[List[torch.Tensor]], owner,
            stage: Optional[Callable[[torch.Tensor, str], Optional[torch.Tensor]]] = None):
    """``(graph, "")`` (a :class:`_Graph` without ``params``, a :class:`Captured` with them) or
    ``(None, error text)``: ``fn`` run once on static copies of ``inputs`` on a
    side stream (with ``params``, forward and backward), then captured: into a pool of its own
    with ``params``, else into ``owner``'s :func:`shared_pool`; the first input's copy and the
    output gradient where ``stage`` says after the run (which made the place)."""
    dev = inputs[0].device
    training = params is not None
    static = _static(inputs, training)
    pool, caller = None, torch.cuda.current_stream(dev)
    try:
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            out = fn(*static)
            if training:
                torch.autograd.grad(out, _needs(static, params), torch.zeros_like(out), allow_unused=True)
        torch.cuda.current_stream(dev).wait_stream(side)
        del out
        first = None if stage is None else stage(static[0], "training_input" if training else "input")
        if first is not None:
            with torch.no_grad():
                first.copy_(static[0])
            static[0] = first.detach().requires_grad_(static[0].requires_grad)
        needs = _needs(static, params)
        made = static if first is None else [None, *static[1:]]  # the static inputs holding memory of their own
        shared = None if training else shared_pool(owner, dev)
        pool = torch.cuda.graph_pool_handle() if training else shared.handle
        fwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd, pool=pool):
            reserved = torch.cuda.memory_reserved(dev)  # after the capture's own cache release
            out = fn(*static)
        if not isinstance(out, torch.Tensor):
            return None, f"the call returned {type(out).__name__}, not a tensor"
        if not training:
            graph = _Graph(fwd, static, out, _nbytes(made, reserved, dev))
            shared.graphs.add(graph)
            return graph, ""
        staged = None if stage is None else stage(out, "output_grad")
        grad_out = torch.empty_like(out) if staged is None else staged
        bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bwd, pool=pool):
            taken = iter(torch.autograd.grad(out, needs, grad_out, allow_unused=True))
        grads = [next(taken) if t is not None and t.requires_grad else None for t in static]
        grads += [next(taken) for _ in params]
        return Captured(fwd, bwd, static, out.detach(), grad_out, grads,
                        _nbytes(made, reserved, dev) + (0 if staged is not None else
                                                        grad_out.numel() * grad_out.element_size())), ""
    except Exception as e:  # noqa: BLE001 - every rank must reach the outcome's gather
        if pool is not None:
            _recover(dev, pool, caller)
        return None, capture_error(e)


def _recover(dev: torch.device, pool, caller) -> None:
    """Undo what a failed capture into ``pool`` left behind. ``torch.cuda.graph`` ends a capture's
    allocation to its pool and restores the ``caller``'s stream only after the capture ended
    cleanly, so an op that failed inside the capture leaves the capture's stream current, the
    allocator routing to the pool (and asserting at exit that no capture is underway) and the CUDA
    generators in capture mode (every later random op then raises). Restore the stream, end the
    pool's allocation where it is still open and release the capture's hold on it, then end the
    generators' capture mode by capturing one small op, which ends cleanly."""
    torch.cuda.set_stream(caller)
    for end in (torch._C._cuda_endAllocateToPool, torch._C._cuda_releasePool):
        try:
            end(dev.index, pool)
        except RuntimeError:  # not underway: the failure came after the capture ended
            pass
    torch.cuda.synchronize(dev)
    one = torch.zeros(1, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one.add_(1)
