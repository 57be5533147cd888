"""Swap the overlap layers into megatron-core (0.16) GPT models, in place.

Reference (what a swapped model must equal, up to rounding): the unswapped Megatron model on
the same ranks and inputs -- its outputs, and every parameter's gradient after the sequence-
parallel reduction Megatron's finalize_model_grads does for the unswapped model, with no call
after backward for the swapped one (see [Note: Megatron gradients]); the swapped layers' shards
equal the matching slices of the dense gradients (their ``to_dense``), and ``to_dense()`` of a
swapped layer equals :func:`megatron_dense` of the module it replaced.

=====================================================  ==============================================
megatron-core module (local spec)                      replaced by
=====================================================  ==============================================
``MLP`` (not an expert): ``linear_fc1``                :class:`MegatronMLP` around :class:`OverlapMLP`
ColumnParallelLinear, ``linear_fc2`` RowParallelLinear  (swiglu = ``gated_linear_unit`` + silu; gelu
                                                       / relu without gating; biases when
                                                       ``add_bias_linear``)
``SelfAttention``: ``linear_qkv`` ColumnParallelLinear  :class:`MegatronAttention` around
(interleaved per query group), ``DotProductAttention``  :class:`OverlapAttention` (GQA, causal, RoPE
core, ``linear_proj`` RowParallelLinear                from Megatron's ``rotary_pos_emb``; biases when
                                                       ``add_bias_linear``)
with ``block=True``: ``TransformerLayer`` (torch        :class:`MegatronBlock` around
LayerNorm / RMSNorm, no cross-attention, no hidden     :class:`OverlapTransformerBlock`: the two above
dropout)                                               and the layer's norms
=====================================================  ==============================================

Megatron's ``config.sequence_parallel`` (with a tensor-parallel size > 1) maps to
``sequence_parallel=True``: the input ``[s/tp, b, h]`` is rank r's positions ``r*s/tp ..``, as
our layers expect. Everything else (embeddings, norms, the output layer, the rotary module, MoE
layers) stays as it is. Not swapped, left with a warning: Transformer Engine linears (which may
fuse the layernorm), experts / MoE, q/k layernorm, interleaved or partial RoPE, sliding windows,
non-vanilla softmax, an attention output gate, context parallelism, ``num_query_groups`` smaller
than the group, GLU variants other than swiglu, clamped activations, Megatron's fused (tanh) gelu.

[Note: Megatron weights]
Megatron's TP weights are shards over *its* tensor-parallel group (``linear.tp_group``). ``swap``
gathers them over that group into dense ``nn.Linear``-layout weights (:func:`megatron_dense`; a
collective over Megatron's TP group, which every rank runs as it walks the same model) and builds
our layers with ``from_dense`` over ``group``. Two set-ups are supported:

* Megatron TP = tp > 1: ``group`` must hold exactly the ranks of Megatron's TP group, in the same
  order (else ``ValueError``); each rank then holds the same rows as before (no weight moves
  between ranks; the gather is only how ``from_dense`` is fed). Our parameters get Megatron's
  tensor-parallel attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``)
  copied from the parameters they replace, so Megatron's grad-norm clipping treats them like the
  originals; ``sequence_parallel`` is false on them ([Note: Megatron gradients]).
* Megatron TP = 1 (full weights on every rank) and ``group`` any group: the replicated weights are
  sharded over ``group``; the ranks of ``group`` must be fed the same batch (the hidden states are
  replicated over ``group``, as in the Hugging Face swap). Megatron knows nothing of ``group``:
  its data-parallel wrapper must not average over ranks of ``group`` (they hold different
  shards), and its grad-norm clipping sees only local shards (use the DTensor parameters and
  ``torch.nn.utils.clip_grad_norm_``). No Megatron attributes are set.

Layouts: the gathered ``linear_fc1`` is ``[gate_0; up_0; gate_1; up_1; ..]`` (per Megatron rank,
``stride=2``), de-interleaved into gate rows then up rows; the gathered ``linear_qkv`` is, per
query group g, ``[q heads of g (np/ng of them); k_g; v_g]``, split into ``wq``, ``wk``, ``wv``.

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

[Note: Megatron gradients]
The swapped parameters whose rank computes only part of the gradient -- the output biases under
sequence parallelism (``b_out``, ``bo``: the rank's own rows) and a swapped block's norms under
sequence parallelism, like Megatron's own row-parallel biases and norms -- are summed over the
group inside backward ([Note: gradients complete in backward] in ``layers/common/grads.py``):
their gradients are complete when backward returns, and they carry ``sequence_parallel=False``,
so Megatron's ``finalize_model_grads`` (which sums parameters tagged ``sequence_parallel``) does
not sum them again. (q/k norms and KV heads replicated over the group are refused at swap.)
Megatron's own parameters keep their tags with ``dtensor=False``: its ``finalize_model_grads``
sums its norms as before. With DTensor parameters (the default) they are summed inside backward
too ([Note: Megatron DTensor parameters]).

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

import logging
import sys
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ..config import OverlapConfig
from ..layers import OverlapAttention, OverlapMLP, OverlapTransformerBlock
from ..layers.attention.common import is_causal_mask
from ..runtime import resolve_group
from .dtensor import distribute_params, local_arguments, tp_mesh
from .hf import Unswappable, check_swap_args, group_of, on, parse_plan, replace_modules

logger = logging.getLogger(__name__)

_LOOKALIKE_SUFFIXES = {"mlp": ("MLP", "FeedForward", "FFN"), "attention": ("Attention",),
                       "moe": ("MoELayer", "MoE", "Experts")}
_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel")


def is_megatron_model(model) -> bool:
    """Whether ``model`` contains a megatron-core module (megatron is never imported here: a
    Megatron model can only exist if it already was)."""
    mod = sys.modules.get("megatron.core.transformer.module")
    if mod is None or not isinstance(model, nn.Module):
        return False
    base = getattr(mod, "MegatronModule", None)
    return base is not None and any(isinstance(m, base) for m in model.modules())


def _megatron():
    """The megatron-core classes swap recognises (imported on use)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer
    return dict(ColumnParallelLinear=ColumnParallelLinear, RowParallelLinear=RowParallelLinear, MLP=MLP,
                SelfAttention=SelfAttention, DotProductAttention=DotProductAttention, AttnMaskType=AttnMaskType,
                IdentityOp=IdentityOp, TransformerLayer=TransformerLayer)


