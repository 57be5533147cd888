"""The sequence-parallel attention split by source rank inside batch tiles
(``plan.decomposition == "rank"``; the reference: ``layers/attention/layer.py``'s module docstring).

Legend: B batch, s local sequence (S/ws with SP, else S), b a tile's batch, g = ws (SP) or 1,
M = g*b*s gathered rows of a tile, stored rank-major ``[g, b, s]``; C = (nq_l + 2*nkv_l) * d the
local qkv width, A = nq_l * d the local attention width.

``RankChunkAttention`` (sequence parallel, ``plan.decomposition == "rank"``; per batch tile of
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

import torch

from ...planning.calls import recorded_pass
from ...planning.first_order import first_order, keeps_graph, take
from ...planning.tiling import tile_bounds
from ...runtime.exchange import block_tag
from ..common.rank_chunks import accumulate, accumulate_rows, finish, piece, step_tag
from ..common.tp_program import recording_graph
from . import query_chunks
from .call import AttentionCall


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


class RankChunkAttention(torch.autograd.Function):
    """The SP attention split by source rank inside batch tiles, without ``bo`` (module
    docstring, rank chunks): per tile, the QKV projection of each rank's rows as they are pulled
    (own rows first), the core on the tile's rows, the output projection of each rank's rows
    pushed to it (own rows last). Every tile's pulls are queued at the start, so a tile's core
    hides the next tile's pulls and the previous tile's pushes."""

    @staticmethod
    def forward(ctx, x_TH, w_qkv, b_qkv, w_o, q_norm, k_norm, call: AttentionCall):
        with recorded_pass(call, backward=False, device=x_TH.device) as rec:
            return RankChunkAttention._forward(ctx, x_TH, w_qkv, b_qkv, w_o, call, rec)

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_TH):
        with recorded_pass(ctx.call, backward=True, device=dy_TH.device) as rec:
            return RankChunkAttention._backward(ctx, dy_TH, rec)

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

