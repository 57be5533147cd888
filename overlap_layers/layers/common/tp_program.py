"""The tile programs of a tensor-parallel block, column projection -> core -> row projection, with
the collectives placed once for every layer that has this shape (the MLP, OverlapAttention).

Reference (per rank, per tile; SP = sequence parallel)::

    forward    xg = AG(x) (SP);  a = column(xg or x);  h = core(a);  y = RS(row(h)) (SP) or AR(row(h))
    backward   dyg = AG(dy) (SP; and xg = AG(x) again when re-gathering);  dh = dgrad_row(dyg or dy);
               da = core_bwd(dh);  dxg = dgrad_column(da);  dx = RS(dxg) (SP) or AR(dxg);
               wgrad_row (under the dx reduction);  wgrad_column (after the re-gather's wait)

Waits sit where the segmented round-robin should cut: after the gather, after the reduction.
A layer supplies the compute callables and their op names (which its cost model knows); the
environment keys of the collectives are fixed: ``x``/``xg``, ``yp``/``y_out``/``y`` and
``dy``/``dyg``, ``dxg``/``dx_out``/``dx``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Tuple

import torch

from ...schedule import TileProgram, comm, compute, wait

Step = Tuple[str, Callable[[dict], None]]


def forward_program(name: str, sequence_parallel: bool, column: Step, core: Step, row: Step) -> TileProgram:
    """``row`` writes ``env["yp"]`` (SP) or into ``env["y_out"]`` (no SP)."""
    body = (compute(*column), compute(*core), compute(*row))
    if sequence_parallel:
        ops = (comm("ag", "all_gather", src="x"), wait("ag", dst="xg"), *body,
               comm("rs", "reduce_scatter", src="yp", out="y_out"), wait("rs", dst="y"))
    else:
        ops = (*body, comm("ar", "all_reduce", src="y_out"), wait("ar", dst="y"))
    return TileProgram(name, ops)


def backward_program(name: str, sequence_parallel: bool, regather: bool, dgrad_row: Step, core_bwd: Step,
                     dgrad_column: Step, wgrad_row: Tuple[str, Callable, str],
                     wgrad_column: Tuple[str, Callable, str], wgrad_last: bool = False) -> TileProgram:
    """``dgrad_column`` writes ``env["dxg"]`` (SP) or into ``env["dx_out"]`` (no SP); the wgrad
    steps carry the chain name of their accumulator (ordered across streams). ``wgrad_last``: the
    weight gradients open a round of their own (``TileProgram.cut``), after every tile's dx
    reduction has launched."""
    head, regathered = [], ()
    if sequence_parallel:
        head = [comm("ag_dy", "all_gather", src="dy")]
        if regather:
            head.append(comm("ag_x", "all_gather", src="x"))
            regathered = (wait("ag_x", dst="xg"),)
        head.append(wait("ag_dy", dst="dyg"))
        red, tail = comm("rs_dx", "reduce_scatter", src="dxg", out="dx_out"), wait("rs_dx", dst="dx")
    else:
        red, tail = comm("ar_dx", "all_reduce", src="dx_out"), wait("ar_dx", dst="dx")
    ops = (*head, compute(*dgrad_row), compute(*core_bwd), compute(*dgrad_column), red,
           compute(wgrad_row[0], wgrad_row[1], chain=wgrad_row[2]), *regathered,
           compute(wgrad_column[0], wgrad_column[1], chain=wgrad_column[2]), tail)
    return TileProgram(name, ops, cut=(wgrad_row[0],) if wgrad_last else ())


class Accumulator:
    """Gradient accumulators over tiles: the first tile writes (``first(buffer)``), later tiles
    add (``then(buffer)``); ``grads[key]`` are the buffers."""

    def __init__(self, grads: dict) -> None:
        self.grads, self._started = grads, set()

    def __call__(self, key: str, first: Callable, then: Callable) -> None:
        if key in self._started:
            then(self.grads[key])
        else:
            first(self.grads[key])
            self._started.add(key)


def row_forward(sequence_parallel: bool, src: str, w, keep: bool = False) -> Callable[[dict], None]:
    """The row projection ``src @ w.T``: into ``env["yp"]`` (SP) or ``env["y_out"]``; ``keep``
    leaves ``env[src]`` for the backward."""
    def row(env):
        h = env[src] if keep else env.pop(src)
        if sequence_parallel:
            env["yp"] = torch.mm(h, w.t())
        else:
            torch.mm(h, w.t(), out=env["y_out"])
    return row


def column_dgrad(sequence_parallel: bool, src: str, w) -> Callable[[dict], None]:
    """``env[src] @ w``: into ``env["dxg"]`` (SP) or ``env["dx_out"]``."""
    def dgrad(env):
        if sequence_parallel:
            env["dxg"] = torch.mm(env[src], w)
        else:
            torch.mm(env[src], w, out=env["dx_out"])
    return dgrad


def weight_grad(accumulate: Accumulator, key: str, grad: str, inp: str,
                bias_key: Optional[str] = None) -> Callable[[dict], None]:
    """``grads[key] += env[grad].T @ env[inp]`` (and ``grads[bias_key] += sum(env[grad])``);
    pops both."""
    def wgrad(env):
        g, a = env.pop(grad), env.pop(inp)
        accumulate(key, lambda buf: torch.mm(g.t(), a, out=buf), lambda buf: buf.addmm_(g.t(), a))
        if bias_key is not None:
            accumulate(bias_key, lambda buf: torch.sum(g, 0, out=buf), lambda buf: buf.add_(g.sum(0)))
    return wgrad


def column_forward(sequence_parallel: bool, keep_input: bool, w, b, dst: str) -> Callable[[dict], None]:
    """``env[dst] = linear(xg or x, w, b)``; ``keep_input`` leaves the input for the backward."""
    src = "xg" if sequence_parallel else "x"

    def column(env):
        x = env[src] if keep_input else env.pop(src)
        env[dst] = torch.nn.functional.linear(x, w, b)
    return column


def _keep(t):
    return t


@contextlib.contextmanager
def recording_graph():
    """Record a tile's autograd graph inside a layer's forward, for its backward to differentiate
    with ``torch.autograd.grad`` ([Note: per-tile graphs]).

    [Note: per-tile graphs]
    The attention core and the MoE experts keep, per tile, the graph autograd records in the
    forward, and the backward differentiates it (``torch.autograd.grad``) instead of recomputing.
    Under non-reentrant activation checkpointing around the layer, the saved tensors of those
    graphs would be checkpoint's too, and each nested ``autograd.grad`` would recompute the whole
    layer (K+1 recomputations, each issuing the layer's collectives again). Saving them as they
    are (identity saved-tensor hooks) keeps one recomputation; the price is that checkpointing
    does not free those graphs' tensors.
    """
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
        yield