# ---------------------------------------------------------------------------- dense weights
def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``t`` of ``group`` along ``dim`` (a collective when ws > 1)."""
    t = t.detach()
    if group is None or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _opt(t, get):
    """``get(t)`` detached, or None where ``t`` (a parameter) or ``get(t)`` (e.g. its grad) is None."""
    v = get(t) if t is not None else None
    return v.detach() if v is not None else None


def _mlp_dense(module, get) -> dict:
    fc1, fc2 = module.linear_fc1, module.linear_fc2
    g, ws = fc1.tp_group, dist.get_world_size(fc1.tp_group)

    def fc1_rows(t):
        full = _gather(t, g, 0)
        if not module.config.gated_linear_unit:
            return full
        per = full.view(ws, 2, -1, *full.shape[1:])  # [gate_r; up_r] per Megatron rank (stride 2)
        return torch.cat([per[:, 0].reshape(-1, *full.shape[1:]), per[:, 1].reshape(-1, *full.shape[1:])])

    b_in = _opt(fc1.bias, get)
    return {"w_in": fc1_rows(get(fc1.weight)), "w_out": _gather(get(fc2.weight), fc2.tp_group, 1),
            "b_in": fc1_rows(b_in) if b_in is not None else None,
            "b_out": _opt(fc2.bias, get)}


def _attention_dense(module, get) -> dict:
    cfg, qkv, proj = module.config, module.linear_qkv, module.linear_proj
    nq, ng, d = cfg.num_attention_heads, cfg.num_query_groups, module.hidden_size_per_attention_head
    per = nq // ng

    def split(t):  # per query group [q (per heads); k; v] -> wq, wk, wv
        full = _gather(t, qkv.tp_group, 0)
        v = full.view(ng, per + 2, d, *full.shape[1:])
        rest = full.shape[1:]
        return (v[:, :per].reshape(nq * d, *rest), v[:, per].reshape(ng * d, *rest),
                v[:, per + 1].reshape(ng * d, *rest))

    wq, wk, wv = split(get(qkv.weight))
    bq = bk = bv = None
    if qkv.bias is not None:
        bq, bk, bv = split(get(qkv.bias))
    return {"wq": wq, "wk": wk, "wv": wv, "wo": _gather(get(proj.weight), proj.tp_group, 1),
            "bq": bq, "bk": bk, "bv": bv, "bo": _opt(proj.bias, get),
            "q_norm": None, "k_norm": None}


def megatron_dense(module, get=None) -> dict:
    """The dense weights of a megatron-core ``MLP`` or ``SelfAttention`` under the names
    :meth:`OverlapMLP.from_dense` / :meth:`OverlapAttention.from_dense` take (``w_in`` = gate rows
    then up rows; ``wq``, ``wk``, ``wv`` de-interleaved; None where absent), gathered over
    Megatron's tensor-parallel group: a collective, every rank of that group must call it.
    ``get(param)`` picks the tensor of each parameter (default: the parameter; e.g.
    ``lambda p: p.grad`` gives the dense gradients)."""
    get = get or (lambda p: p)
    M = _megatron()
    if type(module) is M["MLP"]:
        return _mlp_dense(module, get)
    if type(module) is M["SelfAttention"]:
        return _attention_dense(module, get)
    raise ValueError(f"module={type(module).__name__}: must be a megatron-core MLP or SelfAttention")


def _copy_tp_attrs(src: Optional[torch.Tensor], dst: Optional[torch.Tensor]) -> None:
    """Megatron's tensor-parallel attributes of ``src`` onto ``dst``, but ``sequence_parallel``
    false: our parameters' gradients are complete when backward returns ([Note: Megatron
    gradients]), so Megatron's ``finalize_model_grads`` must not sum them again."""
    if src is None or dst is None:
        return
    for a in _TP_ATTRS:
        if hasattr(src, a):
            setattr(dst, a, False if a == "sequence_parallel" else getattr(src, a))


