"""Tensor-parallel attention (heads split over the group, optional sequence parallelism), with the
batch tiled so the all-gather / reduce-scatter (or all-reduce) hides under the projections and
the attention core.

Reference (what :class:`OverlapAttention` must equal, up to rounding), with dense weights and the
full sequence ``x [b, S, H]``::

    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv      # heads of d = head_dim
    o = attention_core.attention(q, k, v, ...)                 # qk-norm, RoPE, SDPA with GQA
    y = o @ wo.T + bo

Rank r holds query heads ``r*nq/ws ..`` (rows of wq, columns of wo) and the KV heads they read
(rows of wk, wv: ``r*nkv/ws ..``, or the single head its query heads share when nkv < ws).
With sequence parallelism rank r holds positions ``r*s .. (r+1)*s - 1`` (``s = S/ws``).

Legend: B batch, s local sequence (S/ws with SP, else S), b a tile's batch, g = ws (SP) or 1,
M = g*b*s gathered rows of a tile, stored rank-major ``[g, b, s]``; C = (nq_l + 2*nkv_l) * d the
local qkv width, A = nq_l * d the local attention width.

``_TiledAttention`` (per rank, per tile):

==========  ==============================================  ===========================
step        sequence parallel                               no sequence parallel
==========  ==============================================  ===========================
forward     xg_MH = AG(x); qkv_MC = xg @ wqkv.T + bqkv;      same without AG, and
            o_MA = core(qkv) (sequences put in order by the   y = AR(o @ wo.T)
            core's permute); y = RS(o @ wo.T)
dgrad       dyg_MH = AG(dy); do = dyg @ wo;                  same with dy, AR
            dqkv = core'(do) (autograd of the saved core);
            dx = RS(dqkv @ wqkv)
wgrad       dwo += dyg.T @ o; dwqkv += dqkv.T @ xg (saved or  same with x
            re-gathered); dbqkv += sum(dqkv); dq_norm, dk_norm
==========  ==============================================  ===========================

The core's backward is ``torch.autograd.grad`` of a graph recorded per tile in the forward (SDPA's
own saved tensors), so it costs what autograd would and is never recomputed.

[Note: attention weight gradients last]
A tile's weight gradients open a round of their own in the backward's segmented round-robin
(``TileProgram.cut``): every tile's data gradients, and so its dx reduce-scatter,
launch before any tile's weight gradients, which then run under the last reduce-scatters. The
planner's plans and a fixed ``num_tiles`` run on one compute stream (``num_streams=1``, as the
planner simulates them; a pinned plan keeps its own), so the device keeps that order. On two
streams the device interleaves the tiles' kernels as they come: tile 0's weight gradients run
beside tile 1's flash backward and delay the dx reduce-scatter after it, and the link waits. The
round and the one stream pay together, not apart, and most where the link is slow (NCCL over
host memory). The MLP keeps its order and its two streams: the same change is slower there.
Measured: see docs/measurements.md (Attention, weight gradients last).

``_RankChunkAttention`` (sequence parallel, ``plan.decomposition == "rank"``; per batch tile of
``plan.num_tiles``, each tile one block of the exchange; step j talks to rank q = r + j, see
``runtime/exchange.py``). Every tile's pulls are queued at the start, so tile t's core hides
tile t+1's pulls and tile t-1's pushes; with one tile the own rows' projections hide some, and
with query chunks each chunk's core hides the push before it:

=========  ==================================================================================
forward    qkv[q] = x_q @ wqkv.T + bqkv for q = r (own rows, at once), then each pulled peer;
           o = core(qkv); partial = o[q] @ wo.T pushed to each peer q, own last; y = sum.
           Without qk-norm or dropout o[q] is the core's query chunk q, computed right before
           its projection ([Note: query-chunk core] in layers/attention/query_chunks.py)
dgrad      do[q] = dy_q @ wo (own, then pulled peers); dqkv = core'(do) (query chunks: one flash
           backward from the merged o and lse, o and do copied to its layout beside the pulls);
           dx partial = dqkv[q] @ wqkv pushed to each peer q, own last; dx = sum (over the copy
           engine on a side stream, beside the QKV weight gradient)
wgrad      dwo += dy_q.T @ o[q] beside the pulls; dwqkv += dqkv[q].T @ x_q beside the pushes, or
           with one tile dwqkv = dqkv.T @ xg once over every gathered row, after the last push
           (the MLP's [Note: weight gradients over every row] in ``layers/common/rank_chunks.py``: one GEMM
           with ``K = ws*T`` instead of ws with ``K = T``; xg with the own rows copied in)
=========  ==================================================================================
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ...config import Decomposition, OverlapConfig
from ...planning.call_agreement import Agreed
from ...planning.calls import LayerCall, apply_saving, recorded_pass, run_tiles
from ...planning.checks import check_dtype, resolve_config
from ...planning.dtensor import Layout
from ...planning.entry import planned_forward
from ...planning.first_order import first_order, keeps_graph, take
from ...planning.layer_spec import TiledLayer
from ...planning.plan import TilePlan
from ...planning.planner import LayerPlanner
from ...planning.rank_plans import RankChunkPlans
from ...planning.tiling import tile_bounds
from ...runtime import resolve_group
from ...runtime.collectives import all_gather_single as all_gather_rows
from ...runtime.exchange import block_tag
from ...schedule import TileProgram, round_robin
from ..common.init import init_linear_
from ..common.rank_chunks import accumulate, accumulate_rows, finish, piece, step_tag
from ..common.tp_program import (Accumulator, backward_program, column_dgrad, column_forward, forward_program,
                                 recording_graph, row_forward, weight_grad)
from . import query_chunks
from .common import (INPUT_ERRORS, PARAMS, WHAT, call_with_positions, check_args, check_dense,
                     compiled_position_args, input_error, position_kwargs, register_params)
from .common import cos_sin as cos_sin_of
from .core import Heads, attention, empty_heads, heads_backward, heads_into, sdpa
from .cost import AttentionCostModel


def check_heads(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """The head-count rules of the tensor-parallel attention layers (ValueError otherwise)."""
    if num_heads % world_size:
        raise ValueError(f"num_heads={num_heads} must be divisible by the group size {world_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads}: must be divisible by the group size {world_size}, "
                         f"or divide it (then KV heads are replicated)")


class AttentionCall(LayerCall):
    """Everything one call needs besides tensors (passed through the autograd Function)."""

    def __init__(self, layer: "OverlapAttention", plan: TilePlan, save: bool, streams, cos_sin, batch: int,
                 seq_local: int):
        super().__init__(layer.group, plan, save, streams, layer.launch_log)
        self.sp = layer.sequence_parallel
        self.g = layer.world_size if layer.sequence_parallel else 1
        self.nq, self.nkv, self.d = layer.num_heads_local, layer.num_kv_heads_local, layer.head_dim
        self.causal, self.scale = layer.causal, layer.softmax_scale
        self.dropout_p = layer.dropout_p if layer.training else 0.0
        self.q_norm, self.k_norm = layer._local("q_norm"), layer._local("k_norm")
        self.cos_sin, self.batch, self.s = cos_sin, batch, seq_local
        self.query_chunks = False  # rank chunks run the core by query chunks (set by the layer's call)
        self.diagonal_first = False  # ... each chunk's diagonal piece in its QKV piece (set likewise)

    def tables(self, b0: int, b1: int, dtype: torch.dtype):
        """RoPE's cos, sin ``[b or 1, g*s, d]`` of batch rows b0..b1 in ``dtype``, or None."""
        if self.cos_sin is None:
            return None
        return tuple((t if t.shape[0] == 1 else t[b0:b1]).to(dtype) for t in self.cos_sin)

    def heads_shape(self, b0: int, b1: int) -> tuple:
        return self.g, b1 - b0, self.s, self.nq, self.nkv, self.d

    def tile_heads(self, like: torch.Tensor, b0: int, b1: int) -> tuple:
        """``(buffers, tables)`` for :meth:`chunk_heads` and :meth:`core`'s ``pre``: the core's
        empty q, k, v (:func:`empty_heads`, ``like``'s dtype and device) of batch rows b0..b1 and
        their RoPE tables."""
        return empty_heads(like, self.heads_shape(b0, b1)), self.tables(b0, b1, like.dtype)

    def chunk_heads(self, qkv_gbsC: torch.Tensor, q: int, bufs, tables) -> None:
        """Fill the core's q, k, v buffers ``bufs`` (:meth:`tile_heads`) from one rank's rows
        ``qkv[q]`` ``[b, s, C]`` of a tile, as they arrive (rank chunks, no qk-norm)."""
        g, s, d = self.g, self.s, self.d
        tq = None if tables is None else tuple(t[:, q * s:(q + 1) * s] for t in tables)
        heads_into(qkv_gbsC[q:q + 1], *(t.view(t.shape[0], t.shape[1], g, s, d)[:, :, q:q + 1] for t in bufs), tq,
                   self.nq, self.nkv, d)

    def diagonal_chunk(self, bufs, c: int):
        """Causal query chunk c's diagonal piece (:func:`query_chunks.diagonal`) from the buffers
        ``bufs`` (:meth:`tile_heads`) once rank c's rows are in them."""
        return query_chunks.diagonal(*bufs, c, self.s, scale=self.scale)

    def core_chunk(self, bufs, c: int, o_gbsnd: torch.Tensor, lse: torch.Tensor, diag=None) -> None:
        """Rank c's rows of the core (query chunk c, :func:`query_chunks.query_chunk`) from the
        filled buffers ``bufs`` (:meth:`tile_heads`) into rank-major ``o [g, b, s, nq, d]`` and
        ``lse [b, nq, g*s]``; ``diag``: its :meth:`diagonal_chunk` if that ran."""
        s = self.s
        query_chunks.query_chunk(*bufs, c, s, causal=self.causal, scale=self.scale,
                                 o_out=o_gbsnd[c].permute(0, 2, 1, 3), lse_out=lse[:, :, c * s:(c + 1) * s],
                                 diag=diag)

    def rows_to_heads(self, rows: torch.Tensor, out: torch.Tensor, c: Optional[int] = None) -> None:
        """Copy rank-major rows ``[g*b*s, A]`` (or rank c's ``[b*s, A]``) into head-major ``out [b,
        nq, g*s, d]`` (its chunk c): the layout the core's backward reads."""
        b, nq, d = out.shape[0], self.nq, self.d
        dst = out.unflatten(2, (self.g, self.s))
        if c is None:
            dst.copy_(rows.view(self.g, b, self.s, nq, d).permute(1, 3, 0, 2, 4))
        else:
            dst[:, :, c].copy_(rows.view(b, self.s, nq, d).permute(0, 2, 1, 3))

    def core_chunks_backward(self, do, o, bufs, lse, tables) -> torch.Tensor:
        """Rank-major ``dqkv [M, C]`` of the query-chunk core (:meth:`core_chunk` over every chunk)
        given head-major ``do, o [b, nq, g*s, d]`` (:meth:`rows_to_heads`): the flash backward
        from the merged ``o`` and ``lse``, then the heads step's transpose (:func:`heads_backward`)."""
        dq, dk, dv = query_chunks.core_backward(do, *bufs, o, lse, causal=self.causal, scale=self.scale)
        return heads_backward(dq, dk, dv, (self.g, do.shape[0], self.s, self.nq, self.nkv, self.d), tables)

    def core(self, qkv_MC: torch.Tensor, b0: int, b1: int, pre=None) -> torch.Tensor:
        """o ``[M, A]`` (rank-major rows) of one tile's qkv ``[M, C]``: batch rows b0..b1. ``pre``:
        :meth:`tile_heads`' ``(buffers, tables)``, the buffers already filled by
        :meth:`chunk_heads` (only without qk-norm)."""
        g, b, s, d = self.g, b1 - b0, self.s, self.d
        if self.q_norm is None:  # RoPE and the head layout in one pass each way (attention_core.Heads)
            bufs, tables = pre if pre is not None else (None, self.tables(b0, b1, qkv_MC.dtype))
            q, k, v = Heads.apply(qkv_MC, self.heads_shape(b0, b1), tables, bufs)
            o = sdpa(q, k, v, causal=self.causal, scale=self.scale, dropout_p=self.dropout_p).transpose(1, 2)
        else:
            qkv = qkv_MC.view(g, b, s, -1).transpose(0, 1).reshape(b, g * s, -1)
            q, k, v = qkv.split([self.nq * d, self.nkv * d, self.nkv * d], dim=-1)
            o = attention(q.reshape(b, g * s, self.nq, d), k.reshape(b, g * s, self.nkv, d),
                          v.reshape(b, g * s, self.nkv, d), cos_sin=self.tables(b0, b1, qkv_MC.dtype),
                          q_norm=self.q_norm, k_norm=self.k_norm, causal=self.causal, scale=self.scale,
                          dropout_p=self.dropout_p)
        # [b, g*s, nq, d] -> rank-major [g*b*s, A] in one copy (the sequence split into (g, s) is a view)
        return o.unflatten(1, (g, s)).transpose(0, 1).reshape(g * b * s, self.nq * d)


