"""Adapters that let the overlap layers sit inside a Hugging Face transformers (>= 5) model.

Inside a swapped HF model the hidden states are *replicated* on every rank of the group
(``[batch, seq, hidden]``, the same on every rank), as they are in the unswapped model (with
``swap(..., sequence_parallel=True)``, each rank's positions: the subclasses in :mod:`.hf_sequence`). The
adapters keep the HF modules' call signatures and return contracts:

==========================  =====================================  ==========================================
adapter                     HF call it serves                      what it runs
==========================  =====================================  ==========================================
:class:`OverlapMLP` itself  ``mlp(x) -> y``                        ``sequence_parallel=False``: full x in, all-
                                                                   reduced y out (no adapter needed)
:class:`HFAttention`        ``self_attn(hidden_states=,            ``OverlapAttention(sequence_parallel=False)``
                            position_embeddings=(cos, sin),        on the full sequence with HF's (cos, sin);
                            attention_mask=, cache=, **kw)         returns ``(y, None)``
                            ``-> (y, attn_weights)``
:class:`HFMoE`              ``mlp(x) -> y`` (router logits are     split tokens -> ``OverlapMoE`` on this
                            recorded by HF's hooks on the router)  rank's 1/ws -> all-gather; router logits
                                                                   of the full tokens when HF records them
==========================  =====================================  ==========================================

The token split and gather around the MoE are :func:`overlap_layers.layers.moe.tokens.split_tokens`
and :func:`~overlap_layers.layers.moe.tokens.gather_tokens` (autograd both ways). The MoE's router
(and shared expert), used on this rank's tokens only, have their gradients summed over the group
inside backward ([Note: gradients complete in backward] in ``layers/common/grads.py``): a
replicated weight used on this rank's share of the tokens gets every rank's partial.

Router modules: HF's router (``gate``) keeps its weight tied to the layer's ``router_weight``.
With DTensor parameters (``swap``'s default) it computes on the weight's local tensor, as every
module outside the overlap layers does ([Note: DTensor models] in ``integrations/dtensor.py``).

[Note: HF attention mask]
OverlapAttention's planned call computes causal attention over whole sequences (SDPA
``is_causal``). HF builds one mask per forward and hands it to every attention module: ``None``
(SDPA without padding), a boolean ``[B, 1, S, keys]`` mask (True = attend) or an additive float
mask (0 / dtype min) for eager attention, a ``[B, S]`` padding mask for flash attention, or a
custom 4-D mask the caller passed (packed sequences: block-diagonal). A call without a KV cache
whose mask is None or *equals* the standard causal mask
(:func:`overlap_layers.layers.attention.common.is_causal_mask`, cached per mask tensor, so the
O(S^2) check runs once per forward) runs the planned, overlapped call. Any other mask (padding,
packed sequences, a sliding window shorter than the sequence), and every call with a KV cache
(``generate``), runs :meth:`OverlapAttention.attend`: the serial plan as plain torch ops, SDPA
under the mask (a 2-D padding mask becomes the causal band over the real keys, :func:`sdpa_mask`),
each rank keeping its own KV heads in the cache through HF's ``cache.update`` (dynamic, static and
sliding-window caches alike). Which of the two runs is a column of the layer's agreement, so ranks
that see different masks raise instead of mixing calls. Flash attention's varlen arguments
(``cu_seq_lens_*``) are rejected on every rank: packed sequences come to SDPA as a mask.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from ..layers import OverlapAttention, OverlapMoE, OverlapTransformerBlock
from ..layers.attention.common import derived_from_mask, is_causal_mask
from ..layers.common.grads import sum_grads_in_backward
from ..layers.moe.tokens import gather_tokens, split_tokens

_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens_q", "cu_seqlens_k")


# ---------------------------------------------------------------------------- attention
def call_problem(x, position_embeddings, kwargs) -> Optional[Exception]:
    """What an HF attention call asks that the swapped attention cannot do (the exception to
    raise), or None. The mask and the cache are served ([Note: HF attention mask])."""
    # a loop: torch 2.11's dynamo does not trace ``kwargs.keys() & tuple``
    packed = [k for k in _PACKED_KWARGS if kwargs.get(k) is not None]
    if packed:
        return ValueError(f"varlen arguments ({', '.join(packed)}) are flash-attention's: the swapped attention "
                          f"runs SDPA; use attn_implementation='sdpa' (packed sequences then come as a mask)")
    if position_embeddings is None:
        return ValueError("position_embeddings=(cos, sin) is required (HF's decoder layers pass them); the "
                          "swapped attention never computes its own RoPE tables")
    return None


def reject(layer: OverlapAttention, x, position_embeddings, problem: Exception, source: str) -> None:
    """Raise ``problem`` on every rank, not only this one: the layer is handed a mask it rejects,
    so the rejection travels through its agreement ([Note: agreement]) to every rank."""
    try:
        layer(x, position_embeddings=position_embeddings, attention_mask=True)
    except ValueError as e:
        raise type(problem)(f"{source} (swapped by overlap_layers.swap): {problem}") from e
    raise AssertionError("the layer accepted a rejected input")  # pragma: no cover


def _band(mask: torch.Tensor, q_len: int) -> torch.Tensor:
    keys = mask.shape[1]
    band = torch.ones(q_len, keys, dtype=torch.bool, device=mask.device).tril(keys - q_len)
    return band & mask.bool()[:, None, None, :]


def sdpa_mask(mask, q_len: int) -> Optional[torch.Tensor]:
    """HF's mask as SDPA takes it for :meth:`OverlapAttention.attend`: a 4-D mask as it is; a 2-D
    ``[batch, keys]`` padding mask (1 = a real token; flash attention's form) as the causal band
    of the last ``q_len`` queries over those keys, padded keys masked, made once per forward (kept
    on the mask HF hands every layer: ``derived_from_mask``); None stays None (causal)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return mask
    return derived_from_mask(mask, "sdpa_band", (q_len,), _band)


def _cache_update(cache, layer_idx, position_embeddings, cache_position, k, v):
    """HF's ``cache.update`` for this layer (its keyword arguments as HF's attention modules pass them)."""
    cos, sin = position_embeddings
    return cache.update(k, v, layer_idx, {"sin": sin, "cos": cos, "cache_position": cache_position})


class HFAttention(nn.Module):
    """An HF attention module's stand-in: ``OverlapAttention(sequence_parallel=False)`` over the
    group, with HF's call signature and return contract.

    ``forward(hidden_states, position_embeddings=(cos, sin), attention_mask=None, cache=None,
    **kwargs) -> (attn_output, None)``: ``hidden_states [batch, seq, hidden]`` replicated on every
    rank; ``(cos, sin)`` ``[batch or 1, seq, head_dim]`` as HF's rotary embedding computed them (so
    every RoPE variant HF implements, Llama 3 scaling included, is exact); the output is the full
    ``[batch, seq, hidden]`` on every rank. Attention weights are never materialised (like HF's SDPA
    path, which also returns None). A causal call without a cache runs the layer's planned call; a
    call with a KV cache (``generate``) or another mask (padding, packed sequences, a sliding
    window) runs :meth:`OverlapAttention.attend`, each rank caching its own KV heads. Rejected on
    every rank: flash-attention's varlen arguments and missing ``position_embeddings``
    (``ValueError``); see [Note: HF attention mask].
    """

    def __init__(self, layer: OverlapAttention, *, layer_idx=None, sliding_window: Optional[int] = None,
                 source: str = ""):
        super().__init__()
        self.layer = layer
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.head_dim = layer.head_dim
        self.is_causal = True
        self.source = source  # the HF class this replaced (for messages)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, past_key_value=None, **kwargs):
        if cache is None:
            cache = past_key_values if past_key_values is not None else past_key_value
        problem = call_problem(hidden_states, position_embeddings, kwargs)
        if problem is not None:
            reject(self.layer, hidden_states, position_embeddings, problem, self.source or "attention")
        S = hidden_states.shape[1] if hidden_states.dim() == 3 else 0
        if cache is None and (attention_mask is None or is_causal_mask(attention_mask, S)):
            return self.layer(hidden_states, position_embeddings=position_embeddings), None
        update = None if cache is None else functools.partial(_cache_update, cache, self.layer_idx,
                                                              position_embeddings, kwargs.get("cache_position"))
        return self.layer.attend(hidden_states, position_embeddings=position_embeddings,
                                 attention_mask=sdpa_mask(attention_mask, S), kv_update=update), None

    def to_dense(self) -> dict:
        """The dense weights (:meth:`OverlapAttention.to_dense`); a collective."""
        return self.layer.to_dense()

    def extra_repr(self) -> str:
        return f"source={self.source}, layer_idx={self.layer_idx}, sliding_window={self.sliding_window}"


# ---------------------------------------------------------------------------- decoder layer
class HFBlock(nn.Module):
    """An HF decoder layer's stand-in (``swap(..., block=True)``): an
    :class:`OverlapTransformerBlock` without sequence parallelism, with the decoder layer's call
    signature ``forward(hidden_states, attention_mask=None, position_ids=None, cache=None,
    use_cache=False, position_embeddings=None, **kwargs) -> hidden_states``.

    ``hidden_states [batch, seq, hidden]`` replicated on every rank, as in the unswapped model;
    the output is the full tensor on every rank. The calls :class:`HFAttention` rejects are
    rejected here alike, on every rank.

    Router logits (an MoE block): ``gate`` is HF's router module, its weight tied to the block's
    ``router_weight`` (by :func:`tie_router`, once ``swap`` accepts the replacement). When HF
    records router logits the adapter runs the block's steps itself and
    calls ``gate`` on the full normed tokens between them, so HF records the dense model's logits.
    Gradients: the routing's part of the router's gradient (this rank's share of the tokens) is
    summed over the group inside backward by the block; the logits' part is computed from the
    replicated tokens, complete on every rank as it is.
    """

    #: HF's ``gradient_checkpointing_enable()`` sets this (and ``_gradient_checkpointing_func``) on
    #: every module that has the attribute: the block is then checkpointed as a decoder layer is.
    gradient_checkpointing = False

    def __init__(self, block: OverlapTransformerBlock, gate: Optional[nn.Module] = None, *, layer_idx=None,
                 sliding_window: Optional[int] = None, source: str = ""):
        super().__init__()
        self.block, self.gate = block, gate
        self.layer_idx, self.sliding_window, self.source = layer_idx, sliding_window, source

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # as HF's decoder layers do ([Note: recompute] keeps the recomputation's plans)
            return self._gradient_checkpointing_func(functools.partial(self._forward, **kwargs), hidden_states)
        return self._forward(hidden_states, **kwargs)

    def _forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                 use_cache=False, position_embeddings=None, past_key_values=None, past_key_value=None, **kwargs):
        cache = next((c for c in (cache, past_key_values, past_key_value) if c is not None), None)
        problem = call_problem(hidden_states, position_embeddings, kwargs) or (NotImplementedError(
            "a KV cache was passed (use_cache=True / generate()): swap(block=True) keeps no KV cache; swap with "
            "block=False to generate") if cache is not None else None)
        if problem is not None:
            reject(self.block.attention, hidden_states, position_embeddings, problem, self.source or "decoder layer")
        gate = self.gate
        if not records_router(gate):
            return self.block(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask)
        blk = self.block  # the block's forward, with HF's router recorded on the full tokens
        h = hidden_states + blk.attention(blk.attn_norm(hidden_states), position_embeddings=position_embeddings,
                                          attention_mask=attention_mask)
        z = blk.mlp_norm(h)
        gate(z.reshape(-1, z.shape[-1]))  # recorded by HF's hooks
        return h + blk._mlp(z)

    def to_dense(self) -> dict:
        """The block's dense weights (:meth:`OverlapTransformerBlock.to_dense`); a collective."""
        return self.block.to_dense()

    def extra_repr(self) -> str:
        return f"source={self.source}, layer_idx={self.layer_idx}, sliding_window={self.sliding_window}"