# ---------------------------------------------------------------------------- adapters
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


# ---------------------------------------------------------------------------- builders
def _linears(module, names, M):
    out = []
    for name, want in names:
        lin = getattr(module, name, None)
        if type(lin) is not M[want]:
            raise Unswappable(f"{name} is {type(lin).__name__}, not megatron-core's {want} (only the local spec's "
                               f"linears are swapped; Transformer Engine linears, which may fuse the layernorm, "
                               f"are not)")
        if getattr(lin, "is_expert", False):
            raise Unswappable(f"{name} is an expert linear (MoE)")
        if getattr(lin, "weight", None) is None:
            raise Unswappable(f"{name} has no weight of its own (skip_weight_param_allocation)")
        out.append(lin)
    return out


def _check_plain(tensors) -> None:
    for t in tensors:
        if t is not None and type(t) not in (nn.Parameter, torch.Tensor):
            raise Unswappable(f"weights are {type(t).__name__}s; swap a model with plain tensors")


def _activation(cfg) -> str:
    f = cfg.activation_func
    if getattr(cfg, "use_te_activation_func", False):
        raise Unswappable("use_te_activation_func=True (Transformer Engine activation)")
    if getattr(cfg, "activation_func_clamp_value", None) is not None:
        raise Unswappable(f"activation_func_clamp_value={cfg.activation_func_clamp_value} (clamped GLU)")
    if cfg.gated_linear_unit:
        if getattr(cfg, "glu_linear_offset", 0.0):
            raise Unswappable(f"glu_linear_offset={cfg.glu_linear_offset}")
        if f is F.silu:
            return "swiglu"
        raise Unswappable(f"gated_linear_unit with activation {getattr(f, '__name__', f)!r} (only silu: swiglu)")
    if f is F.gelu:
        if cfg.bias_activation_fusion:
            raise Unswappable("bias_activation_fusion=True with gelu (Megatron's fused gelu is the tanh "
                               "approximation; OverlapMLP's gelu is exact)")
        return "gelu"
    if f is F.relu:
        return "relu"
    raise Unswappable(f"activation {getattr(f, '__name__', f)!r} (OverlapMLP has swiglu, gelu, relu)")


