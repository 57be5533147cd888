"""Swap the overlap layers into Hugging Face transformers (>= 5) models, in place.

Reference (what a swapped model must equal, up to rounding): the unswapped model, on every rank,
fed the same batch on every rank of the group -- logits, loss, and, when backward returns, every
parameter's gradient (the swapped layers' shards equal the matching slices of the dense
gradients, see their ``to_dense``; with DTensor parameters, the default, every parameter's and
gradient's ``full_tensor()`` is the dense one).

What is recognised: the families' table in :mod:`.hf_families` (each class with its spec,
:mod:`.hf_specs`), and whatever a plan describes by a spec; what replaces it: :mod:`.hf_build`,
generic over the specs; the replacement itself
(``plan``, the logging and warnings, everything built before anything is put in) is
:func:`.replace.replace_modules`, shared with the megatron-core swap.

Everything else (embeddings, norms outside decoder blocks, the LM head, rotary tables) stays as it
is and runs replicated; with DTensor parameters (``dtensor=True``, the default) its parameters are
``Replicate()`` DTensors it computes on through their local tensors ([Note: DTensor models] in
``integrations/dtensor.py``).
"""
from __future__ import annotations

import logging
from typing import Optional

from torch import nn

from ..config import OverlapConfig
from .dtensor import distribute_params
from .hf_adapters import HFAttention, HFBlock, HFMoE
from .hf_build import OURS, build, build_block, kind_by_type, lookalike_kind
from .hf_checkpoint import keep_save_pretrained
from .hf_families import known_specs
from .hf_sequence import check_sequence_args, decoder_stacks, shard_sequence
from .hf_specs import SPEC_KINDS
from .replace import (BLOCK_KINDS, KINDS, Unswappable, check_swap_args, group_of, on, parse_plan, replace_modules,
                      swap_place)

logger = logging.getLogger(__name__)

__all__ = ["swap", "KINDS", "BLOCK_KINDS", "Unswappable", "check_swap_args", "group_of", "on", "parse_plan",
           "replace_modules", "HFAttention", "HFBlock", "HFMoE"]


