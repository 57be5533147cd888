"""Adapters that let the overlap layers sit inside a Hugging Face transformers (>= 5) model.

Inside a swapped HF model the hidden states are *replicated* on every rank of the group
(``[batch, seq, hidden]``, the same on every rank), as they are in the unswapped model. The
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
OverlapAttention computes causal attention over whole sequences (SDPA ``is_causal``). HF builds
one mask per forward and hands it to every attention module: ``None`` (SDPA without padding),
a boolean ``[B, 1, S, S]`` mask (True = attend) or an additive float mask (0 / dtype min) for
eager attention, a ``[B, S]`` padding mask for flash attention, or a flex ``BlockMask``. The
adapter hands the mask to the layer, which accepts ``None``, a 4-D mask that *equals* the standard
causal mask (boolean, or additive with 0 where allowed and <= finfo.min/2 or -inf elsewhere) and a
2-D mask without padding (:func:`overlap_layers.layers.attention.common.is_causal_mask`); anything
else (padding, packed sequences) is a ValueError on every rank (the check is part of the layer's
agreement, so a rank that sees a different mask cannot hang the others). The adapter itself
rejects sliding windows shorter than the sequence and a KV cache, on every rank too. The verdict
is cached per mask tensor, so the O(S^2) check runs once per forward, not once per layer. Under
``torch.compile`` the mask enters the layer's opaque op and is checked there, eagerly (tracing
cannot branch on its values).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from ..layers import OverlapAttention, OverlapMoE, OverlapTransformerBlock
from ..layers.common.grads import sum_grads_in_backward
from ..layers.moe.tokens import gather_tokens, split_tokens

_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens_q", "cu_seqlens_k")


# ---------------------------------------------------------------------------- attention
def call_problem(x, position_embeddings, cache, kwargs, sliding_window) -> Optional[Exception]:
    """What an HF attention call asks that the swapped attention cannot do (the exception to
    raise), or None. The mask is the layer's to check ([Note: HF attention mask])."""
    if cache is not None:
        return NotImplementedError(
            "a KV cache was passed (use_cache=True / generate()): the swapped attention keeps no KV cache. "
            "Run the swapped model with use_cache=False (swap sets config.use_cache=False); generate with "
            "the dense model")
    packed = [k for k in _PACKED_KWARGS if kwargs.get(k) is not None]
    if packed:
        return ValueError(f"packed sequences ({', '.join(packed)}) are not supported: OverlapAttention is causal "
                          f"over whole sequences; pass unpacked, unpadded batches")
    if position_embeddings is None:
        return ValueError("position_embeddings=(cos, sin) is required (HF's decoder layers pass them); the "
                          "swapped attention never computes its own RoPE tables")
    S = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 3 else 0
    if sliding_window is not None and S > sliding_window:
        return ValueError(f"sequence length {S} exceeds the sliding window {sliding_window}: the swapped "
                          f"attention is plain causal; use sequences of at most {sliding_window} tokens")
    return None  # the mask goes to the layer, which accepts only one equal to the causal mask


def reject(layer: OverlapAttention, x, position_embeddings, problem: Exception, source: str) -> None:
    """Raise ``problem`` on every rank, not only this one: the layer is handed a mask it rejects,
    so the rejection travels through its agreement ([Note: agreement]) to every rank."""
    try:
        layer(x, position_embeddings=position_embeddings, attention_mask=True)
    except ValueError as e:
        raise type(problem)(f"{source} (swapped by overlap_layers.swap): {problem}") from e
    raise AssertionError("the layer accepted a rejected input")  # pragma: no cover


class HFAttention(nn.Module):
    """An HF attention module's stand-in: ``OverlapAttention(sequence_parallel=False)`` over the
    group, with HF's call signature and return contract.

    ``forward(hidden_states, position_embeddings=(cos, sin), attention_mask=None, cache=None,
    **kwargs) -> (attn_output, None)``: ``hidden_states [batch, seq, hidden]`` replicated on every
    rank; ``(cos, sin)`` ``[batch or 1, seq, head_dim]`` as HF's rotary embedding computed them (so
    every RoPE variant HF implements, Llama 3 scaling included, is exact); the output is the full
    ``[batch, seq, hidden]`` on every rank. Attention weights are never materialised (like HF's SDPA
    path, which also returns None). ``position_ids`` and ``use_cache`` are accepted and ignored.
    Rejected on every rank: a KV cache (``NotImplementedError``: no generation; ``swap`` sets
    ``config.use_cache=False``), a mask that is not the causal one, packed sequences, a sequence
    longer than the sliding window, missing ``position_embeddings`` (``ValueError``); see
    [Note: HF attention mask].
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
        cache = next((c for c in (cache, past_key_values, past_key_value) if c is not None), None)
        problem = call_problem(hidden_states, position_embeddings, cache, kwargs, self.sliding_window)
        if problem is not None:
            reject(self.layer, hidden_states, position_embeddings, problem, self.source or "attention")
        return self.layer(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask), None

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
    ``router_weight``. When HF records router logits the adapter runs the block's steps itself and
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
        problem = call_problem(hidden_states, position_embeddings, cache, kwargs, self.sliding_window)
        if problem is not None:
            reject(self.block.attention, hidden_states, position_embeddings, problem, self.source or "decoder layer")
        gate = self.gate
        if gate is None or not (gate._forward_hooks or gate._forward_pre_hooks) or not _router_logits_recorded():
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
def _router_logits_recorded() -> bool:
    """Whether HF's output capture is recording router logits in this forward (transformers 5:
    ``output_router_logits``; the recorder hooks the router modules)."""
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
    ``layer.router_weight``. When HF records router logits (``output_router_logits=True``, for its
    load-balancing loss) the adapter calls ``gate`` on the full tokens, so HF's hooks record the
    same ``[tokens, experts]`` logits as the dense model and the aux-loss gradient reaches the
    router (already complete on every rank: computed from the replicated tokens).
    """

    def __init__(self, layer: OverlapMoE, gate: Optional[nn.Module] = None, *, source: str = ""):
        super().__init__()
        self.layer = layer
        if gate is not None:
            gate.weight = layer.router_weight  # tied: one parameter
        self.gate = gate
        self.source = source
        sum_grads_in_backward(layer, ("router_weight", "shared_w_in", "shared_w_out"))

    @property
    def group(self):
        return self.layer.group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, S, H = hidden_states.shape
        x_TH = hidden_states.reshape(B * S, H)
        if self.gate is not None and (self.gate._forward_hooks or self.gate._forward_pre_hooks) \
                and _router_logits_recorded():
            self.gate(x_TH)  # recorded by HF's hooks; the routing itself runs inside the layer
        y_tH = self.layer(split_tokens(x_TH, self.group).unsqueeze(0))
        return gather_tokens(y_tH.squeeze(0), self.group, B * S).view(B, S, H)

    def to_dense(self) -> dict:
        """The dense weights (:meth:`OverlapMoE.to_dense`); a collective."""
        return self.layer.to_dense()

    def extra_repr(self) -> str:
        return f"source={self.source}"
