"""An MoE call with every size on the device, so that ``config.graph_calls`` can capture it and
replay it ([Note: MoE graph calls]).

Reference: :func:`experts_at_once` returns what :class:`~overlap_layers.layers.moe.OverlapMoE`'s
eager call returns for the routed experts (``moe.py``'s module docstring, without the shared
expert), up to rounding: for each token, the sum over its kept assignments of the combine weight
times its expert's output, 0 for an assignment dropped by capacity.

[Note: MoE graph calls]
An eager MoE call reads its all-to-all sizes on the host ([Note: MoE host syncs] in ``moe.py``):
on the 4x H200 machine the qwen3-30b-a3b forward (EP 4, 8192 tokens) took 3.75 ms against a limit
of 1.65, host-bound (session 26). With ``config.graph_calls``, a call without autograd whose
exchange can run over symmetric memory runs this path instead, captured once per signature and
replayed ([Note: graph calls] in ``call_graphs.py``):

* routing, capacity and the send order as the eager call's (one tile), the send rows gathered
  straight into the exchange's send buffer;
* :class:`~overlap_layers.runtime.device_all_to_all.DeviceCountAllToAll` with one group per local
  expert: the rows arrive grouped by local expert (every source's rows of expert 0 first), so
  one grouped GEMM per projection runs them with offsets computed on the device; its receive
  buffer holds the bound of ``ws * rows`` (every rank's rows could come here), and the GEMMs
  and the fused SwiGLU leave the rows past the offsets' end unread and unwritten (at balanced
  routing the bound is ``ws`` times the received rows);
* the combine pushes each result back to its source, in send order; a row past the kept count
  (dropped by capacity) is masked to 0 and the rows return to token order by the inverse
  permutation, weighted by one ``bmm`` as in the eager call.

It needs every rank's symmetric memory (the agreed copy-engine floor), grouped GEMMs, no aux loss
(the layer hands it out as a tensor made by the call, which a replay does not make) and no
autograd (a training call stays eager). The exchange uses a workspace of its own
(``shared_workspace(..., "device_counts")``): its peers write its table rows without a signal of
this rank's call, which data of another exchange in the same buffer would race. The graph's
signature holds every rank's (batch, seq), so that ranks holding different token counts capture
at the same calls. The plan the layer verified on its eager calls does not apply: this path is
one piece, its exchanges under nothing but the shared expert.
"""
from __future__ import annotations

import torch

from .mlp import _act


def rows_bound(max_tokens: int, top_k: int) -> int:
    """Send rows a rank may need: the group's largest token count, rounded up to a power of two
    (so that nearby counts share an exchange and a capture), times ``top_k``."""
    return (1 << max(max_tokens - 1, 0).bit_length()) * top_k


def experts_at_once(layer, x_TH: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, exchange) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` for this rank's tokens ``x_TH`` (module docstring)
    through ``exchange`` (a ``DeviceCountAllToAll`` of ``layer.num_local_experts`` groups, or
    anything with its ``send``, ``dispatch``, ``recv_counts`` and ``combine``), with no value
    read on the host."""
    T, H = x_TH.shape
    k, ws, El = layer.top_k, layer.world_size, layer.num_local_experts
    order, weights, counts = layer._route_and_count(x_TH, 1)
    n = order.numel()
    torch.index_select(x_TH, 0, torch.div(order, k, rounding_mode="floor"), out=exchange.send[:n])
    recv = x_TH.new_empty((ws * exchange.rows, H))
    exchange.dispatch(counts.view(ws, El).to(torch.int32), recv)
    offs = torch.cumsum(exchange.recv_counts.sum(0), 0).to(torch.int32)
    h = torch._grouped_mm(recv, w_in.transpose(-2, -1), offs=offs)
    y_g = torch._grouped_mm(_act(layer.activation, h, offs[-1:]), w_out.transpose(-2, -1), offs=offs)
    rows = exchange.combine(y_g)[:n]
    if layer.capacity_factor is not None:  # the dropped assignments sort last: their rows are 0
        kept = counts.sum()
        rows = torch.where(torch.arange(n, device=rows.device)[:, None] < kept, rows, 0)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=order.device))
    rows = rows.index_select(0, pos).view(T, k, H)
    return torch.bmm(weights.to(rows.dtype).unsqueeze(1), rows).squeeze(1)
