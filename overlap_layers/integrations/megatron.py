"""Swap the overlap layers into megatron-core (0.16) GPT models, in place.

Reference (what a swapped model must equal, up to rounding): the unswapped Megatron model on
the same ranks and inputs -- its outputs, and every parameter's gradient after the sequence-
parallel reduction Megatron's finalize_model_grads does for the unswapped model, with no call
after backward for the swapped one (see [Note: Megatron gradients]); the swapped layers' shards
equal the matching slices of the dense gradients (their ``to_dense``), and ``to_dense()`` of a
swapped layer equals :func:`megatron_dense` of the module it replaced.

What is recognised, what replaces it, and what is left with a warning: the table in
:mod:`.megatron_build`. How the weights are carried: [Note: Megatron weights] and [Note: Megatron
gradients] in :mod:`.megatron_weights`; the adapters' layout and RoPE: [Note: Megatron layout in
the hot path] and [Note: Megatron RoPE] in :mod:`.megatron_adapters`.

[Note: Megatron DTensor parameters]
``swap(..., dtensor=True)`` (the default) makes every parameter of the model a DTensor on the
tensor-parallel mesh axis (:func:`overlap_layers.distribute_params`, [Note: DTensor models] in
``integrations/dtensor.py``): ours in the layers' placements; Megatron's tensor-parallel shards
outside the swapped layers (``VocabParallelEmbedding``, the output ``ColumnParallelLinear``:
``tensor_model_parallel`` with a tensor-parallel group of more than one rank, which must be the
swap's group) ``Shard(partition_dim)``, whose ``full_tensor()`` is the concatenation of
Megatron's shards; every other one ``Replicate()``, and a parameter tagged ``sequence_parallel``
(a norm under sequence parallelism) reads its local tensor through an identity that sums its
gradient over the group inside backward (its tag is cleared). Megatron's modules compute on the
local tensors, exactly as before; a model sharing its embedding with its output layer hands the
output layer the embedding's local tensor. The ordinary torch loop (``backward``,
``torch.nn.utils.clip_grad_norm_``, a torch optimizer) then gives the dense model's result.
Megatron's own ``DistributedDataParallel``, distributed optimizer and distributed checkpointing
take plain tensors: use ``dtensor=False`` with them.

Swap the bare model, before Megatron's ``DistributedDataParallel`` / ``Float16Module`` and the
optimizer are built (they capture parameters). Megatron's distributed checkpointing does not know
the swapped layers: save dense weights (``to_dense``) or the unswapped model. Activation
recomputation re-runs the swapped layers' forward (collectives included) on every rank; untested.
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Optional

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ..config import OverlapConfig
from .dtensor import distribute_params, local_arguments
from .megatron_adapters import MegatronAttention, MegatronBlock, MegatronMLP
from .megatron_build import (BUILDERS, OURS, block_kind, block_lookalike, build_block, check_groups, kind_by_type,
                             known_classes, lookalike_kind)
from .megatron_weights import megatron_classes, megatron_dense
from .replace import check_swap_args, parse_plan, replace_modules, swap_place

logger = logging.getLogger(__name__)

__all__ = ["swap", "is_megatron_model", "megatron_dense", "MegatronAttention", "MegatronBlock", "MegatronMLP"]


def is_megatron_model(model) -> bool:
    """Whether ``model`` contains a megatron-core module (megatron is never imported here: a
    Megatron model can only exist if it already was)."""
    mod = sys.modules.get("megatron.core.transformer.module")
    if mod is None or not isinstance(model, nn.Module):
        return False
    base = getattr(mod, "MegatronModule", None)
    return base is not None and any(isinstance(m, base) for m in model.modules())


def swap(model: nn.Module, group=None, *, mesh=None, axis=None, plan: Optional[dict] = None,
         config: Optional[OverlapConfig] = None, block: bool = False, dtensor: bool = True) -> nn.Module:
    """Replace, in place, the ``MLP`` and ``SelfAttention`` modules of a megatron-core (0.16) GPT
    model (local spec) with the overlap layers over ``group`` (or ``mesh`` + ``axis``), carrying
    the weights; returns ``model``. See the module docstring for what is recognised, how the
    weights are carried ([Note: Megatron weights]: ``group`` must be Megatron's TP group when its
    TP > 1) and how the gradients are complete when backward returns ([Note: Megatron
    gradients]).

    ``plan`` and ``config`` work as in the Hugging Face swap (patterns on qualified names such as
    ``"decoder.layers.*.mlp"``; kinds ``"mlp"`` and ``"attention"``, and ``"block"`` with
    ``block=True``). ``block=True``: each ``TransformerLayer`` that is exactly a pre-norm block
    (see :class:`MegatronBlock`) becomes one ``OverlapTransformerBlock``; the modules of the
    others are then swapped one by one. Logging
    (``logging.getLogger("overlap_layers.integrations.megatron")``, INFO): one line per kind.
    Warnings (``UserWarning``) for recognised modules that cannot be replaced and for unknown
    MLP / attention / MoE look-alikes (Megatron's MoELayer, MLA, Transformer Engine modules).
    Every replacement is built before the first is put in, so an error leaves the model as it was.
    A collective over Megatron's TP group (the weights are gathered): call it on every rank.

    ``dtensor=True`` (the default): every parameter of the model becomes a DTensor on the
    tensor-parallel mesh axis ([Note: Megatron DTensor parameters]), so the ordinary torch loop
    (``backward``, ``clip_grad_norm_``, any torch optimizer) gives the dense model's result.
    ``dtensor=False`` keeps plain tensors with Megatron's attributes, for Megatron's own training
    loop (its DDP, ``finalize_model_grads``, distributed optimizer and grad clipping)."""
    check_swap_args(model, block, config, "a megatron-core model")
    group, place = swap_place(model, group, mesh, axis, dtensor)
    rules = parse_plan(plan, block)
    M = megatron_classes()
    known = known_classes(M)
    before_build = functools.partial(check_groups, group=group)
    if block:  # TransformerLayers first; the second pass swaps what the blocks left, module by module
        replace_modules(model, group, None if rules is None else [r for r in rules if r[1] in ("block", None)],
                        config, kind_of=lambda m: block_kind(m, M), lookalike=block_lookalike,
                        build=lambda module, kind, opts: build_block(module, place, opts, M), ours=OURS,
                        nothing=None, before_build=before_build, kinds=("block",), log=logger)
    replaced, already = replace_modules(
        model, group, None if rules is None else [r for r in rules if r[1] != "block"], config,
        kind_of=lambda m: kind_by_type(m, known), lookalike=lookalike_kind,
        build=lambda module, kind, opts: BUILDERS[kind](module, place, opts, M), ours=OURS,
        nothing="no recognised megatron-core TransformerLayer / MLP / SelfAttention" if block else
        "no recognised megatron-core MLP / SelfAttention", before_build=before_build,
        kinds=("mlp", "attention"), log=logger)
    swapped = any(replaced.values()) or already or any(isinstance(m, MegatronBlock) for m in model.modules())
    if dtensor and swapped:
        _distribute(model, place)
    return model


def _distribute(model: nn.Module, place) -> None:
    """[Note: Megatron DTensor parameters]: every parameter a DTensor on ``place``."""
    distribute_params(model, mesh=place, placement=_placement(place))
    for m in model.modules():  # GPTModel hands the shared embedding weight to its output layer
        if getattr(m, "share_embeddings_and_output_weights", False) and hasattr(m, "output_layer"):
            local_arguments(m.output_layer, ("weight",))
    logger.info(f"overlap_layers.swap: every parameter is a DTensor on {place}")


def _placement(mesh):
    """[Note: Megatron DTensor parameters]: the placement of a Megatron parameter outside the
    swapped layers, and whether its gradient is summed inside backward."""
    ranks = mesh.mesh.flatten().tolist()

    def placement(module, name, p):
        tp = getattr(module, "tp_group", None)
        if getattr(p, "tensor_model_parallel", False) and tp is not None and dist.get_world_size(tp) > 1:
            if list(dist.get_process_group_ranks(tp)) != ranks:
                raise ValueError(f"{type(module).__name__}.{name} is sharded over Megatron's tensor-parallel group "
                                 f"{list(dist.get_process_group_ranks(tp))}, not the swap's group {ranks}")
            return Shard(p.partition_dim), False
        if getattr(p, "sequence_parallel", False):  # a norm under sequence parallelism: the rank's positions
            p.sequence_parallel = False  # summed inside backward: not by Megatron's finalize_model_grads again
            return Replicate(), True
        return Replicate(), False
    return placement