def attention_forward_program(c: AttentionCall, w_qkv, b_qkv, w_o, bounds) -> TileProgram:
    keep_xg = c.save and c.sp and not c.plan.regather

    def core(env):
        b0, b1 = bounds[env["tile"]]
        if c.save:  # record the core's graph for the backward (SDPA's own saved tensors)
            leaf = env.pop("qkv").detach().requires_grad_()
            with recording_graph():  # [Note: per-tile graphs]
                o = c.core(leaf, b0, b1)
            env["leaf"], env["o"] = leaf, o
            env["o_in"] = o.detach()
        else:
            env["o_in"] = c.core(env.pop("qkv"), b0, b1)

    return forward_program("attn", c.sp, ("qkv", column_forward(c.sp, keep_xg, w_qkv, b_qkv, "qkv")),
                           ("core", core), ("proj", row_forward(c.sp, "o_in", w_o, c.save)))


def attention_backward_program(c: AttentionCall, w_qkv, w_o, grads: dict, norms: list) -> TileProgram:
    sp, regather = c.sp, c.sp and c.plan.regather
    xin = "xg" if sp else "x"
    accumulate = Accumulator(grads)

    def dgrad_o(env):
        env["do"] = torch.mm(env["dyg"] if sp else env["dy"], w_o)

    def core_bwd(env):
        got = torch.autograd.grad(env.pop("o"), [env.pop("leaf"), *norms], env.pop("do"),
                                  retain_graph=keeps_graph())
        env["dqkv"] = got[0]
        for i, gn in enumerate(got[1:]):
            accumulate(f"norm{i}", lambda g, gn=gn: g.copy_(gn), lambda g, gn=gn: g.add_(gn))

    return backward_program("attn_bwd", sp, regather, ("dgrad_o", dgrad_o), ("core_bwd", core_bwd),
                            ("dgrad_qkv", column_dgrad(sp, "dqkv", w_qkv)),
                            ("wgrad_o", weight_grad(accumulate, "w_o", "dyg" if sp else "dy", "o_in"), "w_o"),
                            ("wgrad_qkv", weight_grad(accumulate, "w_qkv", "dqkv", xin,
                                                      "b_qkv" if grads.get("b_qkv") is not None else None), "w_qkv"),
                            wgrad_last=True)  # [Note: attention weight gradients last]