def swap(model: nn.Module, group=None, *, mesh=None, axis=None, plan: Optional[dict] = None,
         config: Optional[OverlapConfig] = None, block: bool = False, dtensor: bool = True,
         sequence_parallel: bool = False, attention: str = "overlap") -> nn.Module:
    """Replace, in place, the MLP / attention / MoE modules of a Hugging Face transformers (>= 5)
    model with the overlap layers over ``group`` (the tensor- and expert-parallel group; or
    ``mesh`` + ``axis``), carrying the weights; returns ``model``.

    Reference: the swapped model equals the unswapped one on every rank (logits, loss, and every
    gradient when backward returns), given **the same batch on every rank of the group**: the
    hidden states are replicated. Attention and MLP run tensor parallel on the full sequence
    (``sequence_parallel=False``, the default: replicated input, all-reduced output; see
    ``sequence_parallel=True`` below). An MoE block splits the
    tokens over the group, runs each rank's 1/ws share through ``OverlapMoE`` (expert parallel)
    and all-gathers the outputs, so no token is computed twice. See the table in :mod:`.hf_families`
    for what is recognised (by type, without a ``plan``), :mod:`.hf_build` for what replaces it, and
    :mod:`.hf_adapters` for the adapters' contracts
    (HF call signatures and return values; KV caches, so ``generate()`` works, and any SDPA mask:
    padding, packed sequences, sliding windows; with ``block=True`` causal masks only and no KV
    cache, and ``swap`` sets ``config.use_cache=False``).

    Parameters (``dtensor=True``, the default): every parameter of the swapped model is a DTensor
    on the tensor-parallel mesh axis (``mesh``'s ``axis``, or a 1-D mesh over ``group``'s ranks),
    whose ``full_tensor()`` is the dense model's parameter: the swapped layers' in their documented
    placements ([Note: DTensor parameters] in ``planning/dtensor.py``), every other one (embeddings,
    norms, LM head) ``Replicate()`` (:func:`overlap_layers.distribute_params`, [Note: DTensor
    models] in ``integrations/dtensor.py``). So the ordinary loop -- ``loss.backward()``,
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, ``optimizer.step()`` (any torch
    optimizer, foreach or fused) -- gives the dense model's result with no other call; FSDP2 over
    another axis of ``mesh`` composes, and DCP checkpoints reshard to other tensor-parallel sizes.
    ``dtensor=False`` keeps plain parameters (shards and replicas), for loops that handle tensor
    parallelism themselves (Megatron's); ``clip_grad_norm_`` then sees only each rank's shards.

    State dicts and checkpoints ([Note: swapped state dicts] in ``integrations/hf_state.py``):
    ``model.state_dict()`` has the unswapped model's keys, order and global shapes (DTensors whose
    ``full_tensor()`` is the unswapped tensor; with ``dtensor=False`` this rank's parts, tagged);
    ``load_state_dict`` takes the unswapped model's state dict or a swapped one's saved by this
    rank, and raises ValueError for another rank's or another world size's. So DCP checkpoints move
    between swapped and unswapped models and tensor-parallel sizes, ``model.save_pretrained(path)``
    (on every rank: ``swap`` gives the model one that gathers the tensors, :mod:`.hf_checkpoint`)
    writes the unswapped model's checkpoint, and
    :func:`~overlap_layers.integrations.load_pretrained_shards` loads one reading only each rank's
    part of each tensor.

    Gradients: complete when backward returns, on every rank (no ``finalize_grads`` call; it is a
    no-op here). The attention layers' per-rank partials (``q_norm`` / ``k_norm``, and the KV heads
    when ``num_key_value_heads`` < group size) and the MoE adapters' router gradient (the group's
    ranks hold the same tokens here, so that partial is a tensor-parallel one, which no
    data-parallel wrapper would sum) are summed over the group inside backward ([Note: gradients
    complete in backward] in ``layers/common/grads.py``); the norms, embeddings and LM head run
    replicated on full gradients; experts and the MLP / attention shards get complete shard
    gradients. Data parallelism goes across groups (a DP wrapper over the ranks that hold the
    same shard), as with any TP layer.

    ``plan``: a dict from module-name patterns (``fnmatch`` on the qualified name, e.g.
    ``"model.layers.*.mlp"``) to a kind (``"mlp"``, ``"attention"``, ``"moe"``; ``"block"`` with
    ``block=True``), to
    ``{"kind": ..., "num_tiles": ..., "config": OverlapConfig(...), "spec": ...}``, to a spec
    (:class:`~.hf_specs.MLPSpec`, ``AttentionSpec``, ``MoESpec``; ``BlockSpec`` with ``block=True``:
    the kind is the spec's), or to None (leave those modules). A spec describes the matched modules'
    weights and conventions (names of the projections, a fused qkv / gate_up, q/k norms and their
    weight convention, the activation, the router and experts, a shared expert and its gate, ...;
    :mod:`.hf_specs`), so a module of a class the library does not know is swapped from it, and a
    known class's own spec is overridden. The first matching pattern wins; only matched modules are
    replaced. A matched module without a spec must be of a recognised class of that kind (a known
    class of another kind raises ValueError, with a spec too; an unknown class is left, with a
    warning). ``config`` applies to every swapped layer unless a plan entry gives its own.

    Logging (``logging.getLogger("overlap_layers.integrations.hf")``, INFO): one line per kind
    with what was replaced and left. Warnings (``UserWarning``): recognised modules that cannot be
    replaced (unsupported activation, partial biases, qk-norm eps, router jitter, a group size that
    does not divide the heads/experts, ...) and modules whose class looks like an MLP / attention /
    MoE but is unknown -- never a silent half-swap.

    ``block=True``: each recognised decoder layer becomes one ``OverlapTransformerBlock`` (in an
    :class:`HFBlock`, holding its norms, attention and MLP / MoE; ``plan`` may map patterns to the
    kind ``"block"``); modules of decoder layers that cannot be swapped whole are then swapped one
    by one as without it. The block's MoE router gradient is summed inside backward, as
    ``HFMoE``'s is. Its sublayers still run one after the other (one tiled program across them is
    future work).
    ``sequence_parallel=True``: the hidden states between the decoder layers are sharded along the
    sequence over the group (each rank holds ``S/ws`` positions; norms and residual adds on the
    shards, attention and MLP with ``sequence_parallel=True``: all-gather in, reduce-scatter out;
    the final norm's output gathered before the LM head), with the same reference: the model still
    takes the same whole batch on every rank, and logits, loss and every gradient are the
    unswapped model's ([Note: HF sequence parallelism] in ``integrations/hf_sequence.py``). The
    norms' gradients are summed inside backward. Causal attention without a KV cache only
    (``config.use_cache`` is set False; a cache or another mask raises ValueError), and the
    sequence length must be divisible by the group size (ValueError otherwise).
    ``attention="ulysses"`` (with ``sequence_parallel=True``, ``block=False``): the attention
    modules become :class:`UlyssesAttention` (all-to-all of heads and sequence) instead of
    ``OverlapAttention``.
    Decisions depend only on the model's structure, so every rank of the group swaps alike.
    """
    check_swap_args(model, block, config, "a transformers model")
    check_sequence_args(sequence_parallel, attention, block)
    group, place = swap_place(model, group, mesh, axis, dtensor)
    rules = parse_plan(plan, block, SPEC_KINDS)
    known = known_specs()
    if not known and not any("spec" in r[2] for r in rules or ()):
        raise ValueError("no known transformers model classes could be imported; install transformers>=5 "
                         "(pip install 'overlap_layers[hf]')")
    stacks = decoder_stacks(model, lambda m: kind_by_type(m, known, BLOCK_KINDS) or isinstance(m, HFBlock)) \
        if sequence_parallel else None
    sp = {"sequence_parallel": True, "attention": attention} if sequence_parallel else {}

    # decoder layers first; the second pass swaps what the blocks left, module by module
    replaced = _swap_blocks(model, group, rules, config, place, known, sp) if block else {}
    done, already = _swap_modules(model, group, rules, config, place, known, block, sp)
    replaced.update({k: v for k, v in done.items() if v})
    if replaced.get("block"):
        _drop_kv_cache(model)
    distributed = dtensor and bool(any(replaced.values()) or already)
    shards = shard_sequence(stacks, group, OURS, distributed) if stacks else None
    if distributed:
        distribute_params(model, mesh=place, placement=shards.placement if shards else None)
        logger.info(f"overlap_layers.swap: every parameter is a DTensor on {place}")
    if any(replaced.values()):
        keep_save_pretrained(model)
    return model


