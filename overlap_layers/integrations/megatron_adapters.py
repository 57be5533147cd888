"""The adapters that let the overlap layers sit inside a megatron-core model: Megatron's call
signatures and return contracts around :class:`OverlapMLP` (:class:`MegatronMLP`),
:class:`OverlapAttention` (:class:`MegatronAttention`) and :class:`OverlapTransformerBlock`
(:class:`MegatronBlock`).

[Note: Megatron layout in the hot path]
Megatron passes ``[seq, batch, hidden]`` and expects ``(output, bias)``. :class:`MegatronMLP` views
the input as ``[1, seq*batch, hidden]`` (the MLP is row-wise and, under sequence parallelism, a
rank's rows stay its own): no copy. :class:`MegatronAttention` hands ``x.transpose(0, 1)`` (a view)
to :class:`OverlapAttention`, which makes its batch-major rows contiguous: one copy of the input
when ``batch > 1`` (none when ``batch == 1``); the output is returned as a transposed view.
Both return ``(output, None)``: the output bias is added inside (Megatron's bias-dropout-add
accepts ``bias=None``).

[Note: Megatron RoPE]
Megatron hands every layer ``rotary_pos_emb`` = freqs ``[S, 1 or b, 1, rot_dim]`` (or a ``(q, k)``
pair) for the global sequence and applies ``t*cos(freqs)*m + rotate_half(t)*sin(freqs)*m`` with
``m`` the YaRN concentration factor (1 otherwise), after the q/k layernorm. Non-interleaved
freqs are ``cat(f, f)`` -- exactly our rotate-half convention -- so the adapter passes
``(cos(freqs)*m, sin(freqs)*m)`` as ``position_embeddings``. Refused: ``rotary_interleaved``
(at swap time), a partial rotary dimension (``rot_dim < head_dim``) or different q/k freqs (at
run time, on every rank). ``no_rope_freq`` layers get no RoPE, as in Megatron.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from ..layers import OverlapAttention, OverlapMLP, OverlapTransformerBlock
from ..layers.attention.common import is_causal_mask


class MegatronMLP(nn.Module):
    """A megatron-core ``MLP``'s stand-in: :class:`OverlapMLP` over the group, with Megatron's call
    signature ``forward(hidden_states [s, b, h], **kwargs) -> (output [s, b, h], None)``.

    ``hidden_states`` is the replicated ``[s, b, h]``, or with sequence parallelism this rank's
    ``[s/tp, b, h]`` (positions ``r*s/tp ..``); it is viewed as ``[1, s*b, h]`` (no copy, see
    [Note: Megatron layout in the hot path]). ``b_out`` is added inside, so the bias returned is
    None. ``padding_mask`` (MoE routing only) is accepted and ignored; ``per_token_scale`` (experts
    only) raises ``ValueError``.
    """

    def __init__(self, layer: OverlapMLP, *, source: str = ""):
        super().__init__()
        self.layer = layer
        self.source = source

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise ValueError(f"{self.source or 'MLP'} (swapped by overlap_layers.swap): per_token_scale is for MoE "
                             f"experts; the swapped MLP is a dense one")
        x = hidden_states
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            s, b, h = x.shape
            return self.layer(x.reshape(1, s * b, h)).view(s, b, h), None
        return self.layer(x), None  # the layer's agreement raises its input error on every rank

    def to_dense(self) -> dict:
        """The dense weights (:meth:`OverlapMLP.to_dense`); a collective."""
        return self.layer.to_dense()

    def extra_repr(self) -> str:
        return f"source={self.source}"


class _RopeTables:
    """Megatron's ``rotary_pos_emb`` freqs -> our ``(cos, sin)`` ([Note: Megatron RoPE]), cached for
    the last freqs tensor seen (Megatron hands one to every layer)."""

    def __init__(self, mscale: float):
        self.mscale = float(mscale)
        self._last: Optional[tuple] = None  # (weakref to freqs, version, (cos, sin))

    def __call__(self, freqs: torch.Tensor):
        last = self._last
        if last is not None and last[0]() is freqs and last[1] == freqs._version:
            return last[2]
        f = freqs[:, :, 0, :].transpose(0, 1)  # [S, b', 1, d] -> [b', S, d]
        cs = (torch.cos(f) * self.mscale, torch.sin(f) * self.mscale)
        self._last = (weakref.ref(freqs), freqs._version, cs)
        return cs


def _attention_problem(layer: OverlapAttention, x, attention_mask, key_value_states, inference_context,
                       rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, attention_bias,
                       packed_seq_params) -> Optional[Exception]:
    """What a Megatron self-attention call asks that ``layer`` cannot do (the exception), or None."""
    if inference_context is not None or any(t is not None for t in (rotary_pos_cos, rotary_pos_sin,
                                                                    rotary_pos_cos_sin)):
        return NotImplementedError("an inference context / precomputed rotary cos-sin was passed: the swapped "
                                   "attention keeps no KV cache; run inference with the unswapped model")
    if key_value_states is not None:
        return ValueError("key_value_states was passed: the swapped attention is self-attention only")
    if packed_seq_params is not None:
        return ValueError("packed_seq_params (THD packed sequences) are not supported: the swapped attention is "
                          "causal over whole sequences")
    if attention_bias is not None:
        return ValueError("attention_bias is not supported by the swapped attention")
    S = x.shape[0] * (layer.world_size if layer.sequence_parallel else 1) \
        if isinstance(x, torch.Tensor) and x.dim() == 3 else 0
    if not is_causal_mask(attention_mask, S, masked_is_true=True):  # Megatron's boolean form
        return ValueError("attention_mask is not Megatron's causal mask (padding, reset position ids / EOD "
                          "masks): the swapped attention supports causal attention over whole sequences only")
    if rotary_pos_emb is not None and S:  # (a malformed x: the layer's own check reports it)
        q, k = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
        if q is not k and not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                               and q.shape == k.shape and torch.equal(q, k)):
            return ValueError("rotary_pos_emb has different query and key freqs; the swapped attention applies "
                              "one RoPE to both")
        if not (isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] == S and q.shape[2] == 1
                and q.shape[1] in (1, x.shape[1])):
            return ValueError(f"rotary_pos_emb must be Megatron's freqs [seq {S}, 1 or batch, 1, dim]; got "
                              f"{tuple(getattr(q, 'shape', ()))}")
        if q.shape[-1] != layer.head_dim:
            return ValueError(f"partial rotary embedding (rotary dim {q.shape[-1]} < head dim "
                              f"{layer.head_dim}, rotary_percent < 1) cannot be mapped exactly to the "
                              f"swapped attention's RoPE")
    return None


def _reject(layer: OverlapAttention, x, problem: Exception, source: str) -> None:
    """Raise ``problem`` on every rank, not only this one: a mask the layer rejects carries the
    rejection through its agreement to every rank (as HFAttention does)."""
    try:
        layer(x, attention_mask=True)
    except ValueError as e:
        raise type(problem)(f"{source} (swapped by overlap_layers.swap): {problem}") from e
    raise AssertionError("the layer accepted a rejected input")  # pragma: no cover


def _seq_first(x):
    """``[s, b, h]`` as the ``[b, s, h]`` view the layers take (a malformed x passes unchanged)."""
    return x.transpose(0, 1) if isinstance(x, torch.Tensor) and x.dim() == 3 else x


class _RopeAdapter(nn.Module):
    """What :class:`MegatronAttention` and :class:`MegatronBlock` share: the layer number, whether
    the layer skips RoPE, the RoPE tables made from Megatron's freqs, and the source module name."""

    def __init__(self, *, layer_number: int, no_rope: bool, mscale: float, source: str):
        super().__init__()
        self.layer_number, self.no_rope, self.source = layer_number, bool(no_rope), source
        self.rope = _RopeTables(mscale)

    def _cos_sin(self, rotary_pos_emb):
        """Our ``position_embeddings`` for Megatron's ``rotary_pos_emb`` (None: no RoPE)."""
        if rotary_pos_emb is None:
            return None
        return self.rope(rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb)

    def extra_repr(self) -> str:
        return f"source={self.source}, layer_number={self.layer_number}, no_rope={self.no_rope}"


