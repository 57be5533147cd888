"""Sequence parallelism in swapped Hugging Face models (``swap(..., sequence_parallel=True)``), and
Ulysses attention as the swapped attention (``swap(..., sequence_parallel=True, attention="ulysses")``).

Reference: the unswapped model fed the same batch on every rank of the group -- logits, loss, and,
when backward returns, every parameter's full gradient (norms, embeddings and LM head included) --
as for :func:`.hf.swap`; only the layout of the hidden states between the decoder layers differs.

[Note: HF sequence parallelism]
Inside the decoder layers each rank holds its ``S/ws`` positions of the hidden states (rank r:
``r*S/ws ..``), as torchtitan's ``SequenceParallel`` lays them out:

==============================  ===================================================================
where                           hidden states
==============================  ===================================================================
embeddings, position ids,       the full ``[B, S, H]`` on every rank: HF derives the position ids,
mask, rotary (cos, sin)         the mask and the rotary tables from it, so they describe the whole
                                sequence, which the attention needs (it sees every position)
the first decoder layer's       split along the sequence (:func:`split_sequence`: forward this
input                           rank's positions, backward the all-gathered gradient, so the
                                embedding's gradient is the full one on every rank)
inside every decoder layer      the rank's positions: norms and residual adds on the shard;
                                ``OverlapAttention`` / ``OverlapMLP`` with ``sequence_parallel=True``
                                (all-gather in, reduce-scatter out), or ``UlyssesAttention``
                                (all-to-all heads / sequence); an MoE (:class:`HFSequenceMoE`) routes
                                the shard's tokens as they are (already this rank's share: no split)
the final norm's output         all-gathered along the sequence (:func:`gather_sequence`: backward
                                this rank's positions of the replicated gradient) before the LM
                                head, so logits and loss are the full ones on every rank
==============================  ===================================================================

Gradients, complete when backward returns ([Note: gradients complete in backward] in
``layers/common/grads.py``): the norms' weights (each decoder layer's and the final norm; replicated)
see only the rank's positions, so their gradients are summed over the group inside backward: with
DTensor parameters through the ``complete`` flag of [Note: DTensor models] (``integrations/dtensor.py``;
:meth:`SequenceShards.placement`), with plain ones through this module's hooks. ``UlyssesAttention``'s
parameters (whole on every rank, each rank's gradient covering its positions) are summed likewise.
A module of a decoder layer that is not swapped (left by the plan, or warned as unswappable) runs
replicated: its input all-gathered, its output split, so its parameters' gradients are complete
as they are.

Rules (every rank raises the same ValueError, as every rank holds the same batch):

* The sequence length must be divisible by the group size. Right-pad the batch to a multiple with
  labels -100: causal attention lets no real token see the padding after it.
* Causal attention only: a mask that is not the causal one (padding, packed sequences, a sliding
  window shorter than the sequence) is rejected (the rank's shard cannot be masked by ``attend``).
* No KV cache: ``swap`` sets ``config.use_cache=False``, and a call with a cache
  (``use_cache=True``, ``generate()``) is rejected; generate with a model swapped without
  ``sequence_parallel``.
* ``output_hidden_states=True`` records the decoder layers' outputs as they are: this rank's shards.

Ulysses attention (``attention="ulysses"``, sequence parallelism only; not with ``block=True``,
whose block runs ``OverlapAttention``): every swapped attention becomes :class:`UlyssesAttention`
(whole weights on every rank; GQA, qk-norm, biases, dropout as :class:`OverlapAttention`; the
heads need only divide by the group size, where ``OverlapAttention`` also needs the KV heads to
divide it or be divided by it). One it refuses (query heads the group size does not divide) is
left, with a warning, and runs replicated as above.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..layers.attention.common import PARAMS, is_causal_mask
from ..layers.attention.ulysses import UlyssesAttention
from ..layers.common.grads import sum_grad_over_group, sum_grads_in_backward
from ..layers.moe.tokens import gather_tokens, split_tokens
from .hf_adapters import HFAttention, HFBlock, HFMoE, call_problem, records_router, reject

logger = logging.getLogger(__package__ + ".hf")

ATTENTION_TARGETS = ("overlap", "ulysses")


def check_sequence_args(sequence_parallel, attention, block: bool) -> None:
    """``swap``'s ``sequence_parallel`` and ``attention`` (ValueError otherwise)."""
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel={sequence_parallel!r}; must be True or False")
    if attention not in ATTENTION_TARGETS:
        raise ValueError(f"attention={attention!r}; valid: {', '.join(map(repr, ATTENTION_TARGETS))}")
    if attention == "ulysses" and not sequence_parallel:
        raise ValueError("attention='ulysses' needs sequence_parallel=True (UlyssesAttention takes each rank's "
                         "positions of the sequence)")
    if attention == "ulysses" and block:
        raise ValueError("attention='ulysses' with block=True: the block runs OverlapAttention; swap with "
                         "block=False for Ulysses attention")


