"""The MoE's local experts as GEMMs: rows grouped by local expert through their experts, by one
grouped GEMM per projection (``torch._grouped_mm``) where it takes the operands, else a GEMM pair
per expert. Every exchange of the MoE runs its experts here: the batch tiles
(``layers/moe/tiles.py``), the rank chunks (``layers/moe/ranks.py``) and the device path
(``layers/moe/device.py``).

Reference: per local expert e, ``act(rows_e @ w_in[e].T) @ w_out[e].T``.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..common.activations import act


def grouped_gemm_ok(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: it exists in this torch, the dtype is
    a float type it supports, and every row stride is a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    e = x.element_size()
    return all(d * e % 16 == 0 for d in (x.shape[1], w_in.shape[1], w_out.shape[1], w_out.shape[2]))


def grouped_for(dtype: torch.dtype, hidden: int, w_in: torch.Tensor, w_out: torch.Tensor) -> bool:
    """Whether input rows of ``dtype`` (``hidden`` wide) run the experts ``w_in``, ``w_out`` by
    grouped GEMMs (:func:`grouped_gemm_ok`)."""
    return grouped_gemm_ok(torch.empty(0, hidden, dtype=dtype, device="meta"), w_in, w_out)


def shared_expert(activation: str, x_TH: torch.Tensor, sw_in: torch.Tensor, sw_out: torch.Tensor,
                  gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The shared expert's output on every row of ``x_TH``, its weights in ``x_TH``'s dtype;
    with ``gate [1, H]`` scaled per row by ``sigmoid(x_TH @ gate.T)`` (Qwen2-MoE's shared expert gate)."""
    sw_in, sw_out = sw_in.to(x_TH.dtype), sw_out.to(x_TH.dtype)
    y = act(activation, x_TH @ sw_in.t()) @ sw_out.t()
    return y if gate is None else torch.sigmoid(x_TH @ gate.to(x_TH.dtype).t()) * y


def routed_ends(rows: int, groups: int) -> torch.Tensor:
    """Grouped-GEMM offsets (int32, each group's end) of ``rows`` rows routed uniformly at random
    over ``groups`` experts: the counts balanced routing gives, each group's last row tile mostly
    partial ([Note: grouped GEMMs cost more than dense ones] in ``layers/moe/cost.py``). Seeded, so every
    rank draws the same."""
    g = torch.Generator().manual_seed(rows)
    counts = torch.bincount(torch.randint(0, groups, (rows,), generator=g, device="cpu"), minlength=groups)
    return torch.cumsum(counts, 0, dtype=torch.int32)


def grouped_setups(cm, w_in: torch.Tensor, w_out: torch.Tensor, dtype: torch.dtype) -> dict:
    """Per :meth:`MoECostModel.grouped_ops` key, a setup of that grouped GEMM as the layer runs
    it: on the layer's expert weights ``w_in``, ``w_out`` (the forward's as transposed views), the
    rows routed at random (:func:`routed_ends`)."""
    w_in, w_out = w_in.detach().to(dtype), w_out.detach().to(dtype)
    weights = (w_in.transpose(-2, -1), w_out.transpose(-2, -1), w_out, w_in)  # MoECostModel.gemms' order
    El, dev = w_in.shape[0], w_in.device

    def setup(m: int, k: int, i: int):
        x = torch.randn(m, k, dtype=dtype, device=dev)
        offs = routed_ends(m, El).to(dev)
        return lambda: torch._grouped_mm(x, weights[i], offs=offs)
    return {key: (lambda m=m, k=k, i=i: setup(m, k, i)) for key, (m, n, k, i) in cm.grouped_ops().items()}


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def experts_forward(activation: str, grouped: bool, x: torch.Tensor, sizes: Optional[List[int]],
                    offs: torch.Tensor, w_in_t, w_out_t, act_rows: Optional[torch.Tensor] = None):
    """``(y, pre)`` of rows grouped by local expert (``sizes`` rows each; ``offs`` their ends: all
    the grouped path needs, where rows of ``x`` past the last end give meaningless rows);
    ``w_in_t``, ``w_out_t`` the weights transposed (``w.transpose(-2, -1)``, made once per pass).
    ``act_rows``: on the grouped path without autograd, the activation's row count on the device
    (``offs[-1:]``: the rows past it are then not computed at all,
    :func:`~overlap_layers.layers.common.activations.act`)."""
    if grouped:
        pre = grouped_mm(x, w_in_t, offs)
        return grouped_mm(act(activation, pre, act_rows), w_out_t, offs), pre
    pre = torch.cat([rows @ w_in_t[e] for e, rows in enumerate(x.split(sizes))]) if x.shape[0] else \
        x.new_empty((0, w_in_t.shape[2]))
    a = act(activation, pre)
    y = torch.cat([rows @ w_out_t[e] for e, rows in enumerate(a.split(sizes))]) if x.shape[0] else \
        x.new_empty((0, w_out_t.shape[2]))
    return y, pre
