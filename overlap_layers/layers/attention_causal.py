"""The causal sequence-parallel attention split by source rank in sequence order, so that the
attention core of one chunk hides the transfers of the next (the rank-chunk plan of a causal
``OverlapAttention`` in K > 1 batch tiles; with K = 1 the layer runs its core on all rows at
once, ``_RankChunkAttention``: one whole-core kernel, where this plan's first pull and last push
would have nothing to hide under).

Reference: the serial SP attention of ``attention.py``. Under sequence parallelism rank q holds
positions ``q*s .. (q+1)*s - 1``, so the gathered rows of source rank q are query chunk q, and
with a causal mask chunk q reads only the keys and values of chunks ``0 .. q``::

    o_q = prefix_attention(rot(q_q), cat(rot(k_0), .., rot(k_q)), cat(v_0, .., v_q))

(``rot``: qk-norm and RoPE at the chunk's positions; ``prefix_attention``: lower-right causal
SDPA, ``attention_core.py``). Per batch tile (rows ``b0 .. b1`` of every rank's local batch, one
exchange block each), per chunk, on rank r (q != r: the chunk is pulled from / pushed to rank q):

========  ==================================================================================
forward   q = 0 .. ws-1: qkv_q = x_q @ wqkv.T + bqkv; o_q as above; partial = o_q @ wo.T to
          rank q (own slot when q = r); y = sum of the slots
dgrad     q = ws-1 .. 0: do_q = dy_q @ wo; (dq_q, dk_i, dv_i for i <= q) = SDPA'(do_q); k_q and
          v_q are read only by queries of chunks >= q, so their gradients are complete here:
          dqkv_q = rot'(dq_q, dk_q, dv_q); dx partial = dqkv_q @ wqkv to rank q; dx = sum
wgrad     dwo += dy_q.T @ o_q; dwqkv += dqkv_q.T @ x_q (saved or re-gathered); dbqkv += sum(dqkv_q);
          the qk-norm weights' gradients from rot'
========  ==================================================================================

Pulls come in the order the chunks are used (sequence order forward, reverse backward), so only
the first chunk's pull (unless it is the rank's own) and the last chunk's push (unless own) have
no core to hide under; batch tiles hide those too, under the neighbouring tile's chunks. The
copy engine pulls in that order; send/recv (CPU, pinned plans) posts every pull at creation.

Legend: B local batch, s local sequence, T = B*s local rows, b a tile's batch, H hidden,
nq / nkv local query / KV heads of size d, C = (nq + 2*nkv)*d, A = nq*d.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .attention_core import prefix_attention, rotate_qk
from .planned import recorded_pass
from .rank_chunks import accumulate, accumulate_rows, finish, piece
from .tiling import tile_bounds
from .tp_program import recording_graph


def pull_order(rank: int, world_size: int, blocks: int, backward: bool) -> List[tuple]:
    """``(step, block)`` of every pull in the order the chunks use them (see the module doc)."""
    chunks = range(world_size - 1, -1, -1) if backward else range(world_size)
    return [((q - rank) % world_size, i) for i in range(blocks) for q in chunks if q != rank]


class _Chunk:
    """One chunk's recorded graphs: ``leaf`` (its qkv) -> ``outs`` (rotated q, k and v), and the
    core's inputs ``q`` (a leaf) with the prefix's ``k``/``v`` leaves -> ``o``."""

    __slots__ = ("leaf", "outs", "q", "k", "v", "o")


def _rotated(c, qkv_TC: torch.Tensor, b0: int, b1: int, q: int):
    """(q, k, v) ``[b, heads, s, d]`` of chunk q's qkv rows for batch rows ``b0 .. b1``."""
    b, s, d = b1 - b0, c.s, c.d
    qkv = qkv_TC.view(b, s, -1)
    qh, kh, vh = qkv.split([c.nq * d, c.nkv * d, c.nkv * d], dim=-1)
    cs = None
    if c.cos_sin is not None:
        cs = tuple((t if t.shape[0] == 1 else t[b0:b1])[:, q * s:(q + 1) * s] for t in c.cos_sin)
    qr, kr = rotate_qk(qh.reshape(b, s, c.nq, d), kh.reshape(b, s, c.nkv, d), cos_sin=cs, q_norm=c.q_norm,
                       k_norm=c.k_norm)
    return qr, kr, vh.reshape(b, s, c.nkv, d).transpose(1, 2)