# The two passes call replace_modules one frame further from the user than swap: stacklevel=5 points
# the warnings at swap's caller (overlap_layers.swap's), as a call from swap itself with 4 would.
def _swap_blocks(model, group, rules, config, place, known, sp: dict) -> dict:
    """``swap(..., block=True)``'s first pass: the recognised decoder layers, each into one block."""
    done, _ = replace_modules(
        model, group, None if rules is None else [r for r in rules if r[1] in BLOCK_KINDS + (None,)], config,
        kind_of=lambda m: kind_by_type(m, known, BLOCK_KINDS),
        lookalike=lambda m: lookalike_kind(m, BLOCK_KINDS),
        build=lambda module, kind, opts: build_block(module, group=place, known=known,
                                                     **_spec(module, opts, known, sp)),
        ours=OURS, nothing=None, kinds=BLOCK_KINDS, log=logger, stacklevel=5)
    return dict(done)


def _swap_modules(model, group, rules, config, place, known, block: bool, sp: dict) -> tuple:
    """``swap``'s module-by-module pass (MLP / attention / MoE): ``(replaced, already)``."""
    return replace_modules(
        model, group, None if rules is None else [r for r in rules if r[1] not in BLOCK_KINDS], config,
        kind_of=lambda m: kind_by_type(m, known, KINDS),
        lookalike=lambda m: lookalike_kind(m, KINDS),
        build=lambda module, kind, opts: build(module, kind, group=place, **_spec(module, opts, known, sp)), ours=OURS,
        nothing="no recognised decoder layer / MLP / attention / MoE module" if block else
        "no recognised MLP / attention / MoE module", log=logger, stacklevel=5)


def _spec(module, opts: dict, known: dict, sp: dict) -> dict:
    """``{"spec": the spec describing module, "opts": the builder's options}``: the spec is its plan
    rule's (taken out of the layer options ``opts``), else its class's; the options are the rest of
    ``opts`` with ``swap``'s sequence-parallel ones ``sp`` (read by the builders through
    :func:`.hf_sequence.sequence_options`)."""
    rest = dict(opts)
    spec = rest.pop("spec") if "spec" in rest else known[type(module)]
    return {"spec": spec, "opts": {**rest, **sp}}


def _drop_kv_cache(model) -> None:
    """``config.use_cache=False`` on every module with a config: the swapped blocks keep no KV cache."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "use_cache", False):
            cfg.use_cache = False
    logger.info("overlap_layers.swap: set config.use_cache=False (the swapped blocks keep no KV cache)")
