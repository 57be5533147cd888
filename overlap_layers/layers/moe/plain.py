"""The MoE's serial plan at world size 1: no exchange, so no split sizes on the host and no
collective ([Note: plain serial calls] in ``layers/common/plain_tp.py``).

Reference: ``layers/moe/layer.py``'s module docstring, on one rank: the routing of
:func:`~.routing.route_call` (one tile; assignments dropped by capacity sort last), the
assignments sorted by expert, the experts on the sorted rows, each result row weighed by its
combine weight and summed into its token's row; a dropped assignment adds 0. In torch ops (what
``bench/references.py``'s ``PlainMoE`` writes)::

    order = argsort(keys, stable);  rows = x[order // k]
    out   = act(rows @ w_in[e].T) @ w_out[e].T          for each expert e's rows
    y     = zeros.index_add(0, order // k, out * weights.flat[order][:, None])

[Note: MoE plain call]
Written that way, a qwen3-30b-a3b fwd+bwd on an H200 spends more time around the grouped GEMMs
than in them: the ``index_add`` is an atomic scatter (1.1 ms of 7.3), the gather's backward an
atomic scatter after a sort (0.33 ms), the weighting three elementwise passes, and the weight
gradients of ``w_in``'s transposed view a transposed copy each into ``.grad`` (0.67 ms apiece:
autograd makes a gradient's strides match its parameter's). :class:`_Experts` is one autograd
node instead:

* forward: the rows gathered (``index_select``), one grouped GEMM per projection, the fused
  activation, and the weighted combine as one kernel that reads each token's k result rows where
  they are (``combine_rows``, keeping the unweighted rows token-major when the router needs its
  gradient);
* backward: the weighting's backward writes each row's gradient straight to its sorted place and
  returns the combine weights' gradient (``weigh_backward_into``); the fused activation backward
  also gives the activation back for ``w_out``'s gradient; the weight gradients come out of the
  grouped GEMMs in the parameters' own layouts (``d_pre.T @ rows`` is ``[E, 2F, H]``), so nothing
  is copied; the input's gradient sums each token's k row gradients where they are (the combine's
  kernel with weights 1).

No host synchronisation on the grouped path: the offsets stay on the device, so graph calls
capture it; in their backward the weight gradients run after the replay ([Note: deferred
gradients] in ``planning/call_graphs.py``: a replay would otherwise copy 1.2 GB of qwen3-30b-a3b's
expert gradients out of the graph, 0.6 ms of a 4.9 ms call on an H200). Without grouped
GEMMs (float64, strides they refuse, an older torch) the experts run as a GEMM pair per expert
with the sizes read on the host once per call.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ...planning.first_order import first_order
from ..common.activations import act, act_backward
from .combine import combine_rows, weigh_backward_into
from .experts import grouped_gemm_ok


def _rows_by_expert(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, sizes: Optional[List[int]]) -> torch.Tensor:
    """``a``'s rows (grouped by expert, ``offs`` their ends) each times its expert's ``b[e]``."""
    if sizes is None:
        return torch._grouped_mm(a, b, offs=offs)
    out, start = a.new_empty((sum(sizes), b.shape[-1])), 0
    for e, n in enumerate(sizes):  # each expert's product written in place: no concatenating copy
        torch.mm(a[start:start + n], b[e], out=out[start:start + n])
        start += n
    return out


def _per_expert(a_t: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, sizes: Optional[List[int]],
                experts: int) -> torch.Tensor:
    """``[E, m, n]``: per expert e, ``a_t``'s columns of e's rows times ``b``'s rows of them
    (``a_t`` ``[m, rows]``, ``b`` ``[rows, n]``; a weight gradient, in the weight's layout)."""
    if sizes is None:
        return torch._grouped_mm(a_t, b, offs=offs)
    out = a_t.new_empty((experts, a_t.shape[0], b.shape[1]))  # every slice written: an expert with no rows gets 0
    start = 0
    for e, n in enumerate(sizes):
        torch.mm(a_t[:, start:start + n], b[start:start + n], out=out[e])
        start += n
    return out


def _rows(t: torch.Tensor, kept: Optional[torch.Tensor]):
    """``t``'s row count as ``combine_rows`` takes it beside ``kept``: its counts are all host ints
    or all device tensors."""
    return t.shape[0] if kept is None else kept.new_full((1,), t.shape[0])


class _Experts(torch.autograd.Function):
    """``y [T, H]`` of the module reference from the routed assignments ([Note: MoE plain call]):
    ``order`` sorts the token-major assignments by expert, ``pos`` is its inverse, ``offs`` the
    experts' row ends (int32, on the device), ``sizes`` their row counts on the host where grouped
    GEMMs do not run (else None), ``kept`` the count of assignments kept by capacity (a one-element
    device tensor, or None: all kept). First derivatives only ([Note: first-order backward])."""

    @staticmethod
    def forward(ctx, x, w_in, w_out, weights, order, pos, offs, sizes, kept, activation: str, defer):
        T, k = weights.shape
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        pre = _rows_by_expert(rows, w_in.transpose(-2, -1), offs, sizes)
        out = _rows_by_expert(act(activation, pre), w_out.transpose(-2, -1), offs, sizes)
        if out.shape[0] < rows.shape[0]:  # the loop leaves out the dropped rows: zeros stand in for them
            out = torch.cat([out, out.new_zeros((rows.shape[0] - out.shape[0], out.shape[1]))])
        unweighted = out.new_empty((T * k, out.shape[1])) if ctx.needs_input_grad[3] else None
        y = combine_rows(out, out, pos, weights, _rows(out, kept), kept, rows_out=unweighted)
        ctx.save_for_backward(rows, pre, unweighted, weights, order, pos, offs, kept, w_in, w_out)
        ctx.sizes, ctx.activation, ctx.defer = sizes, activation, defer
        return y

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy):
        rows, pre, unweighted, weights, order, pos, offs, kept, w_in, w_out = ctx.saved_tensors
        sizes, E = ctx.sizes, w_in.shape[0]
        T, k = weights.shape
        dy = dy.contiguous()
        d_out = torch.empty_like(rows)  # each assignment's gradient at its sorted place
        if unweighted is not None:
            d_weights = weigh_backward_into(unweighted.view(T, k, -1), weights, dy, pos, d_out)
        else:  # a router without gradient: each row's gradient is its weight times its token's
            d_weights = None
            torch.mul(dy.index_select(0, torch.div(order, k, rounding_mode="floor")),
                      weights.reshape(-1)[order][:, None], out=d_out)
        d_act = _rows_by_expert(d_out, w_out, offs, sizes)
        d_pre, h = act_backward(ctx.activation, pre, d_act)
        operands = {1: (d_pre, rows), 2: (d_out, h)}  # each weight's gradient: dy rows.T @ input rows
        wanted = [(i, w) for i, w in ((1, w_in), (2, w_out)) if ctx.needs_input_grad[i]]

        def weight_grads() -> tuple:
            return tuple(_per_expert(operands[i][0].t(), operands[i][1], offs, sizes, E) for i, _ in wanted)
        # in a captured backward of the layer's graph calls they run after each replay, into fresh
        # memory, instead of being copied out of the graph's ([Note: deferred gradients])
        grads = ctx.defer(weight_grads, [w for _, w in wanted]) if ctx.defer is not None and wanted else None
        by_input = dict(zip((i for i, _ in wanted), weight_grads() if grads is None else grads))
        d_w_in, d_w_out = by_input.get(1), by_input.get(2)
        d_x = None
        if ctx.needs_input_grad[0]:  # each token's k row gradients summed where they are: the combine, weights 1
            d_rows = _rows_by_expert(d_pre, w_in, offs, sizes)
            d_x = combine_rows(d_rows, d_rows, pos, weights.new_ones((T, k)), _rows(d_rows, kept), kept)
        return d_x, d_w_in, d_w_out, d_weights, None, None, None, None, None, None, None


def plain_call(layer, x_TH: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """``y [T, H]`` of ``layer``'s call on its tokens ``x_TH`` (the module reference), ``w_in``,
    ``w_out`` its experts in the call's dtype. In the layer's graph calls, where those are its
    parameters themselves, the experts' weight gradients are deferred past the backward's replay
    ([Note: deferred gradients] in ``planning/call_graphs.py``)."""
    graphs = layer.planner.call_graphs
    defer = graphs.defer if graphs is not None and w_in is layer.w_in and w_out is layer.w_out else None
    keys, weights, counts = layer._route_keys(x_TH, 1)
    order = torch.sort(keys, stable=True).indices  # by expert, dropped assignments last
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    per_expert = counts.reshape(-1)
    offs = torch.cumsum(per_expert, 0, dtype=torch.int32)
    sizes = None if grouped_gemm_ok(x_TH, w_in, w_out) else per_expert.tolist()
    kept = offs[-1:] if layer.capacity_factor is not None else None
    y = _Experts.apply(x_TH, w_in, w_out, weights.to(x_TH.dtype), order, pos, offs, sizes, kept, layer.activation,
                       defer)
    shared = layer._shared_expert(x_TH)
    return y if shared is None else y + shared