class MegatronAttention(_RopeAdapter):
    """A megatron-core ``SelfAttention``'s stand-in: :class:`OverlapAttention` over the group, with
    Megatron's call signature ``forward(hidden_states [s, b, h], attention_mask=None, ...,
    rotary_pos_emb=None, ...) -> (output [s, b, h], None)``.

    ``hidden_states`` is replicated, or this rank's ``[s/tp, b, h]`` with sequence parallelism.
    ``attention_mask``: None or Megatron's causal mask (boolean, True = masked out, ``[.., S, S]``).
    ``rotary_pos_emb``: Megatron's freqs, mapped exactly to our RoPE ([Note: Megatron RoPE]).
    Rejected on every rank: other masks (padding, EOD resets), ``packed_seq_params``,
    ``attention_bias``, ``key_value_states`` (``ValueError``); an inference context or
    ``rotary_pos_cos``/``sin`` (``NotImplementedError``: no KV cache). Output bias added inside.
    """

    def __init__(self, layer: OverlapAttention, *, layer_number: int = 1, no_rope: bool = False,
                 mscale: float = 1.0, source: str = ""):
        super().__init__(layer_number=layer_number, no_rope=no_rope, mscale=mscale, source=source)
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                rotary_pos_cos_sin=None, attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None):
        inference_context = inference_context if inference_context is not None else inference_params
        if self.no_rope:
            rotary_pos_emb = None
        problem = _attention_problem(self.layer, hidden_states, attention_mask, key_value_states, inference_context,
                                     rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                     attention_bias, packed_seq_params)
        x = _seq_first(hidden_states)
        if problem is not None:
            _reject(self.layer, x, problem, self.source or "SelfAttention")
        return self.layer(x, position_embeddings=self._cos_sin(rotary_pos_emb)).transpose(0, 1), None

    def to_dense(self) -> dict:
        """The dense weights (:meth:`OverlapAttention.to_dense`); a collective."""
        return self.layer.to_dense()


