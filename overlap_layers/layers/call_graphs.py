"""Eager calls replayed from CUDA graphs the layer captures itself (``config.graph_calls``).

Reference: :meth:`CallGraphs.run` returns what ``fn(*inputs)`` returns, a new tensor each call:
the same kernels as the eager call, replayed from a graph captured on static copies of the inputs.

[Note: graph calls]
On a host slower than the device, an eager call of an overlapped plan is host-bound: at TP 4 on
the 4x H200 machine, a rank-chunk forward of the llama3-8b MLP (8192 tokens) or attention launches
for 2.8-3.0 ms against 1.0-1.1 ms of device time, its ~100 launches at 5-25 us each (session 28,
``bench/results/host_costs_s28_*``), so the planner keeps the serial plan. Replayed from a CUDA
graph, the same call costs one launch. With ``config.graph_calls``, a layer's eager calls that
need no autograd (no grad mode, or no input or parameter requiring grad) replay a graph per call
signature once the call's plan is settled ([Note: first-call verification] done, or a fixed
plan), and verification compares contenders as replays run (``prequeue_ms``, as with
``config.cuda_graphs``):

* the signature is the plan key, the plan, each input's shape, dtype and device (``None`` for an
  absent one), the autocast state and the parameters' storage (a parameter replaced by a new
  tensor, e.g. ``load_state_dict(assign=True)``, gets a new graph; in-place updates are read by
  the replay);
* the first call of a signature copies its inputs into static tensors, runs the call once on a
  side stream (lazy initialisation stays out of the graph), captures it, and every rank then
  gathers whether its capture succeeded: one failure anywhere leaves that signature eager on
  every rank (a warning says why), so all ranks keep issuing the same collectives;
* a replay copies the inputs into the static tensors, replays, and returns a copy of the static
  output (the next replay overwrites it);
* at most ``size`` signatures are kept per layer, least recently used first out: each graph keeps
  its memory pool (the call's intermediates) for as long as it is kept.

A call being captured by the caller (``torch.cuda.graph``), a forward that saves for backward, a
traced or timed call, and the MoE (its split sizes are read on the host) stay eager. Decisions
use only agreed values and the call history, so every rank captures and replays at the same calls.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, Hashable, Optional, Sequence

import torch


class _Graph:
    """One captured call: the graph, its static inputs and its static output; ``nbytes`` the
    device memory it keeps (its pool, which holds the call's intermediates, and the static inputs)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list, output: torch.Tensor, nbytes: int) -> None:
        self.graph, self.inputs, self.output, self.nbytes = graph, inputs, output, nbytes

    def replay(self, inputs: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        for static, t in zip(self.inputs, inputs):
            if static is not None:
                static.copy_(t)
        self.graph.replay()
        return self.output.clone()


class CallGraphs:
    """The captured calls of one layer, by signature (see the module docstring)."""

    def __init__(self, agreement, size: int = 8) -> None:
        self._agreement = agreement
        self._size = size
        self._graphs: "OrderedDict[Hashable, Optional[_Graph]]" = OrderedDict()  # None: stays eager
        self._params: Optional[tuple] = None  # where the parameters were when the graphs were captured
        self.last_nbytes = 0  # device memory the graph of the last call keeps (0: ran eagerly)

    def __len__(self) -> int:
        return sum(g is not None for g in self._graphs.values())

    def params_kept(self, params: tuple) -> int:
        """1 if the kept graphs read the parameters at ``params`` (or none is kept), else 0; the
        layer gathers it with its agreement and calls :meth:`clear` on every rank if any rank has 0."""
        return int(not self._graphs or params == self._params)

    def clear(self) -> None:
        """Drop every graph (their memory pools go with them)."""
        self._graphs.clear()
        self._params = None

    def run(self, key: Hashable, inputs: Sequence[Optional[torch.Tensor]], fn: Callable,
            params: tuple) -> torch.Tensor:
        """``fn(*inputs)``, replayed from the graph of ``key`` (captured at its first call; ``params``:
        where the parameters are, :meth:`params_kept`)."""
        if key in self._graphs:
            self._graphs.move_to_end(key)
            graph = self._graphs[key]
            self.last_nbytes = 0 if graph is None else graph.nbytes
            return fn(*inputs) if graph is None else graph.replay(inputs)
        graph, error = self._capture(inputs, fn)
        ok = min(row[0] for row in self._agreement.gather((int(graph is not None),)))
        if not ok:
            graph = None
            warnings.warn(f"graph_calls: capturing a call failed on some rank ({error or 'not this one'}); "
                          "calls of this signature run eagerly", stacklevel=4)
        self._graphs[key] = graph
        self._params = params
        self.last_nbytes = 0 if graph is None else graph.nbytes
        if len(self._graphs) > self._size:
            self._graphs.popitem(last=False)
        return fn(*inputs) if graph is None else graph.replay(inputs)

    @staticmethod
    def _capture(inputs: Sequence[Optional[torch.Tensor]], fn: Callable):
        """``(_Graph or None, error text)``: ``fn`` run once on static copies of ``inputs`` on a
        side stream, then captured."""
        try:
            static = [None if t is None else t.detach().clone() for t in inputs]
            dev = static[0].device
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn(*static)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                reserved = torch.cuda.memory_reserved(dev)  # after the capture's own cache release
                out = fn(*static)
            if not isinstance(out, torch.Tensor):
                return None, f"the call returned {type(out).__name__}, not a tensor"
            nbytes = torch.cuda.memory_reserved(dev) - reserved + sum(
                t.numel() * t.element_size() for t in static if t is not None)
            return _Graph(graph, static, out, nbytes), ""
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            return None, f"{type(e).__name__}: {str(e)[:200]}"