class _TiledAttention(torch.autograd.Function):
    """Tiled, overlapped TP attention without ``bo`` (added outside). Inputs: rows of x in
    batch-major order ``[B*s, H]``, the fused qkv weight/bias and wo, and the qk-norm weights (so
    autograd routes their gradients here)."""

    @staticmethod
    def forward(ctx, x_TH, w_qkv, b_qkv, w_o, q_norm, k_norm, call: AttentionCall):
        T, H = x_TH.shape
        s = call.s
        bounds = tile_bounds(call.batch, call.plan.num_tiles)
        out_TH = x_TH.new_empty((T, H))
        envs = [{"tile": i, "x": x_TH[b0 * s:b1 * s], "y_out": out_TH[b0 * s:b1 * s]}
                for i, (b0, b1) in enumerate(bounds)]
        program = attention_forward_program(call, w_qkv, b_qkv, w_o, bounds)
        sched = round_robin(program, len(bounds), buckets=dict(call.plan.buckets_fwd))
        run_tiles(call, sched, envs, "attn", backward=False, device=x_TH.device)
        if call.save:
            ctx.graphs = [(e["leaf"], e["o"]) for e in envs]
            keep_xg = call.sp and not call.plan.regather
            ctx.save_for_backward(x_TH, w_qkv, w_o, *[e["o_in"] for e in envs],
                                  *([e["xg"] for e in envs] if keep_xg else []))
            ctx.call, ctx.has_b, ctx.n, ctx.bounds = call, b_qkv is not None, len(bounds), bounds
        return out_TH

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_TH):
        c: AttentionCall = ctx.call
        x_TH, w_qkv, w_o, *rest = ctx.saved_tensors
        n, s, bounds = ctx.n, c.s, ctx.bounds
        o_ins, xgs = rest[:n], rest[n:]
        graphs = take(ctx, "graphs")
        dy_TH = dy_TH.contiguous()
        T, H = x_TH.shape
        dx_TH = x_TH.new_empty((T, H))
        norms = [p for p in (c.q_norm, c.k_norm) if p is not None]
        grads = {"w_qkv": torch.empty_like(w_qkv), "w_o": torch.empty_like(w_o),
                 "b_qkv": w_qkv.new_empty(w_qkv.shape[0]) if ctx.has_b else None}
        for i, p in enumerate(norms):
            grads[f"norm{i}"] = torch.empty_like(p)
        envs = []
        for i, (b0, b1) in enumerate(bounds):
            env = {"dy": dy_TH[b0 * s:b1 * s], "dx_out": dx_TH[b0 * s:b1 * s], "o_in": o_ins[i],
                   "leaf": graphs[i][0], "o": graphs[i][1]}
            if c.sp and not c.plan.regather:
                env["xg"] = xgs[i]
            else:
                env["x"] = x_TH[b0 * s:b1 * s]
            envs.append(env)
        del graphs, o_ins, xgs, rest
        program = attention_backward_program(c, w_qkv, w_o, grads, norms)
        sched = round_robin(program, n, buckets=dict(c.plan.buckets_bwd))
        run_tiles(c, sched, envs, "attn_bwd", backward=True, device=dy_TH.device)
        d_norms = [grads.get("norm0"), grads.get("norm1")] if norms else [None, None]
        return dx_TH, grads["w_qkv"], grads["b_qkv"], grads["w_o"], d_norms[0], d_norms[1], None


