"""The Ulysses attention's pass over tiles (the reference: ``layers/attention/ulysses.py``'s module
docstring): each tile's all-to-alls hide under other tiles' compute.

Legend: B batch, s seq_local, S = ws*s, H hidden, d head_dim, nq / nkv query / KV heads,
hq = nq/ws query heads per rank. Per tile: b its batch rows, t = b*s its local tokens, nh its
query heads on each rank (hq for batch tiles), hk the KV heads this rank's nh query heads read,
C = sum_j (nh + 2*hk_j)*d the qkv rows this rank sends (grouped by destination j),
R = ws*(nh + 2*hk)*d the rows it receives, F = ws*nh*d the tile's attention features.

``UlyssesTiles`` (per rank, per tile; A2A = all_to_all, ``(+)=``: tiles over heads add up):

=========  =========================================================================
forward    send_Ct = w_send_CH @ x_tH.T + b_send;  recv_Rt = A2A(send_Ct)
           o_Ft = core(recv_Rt);  oT_Ft = A2A(o_Ft);  y_tH (+)= oT_Ft.T @ wo_HF.T
dgrad      do_Ft = wo_HF.T @ dy_tH.T;  dout_Ft = A2A(do_Ft);  drecv_Rt = core'(dout_Ft)
           (autograd of the graph saved in the forward);  dsend_Ct = A2A(drecv_Rt);
           dx_tH (+)= dsend_Ct.T @ w_send_CH
wgrad      dwo_HF += dy_tH.T @ oT_Ft.T (under the first backward A2A);
           dw_send_CH += dsend_Ct @ x_tH;  db_send += sum_t(dsend_Ct);  dq_norm, dk_norm (core')
=========  =========================================================================

``w_send`` / ``b_send`` are rows of ``[wq; wk; wv]`` / ``[bq; bk; bv]`` and ``wo_HF`` columns of
``wo`` ([Note: send layout]); autograd of that selection brings their gradients home.
Forward: tile t's qkv A2A runs under tile t+1's projection and the cores, its output A2A under the
next tile's core. Backward: the output-gradient A2A under ``dwo`` and the next tile's dgrad, the
qkv-gradient A2A under the next tile's core backward and the projections' dgrad / wgrad.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ...planning.calls import LayerCall, run_tiles
from ...planning.first_order import first_order, keeps_graph, take
from ...planning.plan import TilePlan
from ...schedule import TileProgram, comm, compute, round_robin, wait
from ..common.tp_program import recording_graph
from .core import attention

# [Note: send layout]
# all_to_all splits dim 0 by destination, so the qkv projection is computed transposed,
# ``send_Ct = w_send @ x.T``, with ``w_send`` the rows of ``[wq; wk; wv]`` ordered by destination
# rank j: the query heads j computes on, then the KV heads they read (k rows, then v rows). A KV
# head read by several ranks (nkv < ws, or GQA groups cut by a rank or tile boundary) is sent to
# each of them; autograd of the row selection sums the copies' gradients. Every rank receives
# ``[ws(source), nh + 2*hk, d, b, s]`` (all S positions, source rank = sequence block) and the core
# puts it in ``[b, S, heads, d]`` order (one copy, inside the core's graph). The core's output goes
# back as ``[ws(destination), nh, d, b, s]`` and arrives as ``oT_Ft``: the tile's features in the
# order of ``wo``'s columns (all of them, in order, for batch tiles), times this rank's tokens.
#
# [Note: tiles]
# Batch tiles when B > 1 (K <= B, ``torch.tensor_split`` sizes). With B == 1 the tiles are head
# groups (K <= hq): tile i computes local query heads ``tile_bounds(hq, K)[i]`` on every rank, with
# the KV heads those read (a KV head shared by two groups travels with both), and y is the sum
# over the tiles of their heads' ``o_h @ wo_h.T``. Both cases run the same program.


@dataclass(frozen=True)
class Route:
    """Where one tile's heads travel; the same local head range ``heads`` on every rank
    ([Note: send layout]). Row and column lists are host tuples; indexed on the device by the layer."""

    heads: Tuple[int, int]
    send_rows: Tuple[int, ...]  # rows of [wq; wk; wv], grouped by destination rank
    in_splits: Tuple[int, ...]  # rows sent to each rank
    recv_rows: int  # rows received from each rank: (nh + 2*hk) * d
    nh: int
    hk: int
    kv_index: Optional[Tuple[int, ...]]  # local KV head of each local query head, if not plain GQA
    o_cols: Optional[Tuple[int, ...]]  # the columns of wo the tile's features are; None: all, in order


def route_of(nq: int, nkv: int, d: int, ws: int, rank: int, h0: int, h1: int) -> Route:
    """The route of local query heads ``h0..h1-1`` (of every rank) for ``rank``."""
    hq, group = nq // ws, nq // nkv

    def q_of(j):
        return range(j * hq + h0, j * hq + h1)

    def kv_of(j):
        return sorted({h // group for h in q_of(j)})

    def rows(base, heads):
        return [base + h * d + i for h in heads for i in range(d)]

    send, splits = [], []
    for j in range(ws):
        q, kv = q_of(j), kv_of(j)
        send += rows(0, q) + rows(nq * d, kv) + rows((nq + nkv) * d, kv)
        splits.append((len(q) + 2 * len(kv)) * d)
    mine = kv_of(rank)
    nh, hk = h1 - h0, len(mine)
    local = [mine.index(h // group) for h in q_of(rank)]
    plain = nh % hk == 0 and local == [i // (nh // hk) for i in range(nh)]  # SDPA's enable_gqa grouping
    o_cols = None if (h0, h1) == (0, hq) else tuple(c for j in range(ws) for c in rows(0, q_of(j)))
    return Route((h0, h1), tuple(send), tuple(splits), (nh + 2 * hk) * d, nh, hk,
                  None if plain else tuple(local), o_cols)


class UlyssesCall(LayerCall):
    """Everything one call needs besides the differentiable tensors (passed through the Function)."""

    def __init__(self, layer, plan: TilePlan, save: bool, streams, cos_sin,
                 tiles: List[Tuple[int, int, int]], routes: List[Route], device):
        super().__init__(layer.group, plan, save, streams, layer.launch_log)
        self.ws, self.d = layer.world_size, layer.head_dim
        self.causal, self.scale = layer.causal, layer.softmax_scale
        self.dropout_p = layer.dropout_p if layer.training else 0.0
        self.cos_sin = cos_sin
        self.tiles, self.routes = tiles, routes  # tiles: (b0, b1, route index)
        self.kv_index = [layer._index(r, "kv_index", device) for r in routes]
        self.by_heads = len(routes) > 1  # head-group tiles: one route per tile
        self.s = 0
        self.norms: list = []  # q_norm, k_norm as the core uses them (detached leaves when saving)

    def core(self, recv_Rt: torch.Tensor, tile: int) -> torch.Tensor:
        """``o_Ft`` (grouped by destination rank) of one tile's received ``recv_Rt``."""
        b0, b1, ri = self.tiles[tile]
        r, ws, d, s, b = self.routes[ri], self.ws, self.d, self.s, b1 - b0
        qkv = recv_Rt.view(ws, r.nh + 2 * r.hk, d, b, s).permute(3, 0, 4, 1, 2).reshape(b, ws * s, -1, d)
        q, k, v = qkv.split([r.nh, r.hk, r.hk], dim=2)
        if self.kv_index[ri] is not None:  # KV heads in query-head order (not SDPA's grouping)
            k, v = k.index_select(2, self.kv_index[ri]), v.index_select(2, self.kv_index[ri])
        cs = self.cos_sin
        if cs is not None and cs[0].shape[0] != 1:
            cs = (cs[0][b0:b1], cs[1][b0:b1])
        q_norm, k_norm = self.norms if self.norms else (None, None)
        o = attention(q, k, v, cos_sin=cs, q_norm=q_norm, k_norm=k_norm, causal=self.causal, scale=self.scale,
                      dropout_p=self.dropout_p)
        return o.reshape(b, ws, s, r.nh * d).permute(1, 3, 0, 2).reshape(ws * r.nh * d, b * s)

    def splits(self, tile: int):
        """(send splits, receive splits) of the qkv all-to-all and of the output all-to-all."""
        r = self.routes[self.tiles[tile][2]]
        o = (r.nh * self.d,) * self.ws
        return (r.in_splits, (r.recv_rows,) * self.ws), (o, o)