def sequence_options(opts: dict) -> tuple:
    """``(sequence_parallel, attention, the other options)`` of a builder's options (``swap``
    adds the first two to the layers' options under sequence parallelism)."""
    rest = dict(opts)
    return bool(rest.pop("sequence_parallel", False)), rest.pop("attention", "overlap"), rest


# ---------------------------------------------------------------------------- the sequence split
def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's positions of the replicated ``x [B, S, ...]``: ``[B, S/ws, ...]``; backward
    all-gathers the gradient (:func:`~overlap_layers.layers.moe.tokens.split_tokens` along the
    sequence). ValueError where ``S`` is not divisible by the group size."""
    ws = dist.get_world_size(group)
    if x.shape[1] % ws:
        raise ValueError(f"swap(sequence_parallel=True): the sequence length {x.shape[1]} is not divisible by the "
                         f"group size {ws}; right-pad the batch to a multiple of {ws} (labels -100: causal "
                         f"attention lets no real token see the padding)")
    return split_tokens(x.transpose(0, 1), group).transpose(0, 1)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's positions ``x [B, S/ws, ...]`` all-gathered to ``[B, S, ...]``; backward takes
    this rank's positions of the (replicated) gradient (:func:`~overlap_layers.layers.moe.tokens.gather_tokens`)."""
    n = x.shape[1] * dist.get_world_size(group)
    return gather_tokens(x.transpose(0, 1), group, n).transpose(0, 1)