def _own_last(ws: int) -> list:
    return list(range(1, ws)) + [0]


def _halves(ex, block: int, j: int, rows: int) -> list:
    """``(half, (first row, end row))`` of step ``j``'s pieces in ``block`` (of ``rows`` rows): the
    exchange's halves for its last push ([Note: halved last push] in ``runtime/exchange.py``),
    else one piece of every row."""
    if ex.halves is not None and j == ex.ws - 1 and block == len(ex.blocks) - 1:
        return list(enumerate(ex.halves))
    return [(None, (0, rows))]


def _logged(c: "AttentionCall", i: int, j: int, k: int, name: str, direction: str) -> None:
    if c.launch_log is not None:  # rank-independent, like every log entry
        c.launch_log.append((f"step{j}" if k == 1 else f"tile{i}.step{j}", name, direction))


class _RankChunkAttention(torch.autograd.Function):
    """The SP attention split by source rank inside batch tiles, without ``bo`` (module
    docstring, rank chunks): per tile, the QKV projection of each rank's rows as they are pulled
    (own rows first), the core on the tile's rows, the output projection of each rank's rows
    pushed to it (own rows last). Every tile's pulls are queued at the start, so a tile's core
    hides the next tile's pulls and the previous tile's pushes."""

    @staticmethod
    def forward(ctx, x_TH, w_qkv, b_qkv, w_o, q_norm, k_norm, call: AttentionCall):
        with recorded_pass(call, backward=False, device=x_TH.device) as rec:
            return _RankChunkAttention._forward(ctx, x_TH, w_qkv, b_qkv, w_o, call, rec)

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_TH):
        with recorded_pass(ctx.call, backward=True, device=dy_TH.device) as rec:
            return _RankChunkAttention._backward(ctx, dy_TH, rec)

    @staticmethod
    def _forward(ctx, x_TH, w_qkv, b_qkv, w_o, call: AttentionCall, rec):
        T, H = x_TH.shape
        keep_xg = call.save and not call.plan.regather
        bounds = tile_bounds(call.batch, call.plan.num_tiles)
        blocks, k = [(b0 * call.s, b1 * call.s) for b0, b1 in bounds], len(bounds)
        # the own rows go into the kept buffer only for the one-tile backward's QKV weight gradient
        ex = call.exchange([x_TH], (T, H), (keep_xg and k == 1,), rec, blocks=blocks, split_last=True)
        ws, r = ex.ws, ex.rank
        graphs, o_ins = [], []  # per tile: the core's recorded graph, or the query-chunk core's saved tensors
        for i, ((b0, b1), (a, b)) in enumerate(zip(bounds, blocks)):
            diags = {}  # query chunk -> its diagonal piece, run as its rows arrive ([Note: query-chunk core])
            qkv_all = x_TH.new_empty((ws, b - a, w_qkv.shape[0]))
            qkv_gbsC = qkv_all.view(ws, b1 - b0, call.s, -1)
            # without qk-norm each rank's rows are RoPE'd into the core's buffers as they arrive
            pre = call.tile_heads(x_TH, b0, b1) if call.q_norm is None else None
            for j in range(ws):
                with piece(rec, "qkv", step_tag(j, i, k), f"overlap::attn::qkv_chunk[{i}.{(r + j) % ws}]"):
                    xin = x_TH[a:b] if j == 0 else ex.pull(j, i)[0]
                    out = qkv_all[(r + j) % ws]
                    if b_qkv is None:
                        torch.mm(xin, w_qkv.t(), out=out)
                    else:
                        torch.addmm(b_qkv, xin, w_qkv.t(), out=out)
                    if pre is not None:
                        call.chunk_heads(qkv_gbsC, (r + j) % ws, *pre)
                    if call.diagonal_first:
                        diags[(r + j) % ws] = call.diagonal_chunk(pre[0], (r + j) % ws)
                _logged(call, i, j, k, "qkv", "fwd")
            qkv_MC = qkv_all.view(ws * (b - a), -1)
            if call.query_chunks:  # each projection runs after its rows' query chunk: [Note: query-chunk core]
                o_in = x_TH.new_empty((ws * (b - a), call.nq * call.d))
                lse = x_TH.new_empty((b1 - b0, call.nq, ws * call.s), dtype=query_chunks.lse_dtype(x_TH.dtype))
                o_gbsnd = o_in.view(ws, b1 - b0, call.s, call.nq, call.d)
                if call.save:
                    graphs.append((pre[0], lse, pre[1]))
            else:
                with piece(rec, "core", block_tag(i, "all", k), f"overlap::attn::core[{i}]"):
                    if call.save:
                        leaf = qkv_MC.detach().requires_grad_()
                        with recording_graph():  # [Note: per-tile graphs]
                            o = call.core(leaf, b0, b1, pre)
                        graphs.append((leaf, o))
                        o_in = o.detach()
                    else:
                        o_in = call.core(qkv_MC, b0, b1, pre)
            o_ins.append(o_in)
            o_all = o_in.view(ws, b - a, -1)
            for j in _own_last(ws):
                q = (r + j) % ws
                for half, (lo, hi) in _halves(ex, i, j, b - a):
                    with piece(rec, "proj", step_tag(j, i, k, half), f"overlap::attn::proj_chunk[{i}.{q}]"):
                        if call.query_chunks and lo == 0:
                            call.core_chunk(pre[0], q, o_gbsnd, lse, diags.pop(q, None))
                        if j:
                            ex.push(j, torch.mm(o_all[q, lo:hi], w_o.t()), i, half)
                        else:
                            torch.mm(o_all[r], w_o.t(), out=ex.own_partial[a:b])
                _logged(call, i, j, k, "proj", "fwd")
        y_TH = finish(ex, rec)
        if call.save:
            ctx.graphs, ctx.blocks = graphs, blocks
            # with the own rows kept, those rather than the input (a graph's staged one, [Note: staged input])
            ctx.save_for_backward(ex.gathered[0][r] if keep_xg and k == 1 else x_TH, w_qkv, w_o, *o_ins,
                                  *([ex.gathered[0]] if keep_xg else []))
            ctx.call, ctx.has_b = call, b_qkv is not None
        return y_TH

    @staticmethod
    def _backward(ctx, dy_TH, rec):
        c: AttentionCall = ctx.call
        x_TH, w_qkv, w_o, *rest = ctx.saved_tensors
        graphs, blocks = take(ctx, "graphs"), ctx.blocks
        k = len(blocks)
        o_ins, xg = rest[:k], rest[k:]
        dy_TH = dy_TH.contiguous()
        T, H = x_TH.shape
        whole = k == 1  # the QKV weight gradient once over every gathered row (module docstring, wgrad)
        ex = c.exchange([dy_TH, x_TH] if c.plan.regather else [dy_TH], (T, H), (False, whole and c.plan.regather),
                        rec, blocks=blocks, split_last=True)
        ws, r = ex.ws, ex.rank
        norms = [p for p in (c.q_norm, c.k_norm) if p is not None]
        grads = {"w_qkv": torch.empty_like(w_qkv), "w_o": torch.empty_like(w_o),
                 "b_qkv": w_qkv.new_empty(w_qkv.shape[0]) if ctx.has_b else None}
        d_norms = [None] * len(norms)
        for i, (a, b) in enumerate(blocks):
            o_all = o_ins[i].view(ws, b - a, -1)
            do_all = dy_TH.new_empty((ws, b - a, w_o.shape[1]))
            if c.query_chunks:  # the core's backward reads o and do head-major: copied while peers' dy arrive
                o_hm, do_hm = (dy_TH.new_empty(((b - a) // c.s, c.nq, ws * c.s, c.d)) for _ in range(2))
            xs = {}
            for j in range(ws):
                q = (r + j) % ws
                with piece(rec, "dgrad_o", step_tag(j, i, k), f"overlap::attn_bwd::dgrad_o_chunk[{i}.{q}]"):
                    pulled = ex.pull(j, i) if j else None
                    dy = dy_TH[a:b] if j == 0 else pulled[0]
                    torch.mm(dy, w_o, out=do_all[q])
                    accumulate(grads, "w_o", dy, o_all[q], i == 0 and j == 0)
                    if not whole:  # the rows of this piece's QKV weight gradient
                        xs[q] = x_TH[a:b] if j == 0 else pulled[1] if c.plan.regather else xg[0][q, a:b]
                    if c.query_chunks:
                        c.rows_to_heads(do_all[q], do_hm, q)
                        if j == 0:  # before the first peer's dy is in
                            c.rows_to_heads(o_ins[i], o_hm)
                _logged(c, i, j, k, "dgrad_o", "bwd")
            saved, graphs[i] = graphs[i], None  # this tile's core is done: free its saved tensors after
            with piece(rec, "core_bwd", block_tag(i, "all", k), f"overlap::attn_bwd::core[{i}]"):
                if c.query_chunks:
                    got = [c.core_chunks_backward(do_hm, o_hm, *saved)]
                else:
                    got = torch.autograd.grad(saved[1], [saved[0], *norms], do_all.view(ws * (b - a), -1),
                                              retain_graph=keeps_graph())
            del saved
            for n, gn in enumerate(got[1:]):
                d_norms[n] = gn if d_norms[n] is None else d_norms[n].add_(gn)
            dqkv_all = got[0].view(ws, b - a, -1)
            for n, j in enumerate(_own_last(ws)):
                q = (r + j) % ws
                for half, (lo, hi) in _halves(ex, i, j, b - a):
                    with piece(rec, "dgrad_qkv", step_tag(j, i, k, half),
                               f"overlap::attn_bwd::dgrad_qkv_chunk[{i}.{q}]"):
                        if j:
                            ex.push(j, torch.mm(dqkv_all[q, lo:hi], w_qkv), i, half)
                        else:
                            torch.mm(dqkv_all[r], w_qkv, out=ex.own_partial[a:b])
                            if i == k - 1:  # every row written and pushed: sum beside the weight gradient
                                ex.reduce_early()
                        if not whole and hi == b - a:
                            accumulate(grads, "w_qkv", dqkv_all[q], xs[q], i == 0 and n == 0)
                            accumulate_rows(grads, "b_qkv", dqkv_all[q], i == 0 and n == 0)
                _logged(c, i, j, k, "dgrad_qkv", "bwd")
            if whole:
                with piece(rec, "wgrad_qkv", block_tag(i, "all", k), f"overlap::attn_bwd::wgrad_qkv[{i}]"):
                    rows = dqkv_all.view(ws * T, -1)
                    x_all = ex.whole(1) if c.plan.regather else xg[0]
                    accumulate(grads, "w_qkv", rows, x_all.view(ws * T, -1), True)
                    accumulate_rows(grads, "b_qkv", rows, True)
                if c.launch_log is not None:
                    c.launch_log.append(("all", "wgrad_qkv", "bwd"))
        dx_TH = finish(ex, rec)
        d_norms += [None] * (2 - len(d_norms))
        return dx_TH, grads["w_qkv"], grads["b_qkv"], grads["w_o"], d_norms[0], d_norms[1], None


class OverlapAttention(RankChunkPlans, TiledLayer, nn.Module):
    """Drop-in tensor-parallel (and sequence-parallel) attention; equals the module docstring's
    reference.

    Parameters (``group=``): ``wq [nq/ws*d, H]`` (this rank's query heads), ``wk``, ``wv``
    ``[max(nkv/ws, 1)*d, H]`` (the KV heads they read), ``wo [H, nq/ws*d]``, biases ``bq``,
    ``bk``, ``bv``, ``bo``, and ``q_norm``, ``k_norm`` ``[d]``. Replicated parameters keep *this
    rank's partial* gradient in ``.grad``: ``bo`` under sequence parallelism (only the rank's own
    rows contribute), ``q_norm`` / ``k_norm`` (only its heads), and the KV heads when
    ``num_kv_heads < ws`` (only its query heads read them); sum them over the ranks that share
    them (:func:`overlap_layers.finalize_grads` does, for every layer in a module).
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
                 num_tiles=None, config: Optional[OverlapConfig] = None, dtype=None, device=None):
        super().__init__()
        num_kv_heads, head_dim = check_args(hidden_size, num_heads, num_kv_heads, head_dim, rope_theta,
                                            softmax_scale, dropout_p)
        self.config, self.num_tiles = resolve_config(config, num_tiles)
        check_dtype(dtype)
        self.group = resolve_group(group, mesh, axis)
        ws = dist.get_world_size(self.group)
        check_heads(num_heads, num_kv_heads, ws)
        self.world_size, self.rank = ws, dist.get_rank(self.group)
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden_size, num_heads, num_kv_heads, head_dim
        self.sequence_parallel, self.rope_theta, self.causal = bool(sequence_parallel), rope_theta, bool(causal)
        self.bias, self.qk_norm, self.softmax_scale, self.dropout_p = bool(bias), bool(qk_norm), softmax_scale, dropout_p
        self.num_heads_local = num_heads // ws
        self.num_kv_heads_local = max(num_kv_heads // ws, 1)
        register_params(self, hidden=hidden_size, q_heads=self.num_heads_local, kv_heads=self.num_kv_heads_local,
                        head_dim=head_dim, bias=bias, qk_norm=qk_norm, dtype=dtype, device=device)
        self.launch_log: Optional[list] = None
        self.planner = LayerPlanner(self, self.config)  # plans, agrees and runs each call: planning/planner.py
        self._init_caches()
        self.reset_parameters()
        self._as_dtensors(mesh, axis)

    def _init_caches(self) -> None:
        self._diagonal_first_of: dict = {}  # (plan key, transport) -> _diagonal_first (from the planning's model)

    # ----------------------------------------------------------------- weights
    def _kv_heads(self) -> range:
        """The dense KV heads this rank holds."""
        if self.num_kv_heads >= self.world_size:
            n = self.num_kv_heads // self.world_size
            return range(self.rank * n, (self.rank + 1) * n)
        group = self.num_heads // self.num_kv_heads
        return range(self.rank * self.num_heads_local // group, self.rank * self.num_heads_local // group + 1)

    def _rows(self, dense: torch.Tensor, heads: range) -> torch.Tensor:
        d = self.head_dim
        return dense[heads.start * d:heads.stop * d]

    def _q_heads(self) -> range:
        return range(self.rank * self.num_heads_local, (self.rank + 1) * self.num_heads_local)

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
        self._load(dense["q"][0], dense["k"][0], dense["v"][0], dense["o"][0], dense["q"][1], dense["k"][1],
                   dense["v"][1], dense["o"][1], None, None)
        if self.q_norm is not None:
            self.q_norm.fill_(1.0)
            self.k_norm.fill_(1.0)

    @torch.no_grad()
    def _load(self, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm) -> None:
        qh, kvh, d = self._q_heads(), self._kv_heads(), self.head_dim
        self.wq.copy_(self._rows(wq, qh))
        self.wk.copy_(self._rows(wk, kvh))
        self.wv.copy_(self._rows(wv, kvh))
        self.wo.copy_(wo[:, qh.start * d:qh.stop * d])
        if self.bias:
            self.bq.copy_(self._rows(bq, qh))
            self.bk.copy_(self._rows(bk, kvh))
            self.bv.copy_(self._rows(bv, kvh))
            self.bo.copy_(bo)
        if q_norm is not None:
            self.q_norm.copy_(q_norm)
            self.k_norm.copy_(k_norm)

    @classmethod
    def from_dense(cls, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, *, num_heads: int,
                   num_kv_heads: Optional[int] = None, bq=None, bk=None, bv=None, bo=None, q_norm=None, k_norm=None,
                   group=None, mesh=None, axis=None, sequence_parallel: bool = True,
                   rope_theta: Optional[float] = 10000.0, causal: bool = True, softmax_scale: Optional[float] = None,
                   dropout_p: float = 0.0, num_tiles=None, config: Optional[OverlapConfig] = None) -> "OverlapAttention":
        """Shard dense ``nn.Linear``-layout weights: ``wq [nq*d, H]``, ``wk``/``wv [nkv*d, H]``,
        ``wo [H, nq*d]``; biases all four or none; ``q_norm``/``k_norm [d]`` both or neither."""
        H, d, num_kv_heads = check_dense(wq, wk, wv, wo, num_heads=num_heads, num_kv_heads=num_kv_heads, bq=bq,
                                         bk=bk, bv=bv, bo=bo, q_norm=q_norm, k_norm=k_norm)
        if (bq is None) != (bo is None):
            raise ValueError("pass all of bq, bk, bv, bo, or none")
        has_bias = bq is not None
        layer = cls(H, num_heads, num_kv_heads, group=resolve_group(group, mesh, axis), head_dim=d,
                    sequence_parallel=sequence_parallel, rope_theta=rope_theta, causal=causal, bias=has_bias,
                    qk_norm=q_norm is not None, softmax_scale=softmax_scale, dropout_p=dropout_p, num_tiles=num_tiles,
                    config=config, dtype=wq.dtype, device="meta")
        layer.to_empty(device=wq.device)
        layer._load(wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm)
        layer._as_dtensors(mesh, axis)
        return layer

    @torch.no_grad()
    def to_dense(self) -> dict:
        """The dense weights (keys of :meth:`from_dense`; None where absent). A collective: every
        rank of the group must call it."""
        ws, d = self.world_size, self.head_dim

        def gather(t):
            out = t.new_empty((ws * t.shape[0], *t.shape[1:]))
            all_gather_rows(out, t.contiguous(), group=self.group)
            return out

        def kv(t):
            g = gather(t)
            if self.num_kv_heads >= ws:
                return g
            per = ws // self.num_kv_heads  # ranks sharing one KV head hold copies: keep the first
            return g.view(ws, *t.shape)[::per].reshape(-1, *t.shape[1:])

        p = {n: self._local(n) for n in PARAMS}
        out = {"wq": gather(p["wq"]), "wk": kv(p["wk"]), "wv": kv(p["wv"]),
               "wo": gather(p["wo"].t()).t().contiguous(),
               "bq": gather(p["bq"]) if self.bias else None, "bk": kv(p["bk"]) if self.bias else None,
               "bv": kv(p["bv"]) if self.bias else None, "bo": p["bo"].detach().clone() if self.bias else None,
               "q_norm": p["q_norm"].detach().clone() if self.qk_norm else None,
               "k_norm": p["k_norm"].detach().clone() if self.qk_norm else None}
        assert out["wq"].shape[0] == self.num_heads * d
        return out

    # ----------------------------------------------------------------- planning hooks (TiledLayer)
    @property
    def _weight(self) -> torch.Tensor:
        return self.wq

    _rank_tiles = True  # rank chunks inside batch tiles (_RankChunkAttention)

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
        """The attention core (forward, its heads step alone, and backward of a recorded graph) per
        tile batch size."""
        dev, S, C = self.wq.device, cm.g * cm.s, cm.C

        def setup(name, b):
            cos_sin = cos_sin_of(self.rope_theta, self.head_dim, S, dev, dtype, None, None)
            call = AttentionCall(self, TilePlan(1), name == "core_bwd", None, cos_sin, b, cm.s)
            if call.q_norm is not None:
                call.q_norm, call.k_norm = (p.detach().to(dtype) for p in (call.q_norm, call.k_norm))
            qkv = torch.randn(cm.g * b * cm.s, C, dtype=dtype, device=dev)
            if name == "heads":  # the core's RoPE and head layout alone (rank chunks run it per chunk)
                g, _, s, nq, nkv, d = shape = call.heads_shape(0, b)
                bufs, tables = empty_heads(qkv, shape), call.tables(0, b, dtype)
                return lambda: heads_into(qkv.view(g, b, s, -1), *(t.view(b, -1, g, s, d) for t in bufs), tables,
                                          nq, nkv, d)
            if name == "core":
                return lambda: call.core(qkv, 0, b)
            if name.startswith("chunk"):  # one rank's rows of the query-chunk core
                bufs = tuple(torch.randn_like(t) for t in empty_heads(qkv, call.heads_shape(0, b)))
                o = qkv.new_empty((cm.g, b, cm.s, call.nq, call.d))
                lse = qkv.new_empty((b, call.nq, S), dtype=query_chunks.lse_dtype(dtype))
                return lambda: call.core_chunk(bufs, int(name[5:]), o, lse)
            leaf = qkv.requires_grad_()
            with torch.enable_grad():
                o = call.core(leaf, 0, b)
            do = torch.randn_like(o)
            return lambda: torch.autograd.grad(o, leaf, do, retain_graph=True)

        return {**{key: (lambda spec=spec: setup(*spec)) for key, spec in cm.core_ops().items()},
                **self._copy_engine_setups(cm)}

    _compiled_extras = staticmethod(compiled_position_args)  # [Note: compiled calls]
    _compiled_kwargs = staticmethod(position_kwargs)

    @planned_forward  # torch.compile: one op; a DTensor x: its local tensor (planning/entry.py)
    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                position_embeddings=None, attention_mask=None) -> torch.Tensor:
        agreed = self._agree_input(x, position_ids, position_embeddings, attention_mask)
        return call_with_positions(self, x, agreed, position_ids, position_embeddings)

    def _agree_input(self, x, position_ids, position_embeddings, attention_mask) -> Agreed:
        """The call's agreement on its inputs (``LayerPlanner.agree``); the fused block's call
        (``layers/block/layer.py``) makes it too."""
        err = input_error(x, hidden_size=self.hidden_size, weight=self.wq,
                          seq_factor=self.world_size if self.sequence_parallel else 1, head_dim=self.head_dim,
                          position_ids=position_ids, position_embeddings=position_embeddings,
                          attention_mask=attention_mask, causal=self.causal)
        positions = (position_ids is not None) + 2 * (position_embeddings is not None)
        return self.planner.agree(x, err, INPUT_ERRORS, WHAT, extra=(positions,), extra_names=("positions",))

    def _run(self, x, plan: TilePlan, save: bool, position_ids, position_embeddings, trial=None,
             trace=None) -> torch.Tensor:
        x, call, w_qkv, b_qkv, wo, bo = self._prepare(
            x, plan, save, self.planner.streams.get(x.device, min(plan.num_tiles, plan.num_streams)), position_ids,
            position_embeddings)
        B, s, H = x.shape
        call.query_chunks = self._query_chunk_core(x.dtype, x.device)
        call.diagonal_first = call.query_chunks and self.causal and plan.decomposition == Decomposition.RANK and \
            self._diagonal_first(x.shape, x.dtype, save, plan.transport)
        call.trial, call.trace = trial, trace
        with torch.autocast(x.device.type, enabled=False):
            fn = self._function(plan, call, x.device, _TiledAttention, _RankChunkAttention)
            x_TH = x.reshape(B * s, H).contiguous()
            y_TH = apply_saving(fn, save, x_TH, w_qkv, b_qkv, wo, call.q_norm, call.k_norm, call)
            if bo is not None:
                y_TH = y_TH + bo
        return y_TH.view(B, s, H)

    def _prepare(self, x, plan: TilePlan, save: bool, streams, position_ids, position_embeddings) -> tuple:
        """``(x, call, w_qkv, b_qkv, wo, bo)`` of one call under ``plan`` on ``streams``: ``x`` and
        the weights in the call's dtype (autocast's, :meth:`_call_tensors`), the q, k and v
        projections concatenated, and its :class:`AttentionCall` (RoPE tables, qk-norm weights). The
        layer's own call and the fused block's (``layers/block/layer.py``) share it."""
        x, (wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm) = self._call_tensors(x, PARAMS)
        B, s, _ = x.shape
        S = s * (self.world_size if self.sequence_parallel else 1)
        with torch.autocast(x.device.type, enabled=False):
            w_qkv = torch.cat([wq, wk, wv])
            b_qkv = torch.cat([bq, bk, bv]) if self.bias else None
            cos_sin = cos_sin_of(self.rope_theta, self.head_dim, S, x.device, x.dtype, position_ids,
                                 position_embeddings)
        call = AttentionCall(self, plan, save, streams, cos_sin, B, s)
        call.q_norm, call.k_norm = q_norm, k_norm
        return x, call, w_qkv, b_qkv, wo, bo

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sequence_parallel={self.sequence_parallel}, causal={self.causal}, "
                f"rope_theta={self.rope_theta}, qk_norm={self.qk_norm}, world_size={self.world_size}, "
                f"num_tiles={self.num_tiles!r}")
