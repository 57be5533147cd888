"""Finishing the gradients that the parallel layers leave as per-rank partials.

Reference: after :func:`finalize_grads`, every parameter replicated inside a layer's
tensor-parallel group holds the gradient the dense layer would give it, on every rank: the sum,
over the ranks that hold a copy, of the rank partials left by backward (the layers leave that
reduction to the training loop, which calls this once after backward, beside its other gradient
reductions). With ``data_parallel=True`` the data-parallel style
partials of :class:`UlyssesAttention` and :class:`OverlapMoE` are summed as well.

[Note: which partials]
Two kinds of replicated parameter hold a rank partial after backward:

* *TP partials*: the rank computed only part of a gradient that no other reduction sums: the
  ranks of a tensor-parallel group are not data-parallel peers of each other, so a DP wrapper
  (DDP, FSDP) built over the data-parallel dimension never reduces across them.
  :func:`finalize_grads` always sums these:

  ===================  =====================================================================
  layer                parameters (grad = this rank's partial)
  ===================  =====================================================================
  OverlapMLP           ``b_out`` under sequence parallelism (only the rank's own rows)
  OverlapAttention     ``bo`` under sequence parallelism; ``q_norm``, ``k_norm`` (only the rank's
                       query/KV heads); ``wk``, ``wv``, ``bk``, ``bv`` when ``num_kv_heads <
                       world_size`` (summed over the ranks sharing each KV head only)
  OverlapTransformer-  the norms' ``weight`` / ``bias`` under sequence parallelism (the rank's
  Block                positions only); its OverlapMoE's ``router_weight``, ``shared_w_in``,
                       ``shared_w_out`` in either mode: inside a block the group is a tensor-
                       parallel group over the same sequences, so the rank's share of the tokens
                       is a TP partial, not a DP-style one (below)
  ===================  =====================================================================

* *DP-style partials*: the rank's gradient is that of its own tokens only, and the layer's group
  is the set of ranks a data-parallel reduction runs over anyway (Ulysses' sequence-parallel
  ranks and an expert-parallel group each hold different tokens, like DP replicas). DDP / FSDP /
  HSDP over those ranks sums (DDP: averages) them with every other parameter's gradient, so
  :func:`finalize_grads` leaves them alone by default, and summing them here as well would count
  them ``world_size`` times:

  ===================  =====================================================================
  UlyssesAttention     every parameter (``wq``, ``wk``, ``wv``, ``wo``, biases, ``q_norm``,
                       ``k_norm``): whole on every rank, gradient of the rank's own positions
  OverlapMoE           ``router_weight``, ``shared_w_in``, ``shared_w_out``: gradient of the
                       rank's own tokens (the experts ``w_in`` / ``w_out`` are sharded and their
                       gradients already hold every rank's tokens routed to them: complete)
  ===================  =====================================================================

  ``data_parallel=True`` sums them too (all-reduce SUM over the layer's group), for a run without
  a DP wrapper over those ranks. The sum is the gradient of the *sum* of the ranks' losses; DDP's
  average is that divided by the group size.

Every reduction is a collective over the layer's group whose membership and sizes come from the
module structure alone (identical on every rank), never from which gradients exist on this rank:
a parameter whose ``.grad`` is None on this rank contributes zeros and a presence flag travelling
in the same buffer, and its ``.grad`` is set on every rank if any rank had one (left None if no
rank had). One all-reduce per layer and parameter dtype for the group-wide sums, one for the
replicated KV heads; no host sync unless this rank lacks a gradient (then one, to read the flags).
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .attention.layer import OverlapAttention
from .attention.ulysses import UlyssesAttention
from .block.layer import OverlapTransformerBlock
from .mlp.layer import OverlapMLP
from .moe.layer import OverlapMoE

try:  # DTensor gradients (FSDP2 / DTensor-sharded parameters): reduce the local shard
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - old torch
    DTensor = None


def _is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor to reduce in place: a DTensor's local shard (an alias under no_grad), else ``t``."""
    return t.to_local() if _is_dtensor(t) else t


def _set_grad(p: nn.Parameter, local_sum: torch.Tensor) -> None:
    """Store ``local_sum`` as ``p.grad``: in place where ``p`` has a gradient, else a new one (a
    DTensor with ``p``'s placements where ``p`` is one)."""
    if p.grad is not None:
        _local(p.grad).copy_(local_sum)
    elif _is_dtensor(p):
        p.grad = DTensor.from_local(local_sum.clone(), p.device_mesh, p.placements, run_check=False)
    else:
        p.grad = local_sum.clone()


def _store(ps, pieces, flags: torch.Tensor, shapes) -> None:
    """Write the reduced ``pieces`` into the parameters' gradients. The summed presence ``flags``
    are read (a device-to-host copy) only where this rank has no gradient of its own."""
    present = None
    for i, (p, piece, shape) in enumerate(zip(ps, pieces, shapes)):
        if p.grad is None:
            present = flags.tolist() if present is None else present
            if present[i] == 0:
                continue  # no rank had a gradient: leave None
        _set_grad(p, piece.view(shape).to(p.dtype))