class MegatronBlock(_RopeAdapter):
    """A megatron-core ``TransformerLayer``'s stand-in (``swap(..., block=True)``): an
    :class:`OverlapTransformerBlock` run in Megatron's layout, with its call signature
    ``forward(hidden_states [s, b, h], attention_mask=None, ..., rotary_pos_emb=None, ...) ->
    (output [s, b, h], context)``.

    The block's steps in sequence-first order, as :class:`MegatronAttention` and
    :class:`MegatronMLP` take them ([Note: Megatron layout in the hot path]): the norms run on
    ``[s, b, h]`` rows, the attention on the transposed view, the MLP on the ``[1, s*b, h]`` view.
    Swapped only where Megatron's layer is exactly that block: no cross-attention, no hidden
    dropout (``hidden_dropout=0``: Megatron's bias-dropout-add is then a plain residual add), no
    residual after the layernorm, no fp32 residual, torch LayerNorm / RMSNorm norms. Under sequence
    parallelism the norms' gradients are summed over the group inside backward, so their
    ``sequence_parallel`` attribute is false ([Note: Megatron gradients]). Rejected calls: as
    :class:`MegatronAttention`, and ``context`` / ``padding_mask``.
    """

    def __init__(self, block: OverlapTransformerBlock, *, layer_number: int = 1, no_rope: bool = False,
                 mscale: float = 1.0, source: str = ""):
        super().__init__(layer_number=layer_number, no_rope=no_rope, mscale=mscale, source=source)
        self.block = block

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, inference_context=None, packed_seq_params=None, sequence_len_offset=None,
                padding_mask=None, *, inference_params=None, **kwargs):
        inference_context = inference_context if inference_context is not None else inference_params
        blk = self.block
        if self.no_rope:
            rotary_pos_emb = None
        problem = _attention_problem(blk.attention, hidden_states, attention_mask, None, inference_context,
                                     rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                     attention_bias, packed_seq_params)
        if problem is None and (context is not None or padding_mask is not None):
            problem = ValueError("context (cross-attention) / padding_mask were passed: the swapped layer is a "
                                 "causal self-attention block")
        if problem is not None:
            _reject(blk.attention, _seq_first(blk.attn_norm(hidden_states)), problem, self.source or "TransformerLayer")
        if not (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3):
            blk.attention(hidden_states)  # its agreement raises the input error on every rank
        s, b, h = hidden_states.shape
        x = hidden_states + blk.attention(_seq_first(blk.attn_norm(hidden_states)),
                                          position_embeddings=self._cos_sin(rotary_pos_emb)).transpose(0, 1)
        return x + blk.mlp(blk.mlp_norm(x).reshape(1, s * b, h)).view(s, b, h), context

    def to_dense(self) -> dict:
        """The block's dense weights (:meth:`OverlapTransformerBlock.to_dense`); a collective."""
        return self.block.to_dense()

