"""The gradients the parallel layers leave to the training loop: none of the tensor-parallel
ones, and, on request, the data-parallel style ones.

Reference: after backward, every parameter of a layer holds the gradient the dense layer gives
it on every rank (its shard of it, for a sharded parameter), except the *data-parallel style
partials* below; after ``finalize_grads(model, data_parallel=True)`` those hold the sum over the
layer's group as well. ``finalize_grads(model)`` (the default) changes nothing: a harmless no-op
kept for loops that call it.

[Note: which partials]
Two kinds of replicated parameter get a rank partial from a layer's backward:

* *TP partials*: the rank computed only part of a gradient that no other reduction sums (the
  ranks of a tensor-parallel group are not data-parallel peers of each other, so a DP wrapper
  built over the data-parallel dimension never reduces across them). The layers sum these over
  their group inside backward ([Note: gradients complete in backward] in
  ``layers/common/grads.py``), so backward returns them complete:

  ===================  =====================================================================
  layer                parameters (the rank's work covers)
  ===================  =====================================================================
  OverlapMLP           ``b_out`` under sequence parallelism (the rank's own rows)
  OverlapAttention     ``bo`` under sequence parallelism; ``q_norm``, ``k_norm`` (the rank's
                       query/KV heads); ``wk``, ``wv``, ``bk``, ``bv`` when ``num_kv_heads <
                       world_size`` (summed over the ranks sharing each KV head only)
  OverlapTransformer-  the norms' ``weight`` / ``bias`` under sequence parallelism (the rank's
  Block                positions); its OverlapMoE's ``router_weight``, ``shared_w_in``,
                       ``shared_w_out``, ``shared_gate`` in either mode: inside a block the
                       group is a tensor-parallel group over the same sequences, so the
                       rank's share of the tokens is a TP partial, not a DP-style one (below)
  HFMoE (swap)         its OverlapMoE's router and shared expert, for the same reason
  ===================  =====================================================================

* *DP-style partials*: the rank's gradient is that of its own tokens only, and the layer's group
  is the set of ranks a data-parallel reduction runs over anyway (Ulysses' sequence-parallel
  ranks and an expert-parallel group each hold different tokens, like DP replicas). DDP / FSDP /
  HSDP over those ranks sums (DDP: averages) them with every other parameter's gradient, so the
  layers leave them alone, and summing them as well would count them ``world_size`` times:

  ===================  =====================================================================
  UlyssesAttention     every parameter (``wq``, ``wk``, ``wv``, ``wo``, biases, ``q_norm``,
                       ``k_norm``): whole on every rank, gradient of the rank's own positions
  OverlapMoE           ``router_weight``, ``shared_w_in``, ``shared_w_out``, ``shared_gate``
                       of a bare MoE: gradient of the rank's own tokens (the experts ``w_in`` /
                       ``w_out`` are sharded and their gradients already hold every rank's
                       tokens routed to them: complete)
  ===================  =====================================================================

  ``finalize_grads(model, data_parallel=True)`` sums them (all-reduce SUM over the layer's
  group), for a run without a DP wrapper over those ranks. The sum is the gradient of the *sum*
  of the ranks' losses; DDP's average is that divided by the group size.

Every reduction is a collective over the layer's group whose membership and sizes come from the
module structure alone (identical on every rank), never from which gradients exist on this rank:
a parameter whose ``.grad`` is None on this rank contributes zeros and a presence flag travelling
in the same buffer, and its ``.grad`` is set on every rank if any rank had one (left None if no
rank had). One all-reduce per layer and parameter dtype; no host sync unless this rank lacks a
gradient (then one, to read the flags).
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .attention.ulysses import UlyssesAttention
from .common.grads import summed_in_backward
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


@torch.no_grad()
def finalize_grads(model: nn.Module, data_parallel: bool = False) -> None:
    """With ``data_parallel=True``, sum the data-parallel style partials of every overlap layer in
    ``model`` (``model`` itself included) over the layer's group (all-reduce SUM); by default do
    nothing. See [Note: which partials].

    The tensor-parallel partials (:class:`OverlapMLP` ``b_out`` and :class:`OverlapAttention`
    ``bo`` under sequence parallelism, ``q_norm`` / ``k_norm``, replicated KV heads, an
    :class:`OverlapTransformerBlock`'s norms and MoE router and shared expert, an ``HFMoE``'s
    router) are summed inside backward: there is nothing left to do for them, and this function
    never touches them. It remains for loops that call it, and for the data-parallel style
    partials: every parameter of :class:`UlyssesAttention`, and a bare :class:`OverlapMoE`'s
    ``router_weight``, ``shared_w_in``, ``shared_w_out`` (the gradient of the rank's own tokens,
    which a DDP / FSDP reduction over the same ranks sums). ``data_parallel=True`` sums these, for
    runs without a data-parallel wrapper over those ranks; do not combine that with such a wrapper
    (the wrapper would add them again). OverlapMoE's expert weights are never touched (complete).

    With ``data_parallel=True`` a collective: call it on every rank of every layer's group, after
    backward (after gradient accumulation) and before gradient clipping and the optimizer step.
    Gradients are reduced in place (a DTensor gradient on its local shard); a parameter whose
    ``.grad`` is None on some ranks gets the sum on every rank, and stays None if it is None on
    every rank. Returns None."""
    if not isinstance(data_parallel, bool):
        raise ValueError(f"data_parallel={data_parallel!r}; must be True or False")
    if not data_parallel:
        return
    for m in model.modules():
        if isinstance(m, UlyssesAttention):
            _sum_over_group(list(m.parameters(recurse=False)), m.group)
        elif isinstance(m, OverlapMoE):
            _sum_over_group([getattr(m, n) for n in m.replicated_params if not summed_in_backward(m, n)], m.group)


#: Another name for :func:`finalize_grads`: the same function.
reduce_replicated_grads = finalize_grads
