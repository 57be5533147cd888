"""The MoE's serial plan at world size 1 as plain torch ops that autograd records: no exchange,
so no split sizes on the host and no collective ([Note: plain serial calls] in
``layers/common/plain_tp.py``).

Reference: ``layers/moe/layer.py``'s module docstring, on one rank: the routing of
:func:`~.routing.route_call` (one tile; assignments dropped by capacity sort last), the
assignments sorted by expert, the experts on the sorted rows (one grouped GEMM per projection
with the offsets on the device where ``torch._grouped_mm`` takes the operands, else a GEMM pair
per expert with the sizes read on the host), each result row weighed by its combine weight and
added into its token's row (``index_add``); a dropped assignment adds 0.
"""
from __future__ import annotations

import torch

from .experts import experts_forward, grouped_gemm_ok


def plain_call(layer, x_TH: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """``y [T, H]`` of ``layer``'s call on its tokens ``x_TH`` (the module docstring), ``w_in``,
    ``w_out`` its experts in the call's dtype."""
    k = layer.top_k
    keys, weights, counts = layer._route_keys(x_TH, 1)
    order = torch.sort(keys, stable=True).indices  # by expert, dropped assignments last
    tokens = order // k
    rows = x_TH[tokens]
    per_expert = counts.reshape(-1)
    offs = torch.cumsum(per_expert, 0, dtype=torch.int32)
    grouped = grouped_gemm_ok(x_TH, w_in, w_out)
    y_rows, _ = experts_forward(layer.activation, grouped, rows, None if grouped else per_expert.tolist(), offs,
                                w_in.transpose(-2, -1), w_out.transpose(-2, -1))
    n = order.numel()
    if layer.capacity_factor is not None:  # rows past the kept ones are meaningless (grouped) or absent
        kept = torch.arange(n, device=x_TH.device) < offs[-1]
        if y_rows.shape[0] < n:
            y_rows = torch.cat([y_rows, y_rows.new_zeros((n - y_rows.shape[0], y_rows.shape[1]))])
        y_rows = torch.where(kept[:, None], y_rows, 0)
    weighted = y_rows * weights.reshape(-1)[order].to(y_rows.dtype)[:, None]
    y = x_TH.new_zeros(x_TH.shape).index_add(0, tokens, weighted)
    shared = layer._shared_expert(x_TH)
    return y if shared is None else y + shared