def _tp_size(lin) -> int:
    return dist.get_world_size(lin.tp_group)


def _build_mlp(module, group, opts, M) -> nn.Module:
    fc1, fc2 = _linears(module, (("linear_fc1", "ColumnParallelLinear"), ("linear_fc2", "RowParallelLinear")), M)
    cfg = module.config
    act = _activation(cfg)
    if (fc1.bias is None) != (fc2.bias is None):
        raise Unswappable("only one of linear_fc1 / linear_fc2 has a bias")
    _check_plain([fc1.weight, fc2.weight, fc1.bias, fc2.bias])
    meg_tp = _tp_size(fc1)
    w = megatron_dense(module)
    sp = bool(cfg.sequence_parallel) and meg_tp > 1
    layer = OverlapMLP.from_dense(w["w_in"], w["w_out"], b_in=w["b_in"], b_out=w["b_out"], **on(group),
                                  sequence_parallel=sp, activation=act, **opts)
    if meg_tp > 1:  # [Note: Megatron weights]: the same shards as Megatron's, the same attributes
        for src, dst in ((fc1.weight, layer.w_in), (fc1.bias, layer.b_in), (fc2.weight, layer.w_out),
                         (fc2.bias, layer.b_out)):
            _copy_tp_attrs(src, dst)
    return MegatronMLP(layer, source=type(module).__name__)


def _build_attention(module, group, opts, M) -> nn.Module:
    qkv, proj = _linears(module, (("linear_qkv", "ColumnParallelLinear"), ("linear_proj", "RowParallelLinear")), M)
    cfg = module.config
    if type(getattr(module, "core_attention", None)) is not M["DotProductAttention"]:
        raise Unswappable(f"core_attention is {type(getattr(module, 'core_attention', None)).__name__}, not "
                           f"megatron-core's DotProductAttention")
    if module.attn_mask_type != M["AttnMaskType"].causal:
        raise Unswappable(f"attn_mask_type={module.attn_mask_type} (only causal)")
    for flag, bad in (("attention_output_gate", True), ("rotary_interleaved", True), ("multi_latent_attention", True)):
        if getattr(cfg, flag, False) == bad:
            raise Unswappable(f"{flag}={bad}" + (" (interleaved RoPE; OverlapAttention rotates halves)"
                                                  if flag == "rotary_interleaved" else ""))
    if getattr(cfg, "window_size", None) is not None:
        raise Unswappable(f"window_size={cfg.window_size} (sliding-window attention)")
    if getattr(cfg, "softmax_type", "vanilla") != "vanilla":
        raise Unswappable(f"softmax_type={cfg.softmax_type!r} (only 'vanilla')")
    cp = getattr(getattr(module, "pg_collection", None), "cp", None)
    if (cp is not None and dist.get_world_size(cp) > 1) or getattr(cfg, "context_parallel_size", 1) > 1:
        raise Unswappable("context parallelism (context_parallel_size > 1)")
    for name in ("q_layernorm", "k_layernorm"):
        norm = getattr(module, name, None)
        if norm is not None and not isinstance(norm, M["IdentityOp"]):
            raise Unswappable(f"{name} ({type(norm).__name__}): q/k layernorm is not swapped (Megatron's norm "
                               f"modules are not mapped to OverlapAttention's qk-norm)")
    nq, ng = cfg.num_attention_heads, cfg.num_query_groups
    ws = dist.get_world_size(group_of(group))
    if ng < ws:
        raise Unswappable(f"num_query_groups={ng} < group size {ws} (KV heads replicated over the group are not "
                           f"swapped into Megatron models)")
    if (qkv.bias is None) != (proj.bias is None):
        raise Unswappable("only one of linear_qkv / linear_proj has a bias (add_qkv_bias without add_bias_linear); "
                           "OverlapAttention takes all biases or none")
    _check_plain([qkv.weight, proj.weight, qkv.bias, proj.bias])
    meg_tp = _tp_size(qkv)
    w = megatron_dense(module)
    sp = bool(cfg.sequence_parallel) and meg_tp > 1
    layer = OverlapAttention.from_dense(
        w["wq"], w["wk"], w["wv"], w["wo"], num_heads=nq, num_kv_heads=ng, bq=w["bq"], bk=w["bk"], bv=w["bv"],
        bo=w["bo"], **on(group), sequence_parallel=sp, rope_theta=None, causal=True, softmax_scale=cfg.softmax_scale,
        dropout_p=float(cfg.attention_dropout), **opts)
    if meg_tp > 1:
        for src, dst in ((qkv.weight, layer.wq), (qkv.weight, layer.wk), (qkv.weight, layer.wv),
                         (qkv.bias, layer.bq), (qkv.bias, layer.bk), (qkv.bias, layer.bv),
                         (proj.weight, layer.wo), (proj.bias, layer.bo)):
            _copy_tp_attrs(src, dst)
    layer_number = getattr(module, "layer_number", 1)
    no_rope = bool(cfg.no_rope_freq[layer_number - 1]) if getattr(cfg, "no_rope_freq", None) else False
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import \
            _yarn_get_concentration_factor_from_config as yarn_m
        mscale = float(yarn_m(cfg))
    except ImportError:  # pragma: no cover - moved in another megatron-core version
        mscale = 1.0
    return MegatronAttention(layer, layer_number=layer_number, no_rope=no_rope, mscale=mscale,
                             source=type(module).__name__)