def _mm_into(started: set, key, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` the first time ``key`` is seen in this call, ``out += a @ b`` after."""
    if key in started:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)
        started.add(key)


def ulysses_forward_program(c: UlyssesCall, w_send, b_send, w_o) -> TileProgram:
    started: set = set()

    def qkv(env):
        ri = c.tiles[env["tile"]][2]
        x = env["x"] if c.save else env.pop("x")
        w, bias = w_send[ri], b_send[ri]
        send = torch.mm(w, x.t()) if bias is None else torch.addmm(bias[:, None], w, x.t())
        (ins, outs), _ = c.splits(env["tile"])
        env["send"] = (send, ins, outs)

    def core(env):
        recv = env.pop("recv")
        if c.save:  # record the core's graph for the backward (SDPA's own saved tensors)
            leaf = recv.requires_grad_()
            with recording_graph():  # [Note: per-tile graphs]
                o = c.core(leaf, env["tile"])
            env["graph"] = (leaf, o)
            o = o.detach()
        else:
            o = c.core(recv, env["tile"])
        _, (ins, outs) = c.splits(env["tile"])
        env["o_send"] = (o, ins, outs)

    def out_proj(env):
        b0, b1, ri = c.tiles[env["tile"]]
        oT = env["oT"] if c.save else env.pop("oT")
        _mm_into(started, (b0, b1), env["y_out"], oT.t(), w_o[ri].t())

    ops = (compute("qkv", qkv), comm("a2a_qkv", "all_to_all", src="send"), wait("a2a_qkv", dst="recv"),
           compute("core", core), comm("a2a_o", "all_to_all", src="o_send"), wait("a2a_o", dst="oT"),
           compute("out_proj", out_proj, chain="y" if c.by_heads else None))
    return TileProgram("ulysses", ops)


def ulysses_backward_program(c: UlyssesCall, w_send, w_o, grads: dict) -> TileProgram:
    started: set = set()
    chain_w = None if c.by_heads else "w"  # batch tiles accumulate into one weight gradient

    def dgrad_o(env):
        ri = c.tiles[env["tile"]][2]
        _, (ins, outs) = c.splits(env["tile"])
        env["do"] = (torch.mm(w_o[ri].t(), env["dy"].t()), outs, ins)

    def wgrad_o(env):
        ri = c.tiles[env["tile"]][2]
        _mm_into(started, ("wo", ri), grads["wo"][ri], env["dy"].t(), env.pop("oT").t())
        del env["dy"]

    def core_bwd(env):
        leaf, o = env.pop("graph")
        got = torch.autograd.grad(o, [leaf, *c.norms], env.pop("dout"), retain_graph=keeps_graph())
        grads["norms"].append(got[1:])
        (ins, outs), _ = c.splits(env["tile"])
        env["drecv"] = (got[0], outs, ins)

    def dgrad_x(env):
        b0, b1, ri = c.tiles[env["tile"]]
        _mm_into(started, ("x", b0, b1), env["dx_out"], env["dsend"].t(), w_send[ri])

    def wgrad_qkv(env):
        ri = c.tiles[env["tile"]][2]
        dsend, x = env.pop("dsend"), env.pop("x")
        first = ("w", ri) not in started
        _mm_into(started, ("w", ri), grads["w"][ri], dsend, x)
        if grads["b"][ri] is not None:
            if first:
                torch.sum(dsend, 1, out=grads["b"][ri])
            else:
                grads["b"][ri].add_(dsend.sum(1))

    ops = (compute("dgrad_o", dgrad_o), comm("a2a_do", "all_to_all", src="do"),
           compute("wgrad_o", wgrad_o, chain=chain_w and "wo"), wait("a2a_do", dst="dout"),
           compute("core_bwd", core_bwd), comm("a2a_dqkv", "all_to_all", src="drecv"), wait("a2a_dqkv", dst="dsend"),
           compute("dgrad_x", dgrad_x, chain="dx" if c.by_heads else None),
           compute("wgrad_qkv", wgrad_qkv, chain=chain_w))
    return TileProgram("ulysses_bwd", ops)


class UlyssesTiles(torch.autograd.Function):
    """Tiled, overlapped Ulysses attention without ``bo`` (added outside). Inputs: rows of x in
    batch-major order ``[B*s, H]``, the qk-norm weights (or None), the call, then per route
    ``w_send, b_send, wo_HF`` ([Note: send layout])."""

    @staticmethod
    def forward(ctx, x_TH, q_norm, k_norm, call: UlyssesCall, *weights):
        w_send, b_send, w_o = weights[0::3], weights[1::3], weights[2::3]
        s = call.s
        norms = [p for p in (q_norm, k_norm) if p is not None]
        call.norms = [p.detach().requires_grad_() for p in norms] if call.save else norms
        out_TH = x_TH.new_empty(x_TH.shape)
        envs = [{"tile": i, "x": x_TH[b0 * s:b1 * s], "y_out": out_TH[b0 * s:b1 * s]}
                for i, (b0, b1, _) in enumerate(call.tiles)]
        program = ulysses_forward_program(call, w_send, b_send, w_o)
        run_tiles(call, round_robin(program, len(envs)), envs, "ulysses", backward=False, device=x_TH.device)
        if call.save:
            ctx.graphs = [e["graph"] for e in envs]
            ctx.save_for_backward(x_TH, *w_send, *w_o, *[e["oT"] for e in envs])
            ctx.call, ctx.has_b = call, [b is not None for b in b_send]
        return out_TH

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_TH):
        c: UlyssesCall = ctx.call
        x_TH, *rest = ctx.saved_tensors
        n_r, s = len(c.routes), c.s
        w_send, w_o, oTs = rest[:n_r], rest[n_r:2 * n_r], rest[2 * n_r:]
        graphs = take(ctx, "graphs")
        dy_TH = dy_TH.contiguous()
        dx_TH = torch.empty_like(x_TH)
        grads = {"w": [torch.empty_like(w) for w in w_send], "wo": [torch.empty_like(w) for w in w_o],
                 "b": [w.new_empty(w.shape[0]) if has else None for w, has in zip(w_send, ctx.has_b)],
                 "norms": []}
        envs = [{"tile": i, "x": x_TH[b0 * s:b1 * s], "dy": dy_TH[b0 * s:b1 * s], "dx_out": dx_TH[b0 * s:b1 * s],
                 "oT": oTs[i], "graph": graphs[i]} for i, (b0, b1, _) in enumerate(c.tiles)]
        del graphs, oTs, rest
        program = ulysses_backward_program(c, w_send, w_o, grads)
        run_tiles(c, round_robin(program, len(envs)), envs, "ulysses_bwd", backward=True, device=dy_TH.device)
        d_norms = [sum(g[i] for g in grads["norms"]) for i in range(len(c.norms))] or [None, None]
        per_route = [g for i in range(n_r) for g in (grads["w"][i], grads["b"][i], grads["wo"][i])]
        return (dx_TH, d_norms[0], d_norms[1], None, *per_route)