class _Group:
    """The group, for the hooks; a deep copy of the model shares it (as the layers share theirs)."""

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self

    def split_input(self, module, args, kwargs):
        """Forward pre-hook (with kwargs): the hidden states (first argument) split along the sequence."""
        if args:
            return (split_sequence(args[0], self.group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": split_sequence(kwargs["hidden_states"], self.group)}

    def gather_input(self, module, args, kwargs):
        """Forward pre-hook (with kwargs): the hidden states (first argument) all-gathered."""
        if args:
            return (gather_sequence(args[0], self.group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather_sequence(kwargs["hidden_states"], self.group)}

    def gather_output(self, module, args, output):
        """Forward hook: the output all-gathered along the sequence."""
        return gather_sequence(output, self.group)

    def split_output(self, module, args, output):
        """Forward hook: the output (or a tuple's first element) split along the sequence."""
        if isinstance(output, tuple):
            return (split_sequence(output[0], self.group), *output[1:])
        return split_sequence(output, self.group)

    def summed_in(self, module, args):
        """Forward pre-hook: the module's plain parameters through an identity whose gradient is
        summed over the group inside backward, for the call (restored by :meth:`summed_out`)."""
        saved = {}
        if torch.is_grad_enabled():
            for name, p in module._parameters.items():
                if p is not None and p.requires_grad and not isinstance(p, DTensor):
                    saved[name] = p
                    module._parameters[name] = sum_grad_over_group(p, self.group)
        module._sequence_saved.append(saved)

    def summed_out(self, module, args, output):
        """Forward hook (always called): the parameters back in place."""
        if module._sequence_saved:
            module._parameters.update(module._sequence_saved.pop())


# ---------------------------------------------------------------------------- the decoder stacks
class SequenceShards(NamedTuple):
    """What runs on the sequence shards of a model under sequence parallelism with replicated parameters."""

    partial: list  # the modules whose parameters see the rank's positions only: the norms

    def placement(self, module: nn.Module, name: str, p: torch.Tensor) -> tuple:
        """``distribute_params``'s placement: Replicate, summed inside backward for the norms."""
        return Replicate(), any(module is m for m in self.partial)


def _replicated_swap(module: nn.Module) -> bool:
    """Whether ``module`` is an adapter or layer of a swap without sequence parallelism."""
    if isinstance(module, (HFAttention, HFMoE, HFBlock)):
        return not isinstance(module, (HFSequenceAttention, HFSequenceMoE, HFSequenceBlock))
    return getattr(module, "sequence_parallel", True) is False


def decoder_stacks(model: nn.Module, is_layer) -> list:
    """The modules of ``model`` holding ``layers`` (an ``nn.ModuleList`` of decoder layers, each
    ``is_layer``) and ``norm`` (the final norm): HF's ``LlamaModel`` and its kin. ValueError where
    there is none (sequence parallelism starts at the first decoder layer and ends at the final norm)
    and where a decoder layer holds modules swapped without sequence parallelism."""
    stacks = [m for m in model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleList)
              and len(m.layers) and isinstance(getattr(m, "norm", None), nn.Module)
              and all(is_layer(layer) for layer in m.layers)]
    if not stacks:
        raise ValueError("swap(sequence_parallel=True): no decoder stack found (a module with `layers`, an "
                         "nn.ModuleList of recognised decoder layers, and a final `norm`, as LlamaModel has)")
    for stack in stacks:
        if any(_replicated_swap(m) for m in stack.layers.modules()):
            raise ValueError("swap(sequence_parallel=True): the model was swapped without sequence parallelism "
                             "already; swap the unswapped model")
    return stacks


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def shard_sequence(stacks: list, group, ours: tuple, dtensor: bool) -> SequenceShards:
    """Put the hooks of [Note: HF sequence parallelism] on ``stacks`` (swapped already; once per
    stack): the first decoder layer's input split, the final norm's output gathered, each
    unswapped module of a decoder layer run replicated, the norms' gradients summed (here with
    plain parameters; ``placement`` where ``dtensor``: the model's parameters are made DTensors
    next); the stacks' configs get ``use_cache=False``."""
    g = _Group(group)
    partial, replicated = [], []
    for stack in stacks:
        if getattr(stack, "_sequence_sharded", False):  # swapped with sequence parallelism before
            continue
        stack._sequence_sharded = True
        stack.layers[0].register_forward_pre_hook(g.split_input, with_kwargs=True)
        stack.norm.register_forward_hook(g.gather_output)
        partial.append(stack.norm)
        for layer in stack.layers:
            if isinstance(layer, HFBlock):  # its block runs on the shard, norms summed inside
                continue
            for name, child in layer.named_children():
                if isinstance(child, ours) or isinstance(child, nn.Dropout):
                    continue
                if _is_norm(child):
                    partial.append(child)
                else:
                    child.register_forward_pre_hook(g.gather_input, with_kwargs=True)
                    child.register_forward_hook(g.split_output)
                    replicated.append(type(child).__name__)
        cfg = getattr(stack, "config", None)
        if getattr(cfg, "use_cache", False):
            cfg.use_cache = False
    if not dtensor:
        for norm in partial:
            norm._sequence_saved = []
            norm.register_forward_pre_hook(g.summed_in)
            norm.register_forward_hook(g.summed_out, always_call=True)
    ulysses = sum(isinstance(m, UlyssesAttention) for s in stacks for m in s.modules())
    logger.info(f"overlap_layers.swap: sequence parallel over {dist.get_world_size(group)} ranks: "
                f"{sum(len(s.layers) for s in stacks)} decoder layer(s) on sequence shards"
                + (f" (attention: UlyssesAttention x{ulysses})" if ulysses else "")
                + f", {len(partial)} norm(s) with gradients summed inside backward, config.use_cache=False"
                + (f"; run replicated (gathered in, split out): "
                   f"{', '.join(f'{c} x{n}' for c, n in Counter(replicated).items())}" if replicated else ""))
    return SequenceShards(partial)


# ---------------------------------------------------------------------------- adapters
def sequence_problem(layer, hidden_states, position_embeddings, attention_mask, cache, kwargs) -> Optional[Exception]:
    """What an HF attention call under sequence parallelism asks that the swapped attention
    cannot do (the exception to raise), or None: :func:`.hf_adapters.call_problem`'s, a KV cache,
    a mask other than the causal one over the whole sequence."""
    problem = call_problem(hidden_states, position_embeddings, kwargs)
    if problem is not None:
        return problem
    if cache is not None:
        return ValueError("a KV cache was passed (use_cache=True / generate()): swap(sequence_parallel=True) keeps "
                          "no KV cache; generate with a model swapped without sequence_parallel")
    S = hidden_states.shape[1] * layer.world_size if hidden_states.dim() == 3 else 0
    if attention_mask is not None and not is_causal_mask(attention_mask, S):
        return ValueError("an attention mask other than the causal one (padding, packed sequences, a sliding "
                          "window shorter than the sequence): swap(sequence_parallel=True) runs causal "
                          "attention only; right-pad with labels -100 instead of masking")
    return None


def _cache_of(cache, past_key_values, past_key_value):
    return next((c for c in (cache, past_key_values, past_key_value) if c is not None), None)


class HFSequenceAttention(HFAttention):
    """An HF attention module's stand-in under sequence parallelism: ``OverlapAttention(
    sequence_parallel=True)`` or ``UlyssesAttention`` over the group, with HF's call signature;
    equals the unswapped module on the whole sequence, shard by shard.

    ``forward(hidden_states [B, S/ws, H] (this rank's positions), position_embeddings=(cos, sin)
    of the whole sequence, attention_mask=None or the causal mask, **kwargs) -> (y [B, S/ws, H],
    None)``. Rejected on every rank (ValueError): a KV cache, any other mask, and what
    :class:`HFAttention` rejects ([Note: HF sequence parallelism])."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, past_key_value=None, **kwargs):
        problem = sequence_problem(self.layer, hidden_states, position_embeddings, attention_mask,
                                   _cache_of(cache, past_key_values, past_key_value), kwargs)
        if problem is not None:
            reject(self.layer, hidden_states, position_embeddings, problem, self.source or "attention")
        return self.layer(hidden_states, position_embeddings=position_embeddings), None


class HFSequenceMoE(HFMoE):
    """An HF sparse-MoE block's stand-in under sequence parallelism: ``OverlapMoE`` on this rank's
    positions ``[B, S/ws, H]`` as they are (already the rank's share of the tokens), output
    likewise; equals the unswapped block token by token. The router's gradient is summed inside
    backward as :class:`HFMoE`'s. Router logits, when HF records them, are the gate's on the
    all-gathered tokens (the dense model's ``[B*S, experts]``; backward: this rank's positions)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, s, H = hidden_states.shape
        if records_router(self.gate):
            self.gate(gather_sequence(hidden_states, self.group).reshape(-1, H))  # recorded by HF's hooks
        return self.layer(hidden_states.reshape(1, B * s, H)).view(B, s, H)


class HFSequenceBlock(HFBlock):
    """An HF decoder layer's stand-in (``block=True``) under sequence parallelism: an
    ``OverlapTransformerBlock(sequence_parallel=True)`` on this rank's positions, with the decoder
    layer's call signature; rejects what :class:`HFSequenceAttention` rejects. Router logits, when
    HF records them, are the gate's on the all-gathered normed tokens."""

    def _forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                 use_cache=False, position_embeddings=None, past_key_values=None, past_key_value=None, **kwargs):
        blk = self.block
        problem = sequence_problem(blk.attention, hidden_states, position_embeddings, attention_mask,
                                   _cache_of(cache, past_key_values, past_key_value), kwargs)
        if problem is not None:
            reject(blk.attention, hidden_states, position_embeddings, problem, self.source or "decoder layer")
        gate = self.gate
        if not records_router(gate):
            return blk(hidden_states, position_embeddings=position_embeddings)
        blk._sum_grads_in_backward()  # the norms' partials, as the block's own call sets them
        h = hidden_states + blk.attention(blk.attn_norm(hidden_states), position_embeddings=position_embeddings)
        z = blk.mlp_norm(h)
        gate(gather_sequence(z, blk.group).reshape(-1, z.shape[-1]))  # recorded by HF's hooks
        return h + blk._mlp(z)


def ulysses_attention(dense: dict, place: dict, opts: dict) -> UlyssesAttention:
    """``UlyssesAttention.from_dense(**dense)`` on ``place`` (``group=`` or ``mesh=``), its
    parameters' gradients summed over the group inside backward (each rank's covers its
    positions). Its ValueError (heads the group does not divide) leaves the module, warned."""
    layer = UlyssesAttention.from_dense(**dense, **place, **opts)
    sum_grads_in_backward(layer, PARAMS)
    return layer