def _block_norm(norm) -> tuple:
    """``(kind, weight, bias, eps)`` of a torch LayerNorm / RMSNorm (Megatron's torch norms)."""
    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and norm.bias is not None:
        return "layernorm", norm.weight, norm.bias, float(norm.eps)
    if isinstance(norm, nn.RMSNorm) and norm.elementwise_affine and isinstance(norm.eps, float):
        return "rmsnorm", norm.weight, None, norm.eps
    raise Unswappable(f"{type(norm).__name__} is not a torch LayerNorm (with bias) / RMSNorm (with a float eps)")


def _build_block(module, group, opts, M) -> nn.Module:
    cfg = module.config
    for name in ("pre_cross_attn_layernorm", "cross_attention"):
        if not isinstance(getattr(module, name, None), (M["IdentityOp"], type(None))):
            raise Unswappable(f"{name} is {type(getattr(module, name)).__name__} (cross-attention)")
    for what, bad in (("hidden_dropout", float(module.hidden_dropout) != 0.0),
                      ("apply_residual_connection_post_layernorm", cfg.apply_residual_connection_post_layernorm),
                      ("fp32_residual_connection", cfg.fp32_residual_connection)):
        if bad:
            raise Unswappable(f"{what}={getattr(module, what, getattr(cfg, what, None))} (the block adds plain "
                               f"residuals in the activations' dtype)")
    if type(module.self_attention) is not M["SelfAttention"] or type(module.mlp) is not M["MLP"]:
        raise Unswappable(f"self_attention {type(module.self_attention).__name__} / mlp "
                           f"{type(module.mlp).__name__}: need megatron-core's SelfAttention and (dense) MLP")
    (k1, w1, b1, e1), (k2, w2, b2, e2) = _block_norm(module.input_layernorm), _block_norm(module.pre_mlp_layernorm)
    if (k1, e1) != (k2, e2):
        raise Unswappable(f"the two norms differ ({k1}, eps={e1}; {k2}, eps={e2})")
    _check_plain([w1, b1, w2, b2])
    attn = _build_attention(module.self_attention, group, opts, M)
    mlp = _build_mlp(module.mlp, group, opts, M)
    det = lambda t: None if t is None else t.detach()  # noqa: E731
    block = OverlapTransformerBlock.from_layers(attn.layer, mlp.layer, norm=k1, norm_eps=e1,
                                                attn_norm_weight=det(w1), attn_norm_bias=det(b1),
                                                mlp_norm_weight=det(w2), mlp_norm_bias=det(b2))
    for src, dst in ((w1, block.attn_norm.weight), (b1, block.attn_norm.bias), (w2, block.mlp_norm.weight),
                     (b2, block.mlp_norm.bias)):
        _copy_tp_attrs(src, dst)  # Megatron tags its norms sequence_parallel: its reduction covers ours
    return MegatronBlock(block, layer_number=attn.layer_number, no_rope=attn.no_rope, mscale=attn.rope.mscale,
                         source=type(module).__name__)


