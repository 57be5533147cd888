"""Tensor-parallel attention (heads split over the group, optional sequence parallelism), with the
batch tiled so the all-gather / reduce-scatter (or all-reduce) hides under the projections and
the attention core.

Reference (what :class:`OverlapAttention` must equal, up to rounding), with dense weights and the
full sequence ``x [b, S, H]``::

    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv      # heads of d = head_dim
    o = attention_core.attention(q, k, v, ...)                 # qk-norm, RoPE, SDPA with GQA
                                                               # (qk-norm weights qk_norm_offset + q_norm)
    y = o @ wo.T + bo

Rank r holds query heads ``r*nq/ws ..`` (rows of wq, columns of wo) and the KV heads they read
(rows of wk, wv: ``r*nkv/ws ..``, or the single head its query heads share when nkv < ws).
With sequence parallelism rank r holds positions ``r*s .. (r+1)*s - 1`` (``s = S/ws``).

Legend: B batch, s local sequence (S/ws with SP, else S), b a tile's batch, g = ws (SP) or 1,
M = g*b*s gathered rows of a tile, stored rank-major ``[g, b, s]``; C = (nq_l + 2*nkv_l) * d the
local qkv width, A = nq_l * d the local attention width.

The call's passes: over batch tiles, each tile's collectives under another tile's compute
(``layers/attention/tiles.py``, where [Note: attention weight gradients last] is), or, with
sequence parallelism, split by source rank inside batch tiles (``layers/attention/rank_chunks.py``);
the per-call state both read (the core, RoPE tables, query chunks) is ``layers/attention/call.py``'s.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ...config import Decomposition, OverlapConfig
from ...planning.call_agreement import Agreed
from ...planning.calls import apply_saving
from ...planning.dtensor import Layout
from ...planning.entry import planned_forward
from ...planning.layer_spec import TiledLayer
from ...planning.plan import TilePlan
from ...planning.rank_plans import RankChunkPlans
from ...runtime import resolve_group
from ..common.grads import sum_grads_in_backward
from ..common.init import init_linear_
from ..common.plain_tp import enter, leave, timed_inputs, timed_output
from . import query_chunks
from .call import AttentionCall, check_heads, core_op_setups
from .common import (INPUT_ERRORS, PARAMS, WHAT, call_forms, call_with_positions, check_args, check_dense,
                     compiled_position_args, config_fields, input_error, position_kwargs, register_params,
                     replicated_positions)
from .common import cos_sin as cos_sin_of
from .core import attention
from .cost import AttentionCostModel
from .rank_chunks import RankChunkAttention
from .shards import dense_weights, kv_heads, load_shards_
from .tiles import TiledAttention, attention_backward_program, attention_forward_program


class OverlapAttention(RankChunkPlans, TiledLayer, nn.Module):
    """Drop-in tensor-parallel (and sequence-parallel) attention; equals the module docstring's
    reference.

    Parameters (``group=``): ``wq [nq/ws*d, H]`` (this rank's query heads), ``wk``, ``wv``
    ``[max(nkv/ws, 1)*d, H]`` (the KV heads they read), ``wo [H, nq/ws*d]``, biases ``bq``,
    ``bk``, ``bv``, ``bo``, and ``q_norm``, ``k_norm`` ``[d]``. Replicated parameters whose rank
    computes only part of their gradient -- ``bo`` under sequence parallelism (the rank's own
    rows), ``q_norm`` / ``k_norm`` (its heads), and the KV heads when ``num_kv_heads < ws`` (its
    query heads read them) -- have it summed over the ranks that share them inside backward
    ([Note: gradients complete in backward] in ``layers/common/grads.py``): ``.grad`` is complete
    when backward returns.
    With ``mesh=`` the same tensors are the local parts of DTensor parameters whose global value is
    the dense tensor (replicated KV heads: a Replicate of the dense ``wk``...); see
    overlap_layers.planning.dtensor.

    Input ``[batch, seq_local, hidden]`` with ``sequence_parallel`` (rank r holds positions
    ``r*seq_local ..``), else the replicated ``[batch, seq, hidden]``; the output has the input's
    layout. ``position_ids [batch, seq]`` and ``position_embeddings = (cos, sin)`` describe the
    *global* sequence and must be the same on every rank. ``num_tiles`` tiles the batch.
    """

    _plan_streams = 1  # [Note: attention weight gradients last]

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None, *, group=None,
                 mesh=None, axis=None, head_dim: Optional[int] = None, sequence_parallel: bool = True,
                 rope_theta: Optional[float] = 10000.0, causal: bool = True, bias: bool = False,
                 qk_norm: bool = False, softmax_scale: Optional[float] = None, dropout_p: float = 0.0,
                 qk_norm_offset: float = 0.0, num_tiles=None, config: Optional[OverlapConfig] = None, dtype=None,
                 device=None):
        super().__init__()
        if qk_norm_offset not in (0.0, 1.0):
            raise ValueError(f"qk_norm_offset={qk_norm_offset!r}; valid: 0.0 (rms_norm(q) * q_norm) or 1.0 "
                             f"(rms_norm(q) * (1 + q_norm), Gemma's)")
        num_kv_heads, head_dim = check_args(hidden_size, num_heads, num_kv_heads, head_dim, rope_theta,
                                            softmax_scale, dropout_p)
        ws = self._init_group(config, num_tiles, dtype, group, mesh, axis)
        check_heads(num_heads, num_kv_heads, ws)
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden_size, num_heads, num_kv_heads, head_dim
        self.sequence_parallel, self.rope_theta, self.causal = bool(sequence_parallel), rope_theta, bool(causal)
        self.bias, self.qk_norm, self.softmax_scale, self.dropout_p = bool(bias), bool(qk_norm), softmax_scale, dropout_p
        self.qk_norm_offset = float(qk_norm_offset)
        self.num_heads_local = num_heads // ws
        self.num_kv_heads_local = max(num_kv_heads // ws, 1)
        register_params(self, hidden=hidden_size, q_heads=self.num_heads_local, kv_heads=self.num_kv_heads_local,
                        head_dim=head_dim, bias=bias, qk_norm=qk_norm, dtype=dtype, device=device)
        self._init_planner(mesh, axis)
        # the rank's heads / rows only: [Note: gradients complete in backward]
        sum_grads_in_backward(self, ("q_norm", "k_norm", "bo") if self.sequence_parallel else ("q_norm", "k_norm"))
        if num_kv_heads < ws:  # each KV head's copies
            sum_grads_in_backward(self, ("wk", "wv", "bk", "bv"), copies=(num_kv_heads, self._kv_heads().start))

    def _init_caches(self) -> None:
        self._diagonal_first_of: dict = {}  # (plan key, transport) -> _diagonal_first (from the planning's model)
        self._rope_tables: tuple = (None, None)  # (S, device, dtype), the RoPE tables of positions 0..S-1

    def _default_tables(self, S: int, x: torch.Tensor):
        """The RoPE tables of positions ``0..S-1`` (``cos_sin_of`` without position ids) in ``x``'s
        dtype, as every use casts them, kept for the next call of the same length, device and dtype
        (None without RoPE)."""
        key = (S, x.device, x.dtype)
        if self._rope_tables[0] != key:
            tables = cos_sin_of(self.rope_theta, self.head_dim, S, x.device, x.dtype, None, None)
            self._rope_tables = (key, None if tables is None else tuple(t.to(x.dtype) for t in tables))
        return self._rope_tables[1]

    # ----------------------------------------------------------------- weights
    def _kv_heads(self) -> range:
        """The dense KV heads this rank holds."""
        return kv_heads(self.num_heads, self.num_kv_heads, self.world_size, self.rank)

    def _dtensor_layouts(self) -> Dict[str, Layout]:
        """[Note: DTensor parameters] (``planning/dtensor.py``): ``wk``, ``wv``, ``bk``, ``bv``
        Shard(0) if ``num_kv_heads >= ws``, else a Replicate of the dense tensor whose rows of this
        rank's head it computes with."""
        d = self.head_dim
        heads = self._kv_heads()
        kv = Layout(Shard(0)) if self.num_kv_heads >= self.world_size else \
            Layout(Replicate(), rows=slice(heads.start * d, heads.stop * d))
        return {"wq": Layout(Shard(0)), "bq": Layout(Shard(0)), "wk": kv, "wv": kv, "bk": kv, "bv": kv,
                "wo": Layout(Shard(1)), "bo": Layout(Replicate()), "q_norm": Layout(Replicate()),
                "k_norm": Layout(Replicate())}

    def _dtensor_input_placements(self) -> tuple:
        """[Note: DTensor inputs]: the sequence shard with sequence parallelism, else replicated."""
        return (Shard(1),) if self.sequence_parallel else (Replicate(),)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise as ``nn.Linear`` layers q, k, v, o (weight then bias each) would under the same
        seed, keeping this rank's shard (the same on every rank); norms to ones."""
        if self.wq.device.type == "meta":
            return
        kw = {"dtype": self.wq.dtype, "device": self.wq.device}
        H, d = self.hidden_size, self.head_dim

        def linear(out_f, in_f):
            w, b = torch.empty(out_f, in_f, **kw), torch.empty(out_f, **kw) if self.bias else None
            init_linear_(w, b)
            return w, b

        dense = {"q": linear(self.num_heads * d, H), "k": linear(self.num_kv_heads * d, H),
                 "v": linear(self.num_kv_heads * d, H), "o": linear(H, self.num_heads * d)}
        load_shards_(self, dense["q"][0], dense["k"][0], dense["v"][0], dense["o"][0], dense["q"][1], dense["k"][1],
                     dense["v"][1], dense["o"][1], None, None)
        if self.q_norm is not None:
            self.q_norm.fill_(1.0)
            self.k_norm.fill_(1.0)

    @classmethod
    def from_dense(cls, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, *, num_heads: int,
                   num_kv_heads: Optional[int] = None, bq=None, bk=None, bv=None, bo=None, q_norm=None, k_norm=None,
                   group=None, mesh=None, axis=None, sequence_parallel: bool = True,
                   rope_theta: Optional[float] = 10000.0, causal: bool = True, softmax_scale: Optional[float] = None,
                   dropout_p: float = 0.0, qk_norm_offset: float = 0.0, num_tiles=None,
                   config: Optional[OverlapConfig] = None) -> "OverlapAttention":
        """Shard dense ``nn.Linear``-layout weights: ``wq [nq*d, H]``, ``wk``/``wv [nkv*d, H]``,
        ``wo [H, nq*d]``; ``bq``, ``bk``, ``bv`` all or none, ``bo`` independently (Qwen2 has qkv
        biases only); ``q_norm``/``k_norm [d]`` both or neither."""
        H, d, num_kv_heads = check_dense(wq, wk, wv, wo, num_heads=num_heads, num_kv_heads=num_kv_heads, bq=bq,
                                         bk=bk, bv=bv, bo=bo, q_norm=q_norm, k_norm=k_norm)
        layer = cls(H, num_heads, num_kv_heads, group=resolve_group(group, mesh, axis), head_dim=d,
                    sequence_parallel=sequence_parallel, rope_theta=rope_theta, causal=causal, bias=bq is not None,
                    qk_norm=q_norm is not None, softmax_scale=softmax_scale, dropout_p=dropout_p,
                    qk_norm_offset=qk_norm_offset, num_tiles=num_tiles, config=config, dtype=wq.dtype, device="meta")
        if (bo is not None) != layer.bias:  # qkv biases without bo, or bo alone
            layer.bo = nn.Parameter(torch.empty(H, dtype=wq.dtype, device="meta")) if bo is not None else None
            if layer.sequence_parallel:
                sum_grads_in_backward(layer, ("bo",))
        layer.to_empty(device=wq.device)
        load_shards_(layer, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm)
        layer._as_dtensors(mesh, axis)
        return layer

    @torch.no_grad()
    def to_dense(self) -> dict:
        """The dense weights (keys of :meth:`from_dense`; None where absent). A collective: every
        rank of the group must call it."""
        return dense_weights(self)

    # ----------------------------------------------------------------- planning hooks (TiledLayer)
    @property
    def _weight(self) -> torch.Tensor:
        return self.wq

    def _config_fields(self) -> tuple:
        return (*config_fields(self), ("sequence_parallel", self.sequence_parallel))

    _rank_tiles = True  # rank chunks inside batch tiles (RankChunkAttention)

    def _backward_reads_input(self, plan) -> bool:
        return plan.regather or plan.num_tiles > 1  # one tile: the own rows kept in the gathered x

    def _query_chunk_core(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether rank-chunk plans run the core by query chunks ([Note: query-chunk core]):
        without qk-norm or dropout, where :func:`query_chunks.supported`. Not a collective
        decision: the exchange is the same either way."""
        return (not self.qk_norm and self.dropout_p == 0 and self.sequence_parallel
                and query_chunks.supported(dtype, device, self.head_dim))

    def _diagonal_first(self, shape: tuple, dtype: torch.dtype, save: bool, transport: str) -> bool:
        """:meth:`AttentionCostModel.diagonal_first` of a call's shape with the hardware model the
        layer's planning made (measured peer copies), cached per shape; True without one (a
        pinned plan): the faster order where it matters (llama3-8b at TP 4), only memory elsewhere."""
        hw = self.planner.maker.hw.get(dtype)
        if hw is None:
            return True
        key = (self._plan_key(tuple(shape), dtype, save), transport)
        if key not in self._diagonal_first_of:
            self._diagonal_first_of[key] = self._cost_model(key[0], hw).diagonal_first(transport)
        return self._diagonal_first_of[key]

    def _plan_key(self, shape: tuple, dtype: torch.dtype, save: bool) -> tuple:
        return (shape[0], shape[1], dtype, save)  # exact batch and local sequence

    def _tile_units(self, shape: tuple) -> int:
        return shape[0]

    def _plain_call(self, key: tuple):
        if self.world_size != 1:
            return None
        return (key[0], key[1], self.hidden_size), lambda x: self._plain_run(x, TilePlan(1), True, None, None, None)

    def _cost_model(self, key: tuple, hw) -> AttentionCostModel:
        batch, s, dtype = key[0], key[1], key[2]
        return AttentionCostModel(batch=batch, seq_local=s, world_size=self.world_size, hidden=self.hidden_size,
                                  heads=self.num_heads_local, kv_heads=self.num_kv_heads_local,
                                  head_dim=self.head_dim, elt=torch.tensor([], dtype=dtype).element_size(),
                                  sequence_parallel=self.sequence_parallel, causal=self.causal, model=hw,
                                  chunked_heads=not self.qk_norm,
                                  query_chunks=self._query_chunk_core(dtype, self.wq.device))

    def _programs(self, k: int, save: bool, regather: bool):
        call = AttentionCall(self, TilePlan(k, regather=regather), save, None, None, 1, 1)
        return (attention_forward_program(call, None, None, None, []),
                attention_backward_program(call, None, None, {}, []))

    def _op_setups(self, cm: AttentionCostModel, dtype: torch.dtype) -> dict:
        """The attention core's ops (:func:`~.call.core_op_setups`) and the copy engine's."""
        return {**core_op_setups(self, cm, dtype), **self._copy_engine_setups(cm)}

    _compiled_extras = staticmethod(compiled_position_args)  # [Note: compiled calls]
    _compiled_kwargs = staticmethod(position_kwargs)

    @planned_forward  # torch.compile: one op; a DTensor x: its local tensor (planning/entry.py)
    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                position_embeddings=None, attention_mask=None) -> torch.Tensor:
        planner = self.planner  # [Note: direct calls] in planning/planner.py; a mask's values are checked per call
        direct = None if attention_mask is not None else planner.direct_key(
            x, 0, *call_forms(position_ids, position_embeddings, None))
        if planner.direct_known(direct):
            return self._plain_ops(x, self._locals_without_grad(PARAMS), position_ids, position_embeddings, None,
                                   None, None)
        agreed = self._agree_input(x, position_ids, position_embeddings, attention_mask)
        if direct is not None:
            return self._plain_run(x, planner.direct_agreed(direct), False, position_ids, position_embeddings, None)
        return call_with_positions(self, x, agreed, position_ids, position_embeddings)

    def attend(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None, position_embeddings=None,
               attention_mask: Optional[torch.Tensor] = None, kv_update: Optional[Callable] = None) -> torch.Tensor:
        """``forward`` under any attention mask and with a KV cache, for inference and padded or
        packed batches: equals the dense layer (module docstring) whose core attends, for each new
        query, to the keys ``attention_mask`` allows among ``kv_update``'s.

        ``attention_mask``: SDPA's (boolean, True = attend, or additive), ``[batch or 1, 1,
        seq, keys]`` over the keys attended to (padding, packed sequences, sliding windows), or
        None: causal as SDPA's ``is_causal`` (query i attends to keys 0..i), none for one query.
        ``kv_update(k, v)``: called with this call's keys (after qk-norm and RoPE) and values of
        this rank's KV heads, ``[batch, kv heads / ws, seq, head_dim]``; returns every key and value
        to attend to (a cache's ``update``); None: this call's own. With
        ``OverlapConfig(check_inputs=True)`` the mask is compared across the ranks like ``x``. Without sequence parallelism only (the replicated
        sequence of a decoder's inference).

        The call runs the serial plan as plain torch ops ([Note: plain serial calls] in
        ``layers/common/plain_tp.py``) with no planning: its agreement (once per call signature,
        [Note: agreement once per call signature]) is its only bookkeeping, so a decoding loop's
        calls of one shape do no host work beyond the plain module's: a call without grad of at most
        a few dozen tokens makes even its agreement only once per signature ([Note: direct calls]
        in ``planning/planner.py``)."""
        planner = self.planner
        direct = planner.direct_key(x, 1 + (kv_update is not None),
                                    *call_forms(position_ids, position_embeddings, attention_mask))
        if planner.direct_known(direct):  # autocast off: the parameters as they are
            return self._plain_ops(x, self._locals_without_grad(PARAMS), position_ids, position_embeddings, None,
                                   attention_mask, kv_update)
        if self.sequence_parallel:
            raise ValueError("attend: the layer has sequence_parallel=True; masked and cached calls need the "
                             "replicated sequence (build it with sequence_parallel=False)")
        mask_ok = attention_mask is None or (
            isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and attention_mask.shape[0] in (1, x.shape[0]) and attention_mask.shape[2] == x.shape[1])
        if not mask_ok:
            raise ValueError(f"attention_mask={getattr(attention_mask, 'shape', attention_mask)!r}: attend takes None or "
                             f"a 4-D [batch or 1, 1, seq, keys] mask for x {tuple(x.shape)}")
        err = input_error(x, hidden_size=self.hidden_size, weight=self.wq, seq_factor=1, head_dim=self.head_dim,
                          position_ids=position_ids, position_embeddings=position_embeddings, attention_mask=None,
                          causal=self.causal)
        positions = (position_ids is not None) + 2 * (position_embeddings is not None)
        agreed = planner.agree(x, err, INPUT_ERRORS, WHAT, extra=(positions, 1 + (kv_update is not None)),
                               extra_names=("positions", "masked or cached call"),
                               replicated=(("x", x), ("attention_mask", attention_mask),
                                           *replicated_positions(position_ids, position_embeddings)))
        plan = None if direct is None else planner.direct_agreed(direct)
        return self._plain_run(x, plan, agreed.save, position_ids, position_embeddings, None,
                               attn_mask=attention_mask, kv_update=kv_update)

    def _agree_input(self, x, position_ids, position_embeddings, attention_mask) -> Agreed:
        """The call's agreement on its inputs (``LayerPlanner.agree``); the fused block's call
        (``layers/block/layer.py``) makes it too."""
        err = input_error(x, hidden_size=self.hidden_size, weight=self.wq,
                          seq_factor=self.world_size if self.sequence_parallel else 1, head_dim=self.head_dim,
                          position_ids=position_ids, position_embeddings=position_embeddings,
                          attention_mask=attention_mask, causal=self.causal)
        positions = (position_ids is not None) + 2 * (position_embeddings is not None)
        return self.planner.agree(x, err, INPUT_ERRORS, WHAT, extra=(positions, 0),
                                  extra_names=("positions", "masked or cached call"),
                                  replicated=(("x", None if self.sequence_parallel else x), ("attention_mask", None),
                                              *replicated_positions(position_ids, position_embeddings)))

    def _run(self, x, plan: TilePlan, save: bool, position_ids, position_embeddings, trial=None,
             trace=None) -> torch.Tensor:
        if plan.runs_plain(trace, self.launch_log):
            return self._plain_run(x, plan, save, position_ids, position_embeddings, trial)
        x, call, w_qkv, b_qkv, wo, bo = self._prepare(
            x, plan, save, self.planner.streams.get(x.device, min(plan.num_tiles, plan.num_streams)), position_ids,
            position_embeddings)
        B, s, H = x.shape
        call.query_chunks = self._query_chunk_core(x.dtype, x.device)
        call.diagonal_first = call.query_chunks and self.causal and plan.decomposition == Decomposition.RANK and \
            self._diagonal_first(x.shape, x.dtype, save, plan.transport)
        call.trial, call.trace = trial, trace
        with torch.autocast(x.device.type, enabled=False):
            fn = self._function(plan, call, x.device, TiledAttention, RankChunkAttention)
            x_TH = x.reshape(B * s, H).contiguous()
            y_TH = apply_saving(fn, save, x_TH, w_qkv, b_qkv, wo, call.q_norm, call.k_norm, call)
            if bo is not None:
                y_TH = y_TH + bo
        return y_TH.view(B, s, H)

    def _plain_run(self, x, plan: TilePlan, save: bool, position_ids, position_embeddings, trial,
                   attn_mask=None, kv_update=None) -> torch.Tensor:
        """The serial plan as the reference's torch ops under autograd ([Note: plain serial calls] in
        ``layers/common/plain_tp.py``): q, k and v by their own projections of the gathered rows
        (rank-major ``[g, B, s]``, put in sequence order for the core and back for the reduction);
        ``attn_mask`` and ``kv_update`` as :meth:`attend` takes them."""
        x, params = self._call_tensors(x, PARAMS)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            with torch.autocast(dev, enabled=False):
                return self._plain_ops(x, params, position_ids, position_embeddings, trial, attn_mask, kv_update)
        return self._plain_ops(x, params, position_ids, position_embeddings, trial, attn_mask, kv_update)

    def _plain_ops(self, x, params, position_ids, position_embeddings, trial, attn_mask, kv_update) -> torch.Tensor:
        """:meth:`_plain_run`'s ops on ``x`` and the local ``params`` (:data:`PARAMS`' order) in
        the call's dtype, autocast off."""
        wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm = params
        q_norm, k_norm = self._offset_norms(q_norm, k_norm)
        B, s, H = x.shape
        ws, sp = self.world_size, self.sequence_parallel
        g = ws if sp else 1
        S, nq, nkv, d = g * s, self.num_heads_local, self.num_kv_heads_local, self.head_dim
        cos_sin = self._tables(S, x, position_ids, position_embeddings)
        x, wq = timed_inputs(trial, x, wq)
        rows = enter(x, self.group, ws, sp)
        seq = rows if g == 1 else rows.view(g, B, s, H).transpose(0, 1).reshape(B, S, H)
        o = attention(F.linear(seq, wq, bq).view(B, S, nq, d), F.linear(seq, wk, bk).view(B, S, nkv, d),
                      F.linear(seq, wv, bv).view(B, S, nkv, d), cos_sin=cos_sin, q_norm=q_norm, k_norm=k_norm,
                      causal=self.causal, scale=self.softmax_scale,
                      dropout_p=self.dropout_p if self.training else 0.0, attn_mask=attn_mask, kv_update=kv_update)
        y = F.linear(o.reshape(B, S, nq * d), wo)
        if g > 1:
            y = y.view(B, g, s, H).transpose(0, 1).reshape(g * B, s, H)
        y = leave(y, self.group, ws, sp)
        return timed_output(y if bo is None else y + bo, trial)

    def _offset_norms(self, q_norm, k_norm) -> tuple:
        """The qk-norm weights the core multiplies by: ``qk_norm_offset + q_norm`` (differentiable
        in ``q_norm``), the parameters themselves where the offset is 0."""
        if q_norm is None or not self.qk_norm_offset:
            return q_norm, k_norm
        return q_norm + self.qk_norm_offset, k_norm + self.qk_norm_offset

    def _tables(self, S: int, x: torch.Tensor, position_ids, position_embeddings):
        """The call's RoPE tables ``(cos, sin)`` (``common.cos_sin``), or None without RoPE."""
        if position_ids is None and position_embeddings is None:
            return self._default_tables(S, x)
        return cos_sin_of(self.rope_theta, self.head_dim, S, x.device, x.dtype, position_ids, position_embeddings)

    def _prepare(self, x, plan: TilePlan, save: bool, streams, position_ids, position_embeddings) -> tuple:
        """``(x, call, w_qkv, b_qkv, wo, bo)`` of one call under ``plan`` on ``streams``: ``x`` and
        the weights in the call's dtype (autocast's, :meth:`_call_tensors`), the q, k and v
        projections concatenated, and its :class:`AttentionCall` (RoPE tables, qk-norm weights). The
        layer's own call and the fused block's (``layers/block/layer.py``) share it."""
        x, (wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm) = self._call_tensors(x, PARAMS)
        q_norm, k_norm = self._offset_norms(q_norm, k_norm)
        B, s, _ = x.shape
        S = s * (self.world_size if self.sequence_parallel else 1)
        with torch.autocast(x.device.type, enabled=False):
            w_qkv = torch.cat([wq, wk, wv])
            b_qkv = torch.cat([bq, bk, bv]) if self.bias else None
            cos_sin = self._tables(S, x, position_ids, position_embeddings)
        call = AttentionCall(self, plan, save, streams, cos_sin, B, s)
        call.q_norm, call.k_norm = q_norm, k_norm
        return x, call, w_qkv, b_qkv, wo, bo

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sequence_parallel={self.sequence_parallel}, causal={self.causal}, "
                f"rope_theta={self.rope_theta}, qk_norm={self.qk_norm}, world_size={self.world_size}, "
                f"num_tiles={self.num_tiles!r}")