def _as_rows(o_bnsd: torch.Tensor) -> torch.Tensor:
    b, n, s, d = o_bnsd.shape
    return o_bnsd.transpose(1, 2).reshape(b * s, n * d)


def _core_chunk(c, qkv_TC: torch.Tensor, b0: int, b1: int, q: int, ks: list, vs: list) -> torch.Tensor:
    """o ``[b*s, A]`` of chunk q (its qkv rows; ``ks``/``vs`` hold chunks ``0 .. q-1``'s rotated
    keys and values, and get chunk q's appended)."""
    qr, kr, vr = _rotated(c, qkv_TC, b0, b1, q)
    ks.append(kr)
    vs.append(vr)
    return _as_rows(prefix_attention(qr, torch.cat(ks, 2), torch.cat(vs, 2), scale=c.scale, dropout_p=c.dropout_p))


def chunk_cores(c, qkvs, b0: int, b1: int) -> list:
    """Every chunk's o (chunk q's qkv rows in ``qkvs[q]``), as the forward computes them: what
    the planner times as one op ([Note: causal rank-chunk cost] in ``attention_cost.py``)."""
    ks, vs = [], []
    return [_core_chunk(c, qkv, b0, b1, q, ks, vs) for q, qkv in enumerate(qkvs)]


class _CausalRankAttention(torch.autograd.Function):
    """The module docstring's causal rank-chunk attention, without ``bo`` (added outside)."""

    @staticmethod
    def forward(ctx, x_TH, w_qkv, b_qkv, w_o, q_norm, k_norm, call):
        with recorded_pass(call, backward=False, device=x_TH.device) as rec:
            return _CausalRankAttention._forward(ctx, x_TH, w_qkv, b_qkv, w_o, call, rec)

    @staticmethod
    def backward(ctx, dy_TH):
        with recorded_pass(ctx.call, backward=True, device=dy_TH.device) as rec:
            return _CausalRankAttention._backward(ctx, dy_TH, rec)

    @staticmethod
    def _forward(ctx, x_TH, w_qkv, b_qkv, w_o, c, rec):
        T, H = x_TH.shape
        s = c.s
        bounds = tile_bounds(c.batch, c.plan.num_tiles)
        blocks = [(b0 * s, b1 * s) for b0, b1 in bounds]
        keep_xg = c.save and not c.plan.regather
        ws = c.g
        r = dist.get_rank(c.group)
        ex = c.exchange([x_TH], (T, H), (keep_xg,), rec, blocks=blocks,
                        pull_order=pull_order(r, ws, len(blocks), backward=False))
        graphs, o_ins = [], []
        for i, ((b0, b1), (a, b)) in enumerate(zip(bounds, blocks)):
            ks, vs, tile_graphs, tile_o = [], [], [], []
            for q in range(ws):
                j = (q - r) % ws
                with piece(rec, "chunk", f"{i}.{q}", f"overlap::attn::chunk[{i}.{q}]"):
                    xin = x_TH[a:b] if j == 0 else ex.pull(j, i)[0]
                    qkv = torch.mm(xin, w_qkv.t()) if b_qkv is None else torch.addmm(b_qkv, xin, w_qkv.t())
                    if c.save:
                        g = _Chunk()
                        g.leaf = qkv.detach().requires_grad_()
                        with recording_graph():  # [Note: per-tile graphs]
                            g.outs = _rotated(c, g.leaf, b0, b1, q)
                        g.q, kq, vq = (t.detach().requires_grad_() for t in g.outs)
                        ks.append(kq)
                        vs.append(vq)
                        g.k, g.v = list(ks), list(vs)
                        with recording_graph():
                            o = prefix_attention(g.q, torch.cat(ks, 2), torch.cat(vs, 2), scale=c.scale,
                                                 dropout_p=c.dropout_p)
                        g.o = o
                        tile_graphs.append(g)
                        o_rows = _as_rows(o.detach())
                    else:
                        o_rows = _core_chunk(c, qkv, b0, b1, q, ks, vs)
                    tile_o.append(o_rows)
                    if j:
                        ex.push(j, torch.mm(o_rows, w_o.t()), i)
                    else:
                        torch.mm(o_rows, w_o.t(), out=ex.own_partial[a:b])
                if c.launch_log is not None:
                    c.launch_log.append((f"tile{i}.chunk{q}", "qkv+core+proj", "fwd"))  # rank-independent
            graphs.append(tile_graphs)
            o_ins.append(tile_o)
        y_TH = finish(ex, rec)
        if c.save:
            ctx.graphs, ctx.o_ins, ctx.call, ctx.has_b = graphs, o_ins, c, b_qkv is not None
            ctx.bounds, ctx.blocks, ctx.rank = bounds, blocks, r
            ctx.save_for_backward(x_TH, w_qkv, w_o, *([ex.gathered[0]] if keep_xg else []))
        return y_TH

    @staticmethod
    def _backward(ctx, dy_TH, rec):
        c = ctx.call
        x_TH, w_qkv, w_o, *xg = ctx.saved_tensors
        graphs, o_ins, ctx.graphs, ctx.o_ins = ctx.graphs, ctx.o_ins, None, None
        dy_TH = dy_TH.contiguous()
        T, H = x_TH.shape
        ws, r, blocks = c.g, ctx.rank, ctx.blocks
        ex = c.exchange([dy_TH, x_TH] if c.plan.regather else [dy_TH], (T, H), (), rec, blocks=blocks,
                        pull_order=pull_order(r, ws, len(blocks), backward=True))
        norms = [p for p in (c.q_norm, c.k_norm) if p is not None]
        grads = {"w_qkv": torch.empty_like(w_qkv), "w_o": torch.empty_like(w_o),
                 "b_qkv": w_qkv.new_empty(w_qkv.shape[0]) if ctx.has_b else None}
        d_norms = [None] * len(norms)
        first = True
        for i, (a, b) in enumerate(blocks):
            dk, dv = [None] * ws, [None] * ws
            for q in range(ws - 1, -1, -1):
                j, g = (q - r) % ws, graphs[i][q]
                with piece(rec, "chunk_bwd", f"{i}.{q}", f"overlap::attn_bwd::chunk[{i}.{q}]"):
                    pulled = ex.pull(j, i) if j else None
                    dy = dy_TH[a:b] if j == 0 else pulled[0]
                    do = torch.mm(dy, w_o)
                    accumulate(grads, "w_o", dy, o_ins[i][q], first)
                    bb, n, s, d = g.q.shape
                    got = torch.autograd.grad(g.o, [g.q, *g.k, *g.v], do.view(bb, s, n, d).transpose(1, 2))
                    dq, dks, dvs = got[0], got[1:q + 2], got[q + 2:]
                    for p in range(q + 1):
                        dk[p] = dks[p] if dk[p] is None else dk[p].add_(dks[p])
                        dv[p] = dvs[p] if dv[p] is None else dv[p].add_(dvs[p])
                    got = torch.autograd.grad(list(g.outs), [g.leaf, *norms], [dq, dk[q], dv[q]])
                    dk[q] = dv[q] = None
                    dqkv = got[0]
                    for n_i, gn in enumerate(got[1:]):
                        d_norms[n_i] = gn if d_norms[n_i] is None else d_norms[n_i].add_(gn)
                    if j:
                        ex.push(j, torch.mm(dqkv, w_qkv), i)
                    else:
                        torch.mm(dqkv, w_qkv, out=ex.own_partial[a:b])
                    xq = x_TH[a:b] if j == 0 else pulled[1] if c.plan.regather else xg[0][q, a:b]
                    accumulate(grads, "w_qkv", dqkv, xq, first)
                    accumulate_rows(grads, "b_qkv", dqkv, first)
                    first = False
                    graphs[i][q] = None  # this chunk's graphs are done: free their saved tensors
                if c.launch_log is not None:
                    c.launch_log.append((f"tile{i}.chunk{q}", "dgrad_o+core_bwd+dgrad_qkv", "bwd"))
        dx_TH = finish(ex, rec)
        out_norms = d_norms + [None] * (2 - len(d_norms))
        return dx_TH, grads["w_qkv"], grads["b_qkv"], grads["w_o"], out_norms[0], out_norms[1], None