_BUILDERS = {"mlp": _build_mlp, "attention": _build_attention}
_OURS = (OverlapMLP, OverlapAttention, OverlapTransformerBlock, MegatronMLP, MegatronAttention, MegatronBlock)


def _check_group(module, kind, group) -> None:
    """[Note: Megatron weights]: with Megatron TP > 1, ``group`` must be Megatron's TP group."""
    lin = module.linear_fc1 if kind == "mlp" else module.linear_qkv
    meg = getattr(lin, "tp_group", None)
    if meg is None or dist.get_world_size(meg) == 1:
        return
    want, got = dist.get_process_group_ranks(meg), dist.get_process_group_ranks(group)
    if list(want) != list(got):
        raise ValueError(f"group= has global ranks {list(got)}, but Megatron's tensor-parallel group of "
                         f"{type(module).__name__} has {list(want)}: with Megatron's tensor parallelism > 1, pass "
                         f"its tensor-parallel group (megatron.core.parallel_state.get_tensor_model_parallel_group()),"
                         f" or build the Megatron model with tensor_model_parallel_size=1")


# ---------------------------------------------------------------------------- swap
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
    group = resolve_group(group, mesh, axis)
    if not isinstance(dtensor, bool):
        raise ValueError(f"dtensor={dtensor!r}; must be True (DTensor parameters) or False (plain)")
    place = tp_mesh(None if mesh is not None else group, mesh, axis, model) if dtensor else group
    rules = parse_plan(plan, block)
    M = _megatron()
    known = {"mlp": (M["MLP"],), "attention": (M["SelfAttention"],), "moe": ()}

    def kind_of(m):
        return next((k for k, classes in known.items() if type(m) in classes), None)

    def lookalike(m):
        name = type(m).__name__
        return next((k for k, suf in _LOOKALIKE_SUFFIXES.items() if name.endswith(suf)), None)

    def check_groups(todo):  # a wrong group is the caller's error: raise before building
        for name, module, kind, opts in todo:
            sub = {"mlp": (module,), "attention": (module,)}.get(kind) or (module.mlp, module.self_attention)
            for m, k in zip(sub, ("mlp", "attention") if kind == "block" else (kind,)):
                if all(hasattr(m, a) for a in (("linear_fc1",) if k == "mlp" else ("linear_qkv",))):
                    _check_group(m, k, group)

    if block:  # TransformerLayers first; the second pass swaps what the blocks left, module by module
        replace_modules(model, group, None if rules is None else [r for r in rules if r[1] in ("block", None)],
                        config, kind_of=lambda m: "block" if type(m) is M["TransformerLayer"] else None,
                        lookalike=lambda m: "block" if type(m).__name__.endswith("TransformerLayer") else None,
                        build=lambda module, kind, opts: _build_block(module, place, opts, M), ours=_OURS,
                        nothing=None, before_build=check_groups, kinds=("block",), log=logger)
    replaced, already = replace_modules(
        model, group, None if rules is None else [r for r in rules if r[1] != "block"], config,
        kind_of=kind_of, lookalike=lookalike,
        build=lambda module, kind, opts: _BUILDERS[kind](module, place, opts, M), ours=_OURS,
        nothing="no recognised megatron-core TransformerLayer / MLP / SelfAttention" if block else
        "no recognised megatron-core MLP / SelfAttention", before_build=check_groups,
        kinds=("mlp", "attention"), log=logger)
    swapped = any(replaced.values()) or already or any(isinstance(m, MegatronBlock) for m in model.modules())
    if dtensor and swapped:
        distribute_params(model, mesh=place, placement=_placement(place))
        for m in model.modules():  # GPTModel hands the shared embedding weight to its output layer
            if getattr(m, "share_embeddings_and_output_weights", False) and hasattr(m, "output_layer"):
                local_arguments(m.output_layer, ("weight",))
        logger.info(f"overlap_layers.swap: every parameter is a DTensor on {place}")
    return model


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