def _sum_over_group(params: Iterable[Optional[nn.Parameter]], group) -> None:
    """All-reduce (SUM) the gradients of ``params`` (None entries skipped: absent on every rank)
    over ``group``, one flat buffer per dtype with one presence flag per parameter."""
    by_dtype: dict = {}
    for p in params:
        if p is not None:
            by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, ps in by_dtype.items():  # insertion order: the same on every rank
        locals_ = [_local(p) for p in ps]
        parts: List[torch.Tensor] = []
        for p, lp in zip(ps, locals_):
            g = _local(p.grad) if p.grad is not None else None
            parts.append((g.to(dtype) if g is not None else lp.new_zeros(lp.shape)).reshape(-1))
        flags = torch.tensor([float(p.grad is not None) for p in ps], dtype=dtype, device=locals_[0].device)
        buf = torch.cat(parts + [flags])
        dist.all_reduce(buf, group=group)
        sizes = [lp.numel() for lp in locals_]
        _store(ps, buf[:sum(sizes)].split(sizes), buf[sum(sizes):], [lp.shape for lp in locals_])


def _sum_kv_copies(layer: OverlapAttention) -> None:
    """KV heads replicated over ``ws / nkv`` ranks: sum each head's copies' gradients (wk, wv and
    their biases) over the ranks holding it, in one all-reduce of a ``[nkv, numel + flags]``
    buffer where each rank fills the row of its head."""
    ps = [p for p in (layer.wk, layer.wv, layer.bk, layer.bv) if p is not None]
    dtype, dev = ps[0].dtype, _local(ps[0]).device
    sizes = [_local(p).numel() for p in ps]
    row = torch.cat([(_local(p.grad).to(dtype) if p.grad is not None else _local(p).new_zeros(_local(p).shape,
                                                                                          dtype=dtype)).reshape(-1)
                     for p in ps] + [torch.tensor([float(p.grad is not None) for p in ps], dtype=dtype, device=dev)])
    buf = row.new_zeros((layer.num_kv_heads, row.numel()))
    head = layer._kv_heads().start
    buf[head] = row
    dist.all_reduce(buf, group=layer.group)
    mine = buf[head]
    _store(ps, mine[:sum(sizes)].split(sizes), mine[sum(sizes):], [_local(p).shape for p in ps])


@torch.no_grad()
def finalize_grads(model: nn.Module, data_parallel: bool = False) -> None:
    """Sum, over each layer's group, the gradients that backward left as rank partials, for every
    overlap layer in ``model`` (``model`` itself included); see [Note: which partials].

    Always (tensor-parallel partials, which no data-parallel wrapper reduces):
    :class:`OverlapMLP` ``b_out`` under sequence parallelism; :class:`OverlapAttention` ``bo``
    under sequence parallelism, ``q_norm`` / ``k_norm``, and ``wk``, ``wv``, ``bk``, ``bv`` when
    ``num_kv_heads < world_size`` (over the ranks sharing each KV head);
    :class:`OverlapTransformerBlock` norms under sequence parallelism, and its MoE's router and
    shared expert.

    Not by default (data-parallel style partials: the gradient of the rank's own tokens, which a
    DDP / FSDP reduction over the same ranks sums): every parameter of :class:`UlyssesAttention`,
    and :class:`OverlapMoE` ``router_weight``, ``shared_w_in``, ``shared_w_out``. With
    ``data_parallel=True`` these are summed as well (all-reduce SUM over the layer's group), for
    runs without a data-parallel wrapper over those ranks; do not combine that with such a wrapper
    (the wrapper would add them again). OverlapMoE's expert weights are never touched (complete).

    A collective: call it on every rank of every layer's group with the same ``data_parallel``,
    after backward (after gradient accumulation) and before gradient clipping and the optimizer
    step. Gradients are reduced in place (a DTensor gradient on its local shard); a parameter whose
    ``.grad`` is None on some ranks gets the sum on every rank, and stays None if it is None on
    every rank. Returns None."""
    if not isinstance(data_parallel, bool):
        raise ValueError(f"data_parallel={data_parallel!r}; must be True or False")
    blocks = [m for m in model.modules() if isinstance(m, OverlapTransformerBlock)]
    in_block = {id(b.mlp) for b in blocks}
    for m in model.modules():
        if isinstance(m, OverlapTransformerBlock):
            norms = [m.attn_norm.weight, m.attn_norm.bias, m.mlp_norm.weight, m.mlp_norm.bias]
            moe = [m.mlp.router_weight, m.mlp.shared_w_in, m.mlp.shared_w_out] if isinstance(m.mlp, OverlapMoE) else []
            _sum_over_group((norms if m.sequence_parallel else []) + moe, m.group)
        elif isinstance(m, OverlapMLP):
            if m.sequence_parallel and m.b_out is not None:
                _sum_over_group([m.b_out], m.group)
        elif isinstance(m, OverlapAttention):
            _sum_over_group([m.q_norm, m.k_norm] + ([m.bo] if m.sequence_parallel else []), m.group)
            if m.num_kv_heads < m.world_size:
                if _is_dtensor(m.wk):  # the DTensor form holds every head on every rank, zero outside its own
                    _sum_over_group([m.wk, m.wv, m.bk, m.bv], m.group)
                else:
                    _sum_kv_copies(m)
        elif isinstance(m, UlyssesAttention):
            if data_parallel:
                _sum_over_group(list(m.parameters(recurse=False)), m.group)
        elif isinstance(m, OverlapMoE):
            if data_parallel and id(m) not in in_block:
                _sum_over_group([m.router_weight, m.shared_w_in, m.shared_w_out], m.group)


#: Another name for :func:`finalize_grads`: the same function.
reduce_replicated_grads = finalize_grads