# ---------------------------------------------------------------------------- MoE
def tie_router(gate: Optional[nn.Module], layer: OverlapMoE) -> None:
    """HF's router module ``gate`` holds ``layer``'s tensors: its ``weight`` is
    ``layer.router_weight`` (one parameter) and, where the layer has one, its
    ``e_score_correction_bias`` the layer's buffer (DeepSeek-V3); no-op without a gate. Called once
    the replacement is accepted: the router is still the replaced module's, which a refused
    replacement leaves holding its own tensors."""
    if gate is None:
        return
    gate.weight = layer.router_weight
    if layer.e_score_correction_bias is not None:
        gate.e_score_correction_bias = layer.e_score_correction_bias


def records_router(gate: Optional[nn.Module]) -> bool:
    """Whether HF records ``gate``'s router logits in this forward (transformers 5:
    ``output_router_logits``; its recorder hooks the router modules), so an adapter must call it."""
    if gate is None or not (gate._forward_hooks or gate._forward_pre_hooks):
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
        collected = _active_collector.get()
    except Exception:  # noqa: BLE001 - internals moved: fall back to "a hook is installed"
        return True
    return bool(collected) and "router_logits" in collected


class HFMoE(nn.Module):
    """An HF sparse-MoE block's stand-in: ``OverlapMoE`` over the group (expert parallel), with
    HF's call signature ``forward(hidden_states) -> hidden_states``.

    The input ``[batch, seq, hidden]`` is replicated on every rank; each rank routes and sends
    only its share of the tokens (:func:`overlap_layers.layers.moe.tokens.token_bounds`) through
    ``OverlapMoE`` and the outputs are
    all-gathered, so no token is computed twice and the output is the full tensor on every rank.
    Gradients: the input's gradient is the full one on every rank; the router weight is used on
    this rank's tokens only, so the adapter has the layer sum its gradient over the group *inside
    backward* (:func:`~overlap_layers.layers.common.grads.sum_grads_in_backward`): after backward
    ``layer.router_weight.grad`` is complete, unlike a bare :class:`OverlapMoE`'s (it is never
    reduced again: ``finalize_grads(data_parallel=True)`` skips it). Expert gradients are complete
    by construction (every rank's tokens reach the experts).

    Router logits: ``gate`` is HF's own router module, its weight tied to
    ``layer.router_weight`` (by :func:`tie_router`, once ``swap`` accepts the replacement). When
    HF records router logits (``output_router_logits=True``, for its
    load-balancing loss) the adapter calls ``gate`` on the full tokens, so HF's hooks record the
    same ``[tokens, experts]`` logits as the dense model and the aux-loss gradient reaches the
    router (already complete on every rank: computed from the replicated tokens).
    """

    def __init__(self, layer: OverlapMoE, gate: Optional[nn.Module] = None, *, source: str = ""):
        super().__init__()
        self.layer = layer
        self.gate = gate
        self.source = source
        sum_grads_in_backward(layer, layer.replicated_params)

    @property
    def group(self):
        return self.layer.group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, S, H = hidden_states.shape
        x_TH = hidden_states.reshape(B * S, H)
        if records_router(self.gate):
            self.gate(x_TH)  # recorded by HF's hooks; the routing itself runs inside the layer
        y_tH = self.layer(split_tokens(x_TH, self.group).unsqueeze(0))
        return gather_tokens(y_tH.squeeze(0), self.group, B * S).view(B, S, H)

    def to_dense(self) -> dict:
        """The dense weights (:meth:`OverlapMoE.to_dense`); a collective."""
        return self.layer.to_dense()

    def extra_repr(self) -> str:
        return f"source={self.source}"
