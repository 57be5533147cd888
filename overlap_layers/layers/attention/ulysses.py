"""Ulysses sequence parallelism: attention over the whole sequence with the heads split over the
group, reached by an all-to-all before and after the attention core. The batch (or, for batch 1,
the heads) is cut into tiles so each tile's all-to-alls hide under other tiles' compute.

Reference (what :class:`UlyssesAttention` must equal, up to rounding), with dense weights and the
full sequence ``x [B, S, H]``::

    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv      # heads of d = head_dim
    o = attention_core.attention(q, k, v, ...)                 # qk-norm, RoPE, SDPA with GQA
    y = o @ wo.T + bo

Rank r holds positions ``r*s .. (r+1)*s - 1`` of x and y (``s = S/ws``) and every weight whole.
Unoverlapped, per rank (DeepSpeed-Ulysses)::

    qkv = x_local @ [wq; wk; wv].T               # every head, this rank's s positions
    qkv = all_to_all(qkv)                        # rank r's nq/ws query heads and the KV heads
                                                 # they read, all S positions
    o = attention_core.attention(q, k, v, ...)   # RoPE with the global positions
    o = all_to_all(o)                            # every head, this rank's s positions
    y_local = o @ wo.T + bo

Legend: B batch, s seq_local, S = ws*s, H hidden, d head_dim, nq / nkv query / KV heads,
hq = nq/ws query heads per rank. Per tile: b its batch rows, t = b*s its local tokens, nh its
query heads on each rank (hq for batch tiles), hk the KV heads this rank's nh query heads read,
C = sum_j (nh + 2*hk_j)*d the qkv rows this rank sends (grouped by destination j),
R = ws*(nh + 2*hk)*d the rows it receives, F = ws*nh*d the tile's attention features.

``_UlyssesTiles`` (per rank, per tile; A2A = all_to_all, ``(+)=``: tiles over heads add up):

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

import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ...config import OverlapConfig
from ...planning.calls import LayerCall, run_tiles
from ...planning.checks import check_dtype, resolve_config
from ...planning.dtensor import Layout
from ...planning.entry import planned_forward
from ...planning.first_order import first_order, keeps_graph, take
from ...planning.layer_spec import TiledLayer
from ...planning.plan import TilePlan
from ...planning.planner import LayerPlanner
from ...planning.tiling import tile_bounds
from ...runtime import resolve_group
from ...schedule import TileProgram, comm, compute, round_robin, wait
from ..common.init import init_linear_
from ..common.tp_program import recording_graph
from .common import (INPUT_ERRORS, PARAMS, WHAT, call_with_positions, check_args, check_dense,
                     compiled_position_args, input_error, position_kwargs, register_params)
from .common import cos_sin as cos_sin_of
from .core import attention
from .ulysses_cost import UlyssesCostModel

# Error codes carried in the agreement gather, so every rank raises when one rank's input is bad.
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
class _Route:
    """Where one tile's heads travel; the same local head range ``heads`` on every rank
    ([Note: send layout]). Row and column lists are host tuples; see ``_RouteTensors``."""

    heads: Tuple[int, int]
    send_rows: Tuple[int, ...]  # rows of [wq; wk; wv], grouped by destination rank
    in_splits: Tuple[int, ...]  # rows sent to each rank
    recv_rows: int  # rows received from each rank: (nh + 2*hk) * d
    nh: int
    hk: int
    kv_index: Optional[Tuple[int, ...]]  # local KV head of each local query head, if not plain GQA
    o_cols: Optional[Tuple[int, ...]]  # the columns of wo the tile's features are; None: all, in order


def _route(nq: int, nkv: int, d: int, ws: int, rank: int, h0: int, h1: int) -> _Route:
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
    return _Route((h0, h1), tuple(send), tuple(splits), (nh + 2 * hk) * d, nh, hk,
                  None if plain else tuple(local), o_cols)


class _Call(LayerCall):
    """Everything one call needs besides the differentiable tensors (passed through the Function)."""

    def __init__(self, layer: "UlyssesAttention", plan: TilePlan, save: bool, streams, cos_sin,
                 tiles: List[Tuple[int, int, int]], routes: List[_Route], device):
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


def _forward_program(c: _Call, w_send, b_send, w_o) -> TileProgram:
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


def _backward_program(c: _Call, w_send, w_o, grads: dict) -> TileProgram:
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


class _UlyssesTiles(torch.autograd.Function):
    """Tiled, overlapped Ulysses attention without ``bo`` (added outside). Inputs: rows of x in
    batch-major order ``[B*s, H]``, the qk-norm weights (or None), the call, then per route
    ``w_send, b_send, wo_HF`` ([Note: send layout])."""

    @staticmethod
    def forward(ctx, x_TH, q_norm, k_norm, call: _Call, *weights):
        w_send, b_send, w_o = weights[0::3], weights[1::3], weights[2::3]
        s = call.s
        norms = [p for p in (q_norm, k_norm) if p is not None]
        call.norms = [p.detach().requires_grad_() for p in norms] if call.save else norms
        out_TH = x_TH.new_empty(x_TH.shape)
        envs = [{"tile": i, "x": x_TH[b0 * s:b1 * s], "y_out": out_TH[b0 * s:b1 * s]}
                for i, (b0, b1, _) in enumerate(call.tiles)]
        program = _forward_program(call, w_send, b_send, w_o)
        run_tiles(call, round_robin(program, len(envs)), envs, "ulysses", backward=False, device=x_TH.device)
        if call.save:
            ctx.graphs = [e["graph"] for e in envs]
            ctx.save_for_backward(x_TH, *w_send, *w_o, *[e["oT"] for e in envs])
            ctx.call, ctx.has_b = call, [b is not None for b in b_send]
        return out_TH

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_TH):
        c: _Call = ctx.call
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
        program = _backward_program(c, w_send, w_o, grads)
        run_tiles(c, round_robin(program, len(envs)), envs, "ulysses_bwd", backward=True, device=dy_TH.device)
        d_norms = [sum(g[i] for g in grads["norms"]) for i in range(len(c.norms))] or [None, None]
        per_route = [g for i in range(n_r) for g in (grads["w"][i], grads["b"][i], grads["wo"][i])]
        return (dx_TH, d_norms[0], d_norms[1], None, *per_route)


class UlyssesAttention(TiledLayer, nn.Module):
    """Drop-in attention with Ulysses sequence parallelism; equals the module docstring's reference.

    Input and output ``[batch, seq_local, hidden]``: rank r holds positions ``r*seq_local ..``;
    every rank must pass the same ``seq_local`` (checked: ValueError on every rank otherwise).
    ``position_ids [batch or 1, seq]`` and ``position_embeddings = (cos, sin)``, each
    ``[batch or 1, seq, head_dim]``, describe the *global* sequence (``seq = seq_local *
    world_size``) and must be the same on every rank; ``position_embeddings`` overrides
    ``rope_theta``; ``rope_theta=None`` disables RoPE. ``attention_mask`` must be None (causal or
    full attention via ``causal``).

    Parameters, whole on every rank: ``wq [nq*d, H]``, ``wk``/``wv [nkv*d, H]``, ``wo [H, nq*d]``
    (``nn.Linear`` layouts), biases ``bq``, ``bk``, ``bv``, ``bo`` and ``q_norm``, ``k_norm [d]``
    (Qwen3-style RMSNorm per head before RoPE). ``num_heads`` must be divisible by the group size
    and by ``num_kv_heads``; each rank attends with ``num_heads/ws`` query heads and receives the KV
    heads they read (replicated where ``num_kv_heads`` is smaller than the group, or does not split
    evenly). Each rank's backward only sees its own tokens, so every parameter's ``.grad`` holds
    *this rank's partial*: the gradient of the layer is their sum over the group. A data-parallel
    wrapper over the group (DDP / FSDP across the ranks that share the sequence) does that
    reduction; note DDP averages, which is the gradient of the mean of per-rank mean losses.

    ``num_tiles`` (overrides ``config.num_tiles``) is K, or "auto" (planned per (batch, seq_local)
    like the other layers, then verified on the first calls). Batch tiles for batch > 1, head groups
    for batch 1 ([Note: tiles]); ``layer.plan`` tells the last call's K and ``layer.tile_by``
    ("batch" or "heads") what it tiled. Set ``launch_log`` to a list to record the launch order.
    """

    _graphable = False  # config.graph_calls: no replay of its calls has been checked on GPUs yet

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None, *, group=None,
                 mesh=None, axis=None, head_dim: Optional[int] = None, rope_theta: Optional[float] = 10000.0,
                 causal: bool = True, bias: bool = False, qk_norm: bool = False,
                 softmax_scale: Optional[float] = None, dropout_p: float = 0.0, num_tiles=None,
                 config: Optional[OverlapConfig] = None, dtype=None, device=None):
        super().__init__()
        num_kv_heads, head_dim = check_args(hidden_size, num_heads, num_kv_heads, head_dim, rope_theta,
                                            softmax_scale, dropout_p)
        self.config, self.num_tiles = resolve_config(config, num_tiles)
        check_dtype(dtype)
        self.group = resolve_group(group, mesh, axis)
        ws = dist.get_world_size(self.group)
        if num_heads % ws:
            raise ValueError(f"num_heads={num_heads} must be divisible by the group size {ws} "
                             f"(each rank attends with num_heads/{ws} heads)")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        self.world_size, self.rank = ws, dist.get_rank(self.group)
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden_size, num_heads, num_kv_heads, head_dim
        self.rope_theta, self.causal, self.bias, self.qk_norm = rope_theta, bool(causal), bool(bias), bool(qk_norm)
        self.softmax_scale, self.dropout_p = softmax_scale, dropout_p
        register_params(self, hidden=hidden_size, q_heads=num_heads, kv_heads=num_kv_heads, head_dim=head_dim,
                        bias=bias, qk_norm=qk_norm, dtype=dtype, device=device)
        self.tile_by = "batch"  # what the last call tiled
        self.launch_log: Optional[list] = None
        self.planner = LayerPlanner(self, self.config)  # plans, agrees and runs each call: planning/planner.py
        self._init_caches()
        self.reset_parameters()
        self._as_dtensors(mesh, axis)

    def _init_caches(self) -> None:
        self._routes: dict = {}  # (h0, h1) -> _Route; rank-dependent, but never decides a collective
        self._indices: dict = {}  # (heads, field, device) -> index tensor, so a call copies no index to the device

    # ----------------------------------------------------------------- weights
    def _dtensor_layouts(self) -> Dict[str, Layout]:
        """[Note: DTensor parameters] (``planning/dtensor.py``): whole on every rank."""
        return {n: Layout(Replicate()) for n in PARAMS}

    def _dtensor_input_placements(self) -> tuple:
        """[Note: DTensor inputs]: the sequence shard."""
        return (Shard(1),)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise as ``nn.Linear`` layers q, k, v, o (weight then bias each, in that order)
        would under the same seed; norms to ones. The same on every rank given the same seed."""
        if self.wq.device.type == "meta":
            return
        for w, b in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv), (self.wo, self.bo)):
            init_linear_(w, b)
        if self.q_norm is not None:
            self.q_norm.fill_(1.0)
            self.k_norm.fill_(1.0)

    @classmethod
    def from_dense(cls, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, *, num_heads: int,
                   num_kv_heads: Optional[int] = None, bq=None, bk=None, bv=None, bo=None, q_norm=None, k_norm=None,
                   group=None, mesh=None, axis=None, rope_theta: Optional[float] = 10000.0, causal: bool = True,
                   softmax_scale: Optional[float] = None, dropout_p: float = 0.0, num_tiles=None,
                   config: Optional[OverlapConfig] = None) -> "UlyssesAttention":
        """From dense ``nn.Linear``-layout weights (copied whole): ``wq [nq*d, H]``,
        ``wk``/``wv [nkv*d, H]``, ``wo [H, nq*d]``; ``bq``, ``bk``, ``bv`` all or none, ``bo``
        independently (Qwen2 has qkv biases only); ``q_norm``/``k_norm [d]`` both or neither."""
        H, d, num_kv_heads = check_dense(wq, wk, wv, wo, num_heads=num_heads, num_kv_heads=num_kv_heads, bq=bq,
                                         bk=bk, bv=bv, bo=bo, q_norm=q_norm, k_norm=k_norm)
        layer = cls(H, num_heads, num_kv_heads, group=resolve_group(group, mesh, axis), head_dim=d,
                    rope_theta=rope_theta, causal=causal, bias=bq is not None, qk_norm=q_norm is not None, softmax_scale=softmax_scale,
                    dropout_p=dropout_p, num_tiles=num_tiles, config=config, dtype=wq.dtype, device="meta")
        if (bo is not None) != layer.bias:  # qkv biases without bo, or bo alone
            layer.bo = nn.Parameter(torch.empty(H, dtype=wq.dtype, device="meta")) if bo is not None else None
        layer.to_empty(device=wq.device)
        with torch.no_grad():
            for name, t in (("wq", wq), ("wk", wk), ("wv", wv), ("wo", wo), ("bq", bq), ("bk", bk), ("bv", bv),
                            ("bo", bo), ("q_norm", q_norm), ("k_norm", k_norm)):
                if t is not None:
                    getattr(layer, name).copy_(t)
        layer._as_dtensors(mesh, axis)
        return layer

    @torch.no_grad()
    def to_dense(self) -> dict:
        """The dense weights (keys of :meth:`from_dense`; None where absent); copies, rank-local."""
        names = PARAMS
        return {n: (self._local(n).detach().clone() if getattr(self, n) is not None else None) for n in names}

    # ----------------------------------------------------------------- forward
    def _units(self, batch: int) -> int:
        """What K is capped by: the batch, or the local query heads for batch 1 ([Note: tiles])."""
        return batch if batch > 1 else self.num_heads // self.world_size

    def _check_pin(self, plan: TilePlan) -> None:
        super()._check_pin(plan)
        if plan.regather or plan.buckets_fwd or plan.buckets_bwd:
            raise ValueError(f"plan={plan!r}: Ulysses has no re-gather and its all-to-alls are not bucketed")

    # ----------------------------------------------------------------- planning hooks (TiledLayer)
    @property
    def _weight(self) -> torch.Tensor:
        return self.wq

    def _plan_key(self, shape: tuple, dtype: torch.dtype, save: bool) -> tuple:
        return (shape[0], shape[1], dtype, save)

    def _tile_units(self, shape: tuple) -> int:
        return self._units(shape[0])

    def _cost_model(self, key: tuple, hw) -> UlyssesCostModel:
        batch, s, dtype = key[0], key[1], key[2]
        return UlyssesCostModel(batch=batch, seq_local=s, world_size=self.world_size, hidden=self.hidden_size,
                                heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                elt=torch.tensor([], dtype=dtype).element_size(), causal=self.causal, model=hw)

    def _programs(self, k: int, save: bool, regather: bool):
        call = _Call(self, TilePlan(k), save, None, None, [], [], self.wq.device)
        return _forward_program(call, None, None, None), _backward_program(call, None, None, {})

    def _op_setups(self, cm: UlyssesCostModel, dtype: torch.dtype) -> dict:
        """The attention core (forward, and backward of a recorded graph) per tile shape."""
        dev, S, d = self.wq.device, cm.ws * cm.s, self.head_dim
        norms = (self.q_norm.detach().to(dtype), self.k_norm.detach().to(dtype)) if self.qk_norm else (None, None)

        def setup(name, b, nh):
            hk = cm._hk(nh)
            q = torch.randn(b, S, nh, d, dtype=dtype, device=dev)
            k, v = (torch.randn(b, S, hk, d, dtype=dtype, device=dev) for _ in range(2))
            cs = cos_sin_of(self.rope_theta, d, S, dev, dtype, None, None)

            def core():
                return attention(q, k, v, cos_sin=cs, q_norm=norms[0], k_norm=norms[1], causal=self.causal,
                                 scale=self.softmax_scale)
            if name == "core":
                return core
            for t in (q, k, v):
                t.requires_grad_()
            with torch.enable_grad():
                o = core()
            do = torch.randn_like(o)
            return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

        return {key: (lambda spec=spec: setup(*spec)) for key, spec in cm.core_ops().items()}

    def _config_digest(self) -> int:
        """What every rank's layer must agree on for the all-to-alls to match."""
        key = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.causal, self.bias,
               self.qk_norm, self.bo is not None)
        return zlib.crc32(repr(key).encode())

    _compiled_extras = staticmethod(compiled_position_args)  # [Note: compiled calls]
    _compiled_kwargs = staticmethod(position_kwargs)

    @planned_forward  # torch.compile: one op; a DTensor x: its local tensor (planning/entry.py)
    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None, position_embeddings=None,
                attention_mask=None) -> torch.Tensor:
        err = input_error(x, hidden_size=self.hidden_size, weight=self._local("wq"), seq_factor=self.world_size,
                          head_dim=self.head_dim, position_ids=position_ids, position_embeddings=position_embeddings,
                          attention_mask=attention_mask, causal=self.causal)
        agreed = self.planner.agree(x, err, INPUT_ERRORS, WHAT, extra=(self._config_digest(),),
                                    extra_names=("layer config",), shape_names=("batch", "seq_local", "hidden"))
        return call_with_positions(self, x, agreed, position_ids, position_embeddings)

    def _route_of(self, h0: int, h1: int) -> _Route:
        if (h0, h1) not in self._routes:
            self._routes[(h0, h1)] = _route(self.num_heads, self.num_kv_heads, self.head_dim, self.world_size,
                                            self.rank, h0, h1)
        return self._routes[(h0, h1)]

    def _index(self, route: _Route, name: str, device) -> Optional[torch.Tensor]:
        """``route.<name>`` as an index tensor on ``device`` (None stays None), made once."""
        key = (route.heads, name, device)
        if key not in self._indices:
            idx = getattr(route, name)
            self._indices[key] = torch.tensor(idx, device=device) if idx is not None else None
        return self._indices[key]

    def _tiles(self, batch: int, plan: TilePlan):
        """(tiles as (b0, b1, route index), routes); see [Note: tiles]."""
        hq = self.num_heads // self.world_size
        if batch == 1 and plan.num_tiles > 1:
            bounds = tile_bounds(hq, plan.num_tiles)
            return [(0, batch, i) for i in range(len(bounds))], [self._route_of(a, b) for a, b in bounds]
        return [(b0, b1, 0) for b0, b1 in tile_bounds(batch, plan.num_tiles)], [self._route_of(0, hq)]

    def _run(self, x, plan: TilePlan, save: bool, position_ids, position_embeddings, trial=None,
             trace=None) -> torch.Tensor:
        dev = x.device.type
        x, (wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm) = self._call_tensors(x, PARAMS)
        B, s, H = x.shape
        tiles, routes = self._tiles(B, plan)
        self.tile_by = "heads" if len(routes) > 1 else "batch"
        with torch.autocast(dev, enabled=False), torch.set_grad_enabled(save):
            w_qkv = torch.cat([wq, wk, wv])
            b_qkv = torch.cat([bq, bk, bv]) if bq is not None else None
            weights = []
            for r in routes:  # [Note: send layout]
                rows = self._index(r, "send_rows", x.device)
                weights += [w_qkv.index_select(0, rows), b_qkv.index_select(0, rows) if b_qkv is not None else None,
                            wo if r.o_cols is None else wo.index_select(1, self._index(r, "o_cols", x.device))]
            call = _Call(self, plan, save, self.planner.streams.get(x.device, min(plan.num_tiles, plan.num_streams)),
                         cos_sin_of(self.rope_theta, self.head_dim, s * self.world_size, x.device, x.dtype, position_ids,
                                    position_embeddings),
                         tiles, routes, x.device)
            call.s, call.trial, call.trace = s, trial, trace
            y_TH = _UlyssesTiles.apply(x.reshape(B * s, H).contiguous(), q_norm, k_norm, call, *weights)
            if bo is not None:
                y_TH = y_TH + bo
        return y_TH.view(B, s, H)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, rope_theta={self.rope_theta}, "
                f"qk_norm={self.qk_norm}, world_size={self.world_size}, num_tiles={self.num_tiles!r}")
