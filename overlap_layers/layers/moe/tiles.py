"""The MoE's exchange cut into batch tiles (``plan.decomposition == "batch"``): each tile's
dispatch and combine all-to-alls hide under another tile's experts, in forward and backward.

Reference (what :class:`ExpertExchange` must equal): the local experts' output of every
assignment row this rank's experts receive, returned to its source in the source's send order
(``layers/moe/layer.py``'s module docstring). Per rank, per tile (A2A = uneven
all_to_all_single):

=========  ==========================================================================
forward    xr = A2A(x_perm tile rows) (rows grouped by source, then by local expert);
           y_g = experts(regroup(xr)) (graph kept);  y_perm tile rows = A2A(ungroup(y_g))
backward   dyr = A2A(dy_perm tile rows);  dx_g, dw_in, dw_out = experts'(regroup(dyr));
           dx_perm tile rows = A2A(ungroup(dx_g))
=========  ==========================================================================

The dispatch rows are ``x_perm = x[order // k]`` (:class:`Dispatch`: its gradient gathers each
token's k rows by ``pos`` and sums them, no atomic scatter-add); the combine puts ``y_perm``
back in token-major order with a gather (:class:`PermuteRows`: a permutation, whose gradient is
the inverse gather). Each tile's split sizes are host lists, read once per call from every
rank's counts ([Note: MoE host syncs] in ``layers/moe/eager.py``); the index regrouping each
tile's received rows by local expert, its inverse and the grouped-GEMM offsets are computed on
the device before that read (:func:`tile_tensors`).
"""
from __future__ import annotations

from typing import List

import torch

from ...planning.calls import LayerCall, run_tiles
from ...planning.first_order import first_order, keeps_graph, take
from ...planning.plan import TilePlan
from ...schedule import TileProgram, comm, compute, round_robin, wait
from ..common.tp_program import Accumulator, recording_graph
from .experts import experts_forward, grouped_gemm_ok


def regroup_index(counts: torch.Tensor, size: int) -> torch.Tensor:
    """Rows laid out tile by tile, each tile grouped by ``a`` then ``b`` (``counts [K, A, B]`` rows
    per group) -> for each position of the same rows grouped by tile, then ``b``, then ``a``, the
    row it takes, counted from its tile's first row. ``size`` is any bound on ``counts.sum()``
    known to the host (positions past the sum hold rows in range but are meaningless), so the
    device never syncs. The inverse is ``regroup_index(counts.transpose(1, 2), size)``."""
    K = counts.shape[0]
    lengths = counts.transpose(1, 2).reshape(-1)  # groups in (tile, b, a) order
    ends = torch.cumsum(lengths, 0)
    flat = counts.reshape(-1)
    tile_rows = counts.sum((1, 2))
    src_start = (torch.cumsum(flat, 0) - flat).view_as(counts) - (torch.cumsum(tile_rows, 0) - tile_rows).view(K, 1, 1)
    shift = src_start.transpose(1, 2).reshape(-1) - (ends - lengths)
    p = torch.arange(size, device=counts.device)
    group = torch.searchsorted(ends, p, right=True).clamp_(max=lengths.numel() - 1)
    return p + shift[group]


class PermuteRows(torch.autograd.Function):
    """``x[index]`` for a permutation ``index`` of x's rows (``inverse`` its inverse): the gradient
    is a gather too, not an atomic scatter."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class Dispatch(torch.autograd.Function):
    """The assignment rows ``x[order // k]`` (``order`` sorts the token-major assignments into
    send order; ``pos`` is its inverse). The gradient of each token sums its k rows, by a gather
    and a sum rather than an atomic scatter-add."""

    @staticmethod
    def forward(ctx, x, order, pos, k: int):
        ctx.save_for_backward(pos)
        ctx.k = k
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        T = pos.numel() // ctx.k
        return grad.index_select(0, pos).view(T, ctx.k, grad.shape[1]).sum(1), None, None, None


class Tile:
    """What one tile's exchange needs ([Note: MoE host syncs]): split sizes and rows per local
    expert (host lists), and on the device the index grouping the received rows by local expert,
    its inverse, and the grouped-GEMM offsets."""

    def __init__(self, send: List[int], recv: List[int], sizes: List[int], index, inverse, offs):
        self.send, self.recv, self.sizes = send, recv, sizes
        self.index, self.inverse, self.offs = index, inverse, offs


def tile_tensors(counts: torch.Tensor, bound: int):
    """The device side of every tile, launched before the counts reach the host ([Note: MoE host
    syncs]): from ``counts [tile, source, local expert]`` (rows this rank receives; at most
    ``bound`` in all), the index grouping each tile's received rows by local expert, its inverse
    (both over all tiles, relative to each tile's first row) and the grouped-GEMM offsets
    ``[tile, El]``."""
    return (regroup_index(counts, bound), regroup_index(counts.transpose(1, 2), bound),
            torch.cumsum(counts.sum(1), 1).to(torch.int32))


def count_table(flat: List[int], ws: int, K: int) -> List[List[List[List[int]]]]:
    """Every rank's gathered counts, read on the host as one flat list, as nested lists
    ``[source][tile][destination][local expert]`` (plain Python: on the call's critical path,
    where tensor ops on the host cost more than the lists)."""
    El = len(flat) // (ws * K * ws)
    rows = [flat[i:i + El] for i in range(0, len(flat), El)]
    return [[rows[(s * K + t) * ws:(s * K + t + 1) * ws] for t in range(K)] for s in range(ws)]


def tiles_of(table, rank: int, index, inverse, offs) -> List[Tile]:
    """The tiles of one call from every rank's counts on the host (:func:`count_table`) and
    :func:`tile_tensors` of this rank's: host lists and views only, no launches (this runs
    between the counts' arrival and the first exchange)."""
    out, a = [], 0
    for t in range(len(table[0])):
        mine = [table[s][t][rank] for s in range(len(table))]  # [source][El]
        recv = [sum(r) for r in mine]
        b = a + sum(recv)
        out.append(Tile([sum(r) for r in table[rank][t]], recv, [sum(c) for c in zip(*mine)], index[a:b],
                         inverse[a:b], offs[t]))
        a = b
    return out


class TileCall(LayerCall):
    """Everything one call of ``layer`` (an ``OverlapMoE``) needs besides the differentiable tensors."""

    def __init__(self, layer, plan: TilePlan, save: bool, streams, tiles: List[Tile]):
        super().__init__(layer.group, plan, save, streams, layer.launch_log)
        self.activation = layer.activation
        self.tiles = tiles

    def experts(self, x_g: torch.Tensor, sizes: List[int], offs: torch.Tensor, w_in, w_out) -> torch.Tensor:
        """Rows grouped by local expert (``sizes`` rows each; ``offs`` their cumulative ends on the
        device) through their experts (:func:`~.experts.experts_forward`: one grouped GEMM per
        projection where :func:`grouped_gemm_ok`, else a GEMM pair per expert)."""
        return experts_forward(self.activation, grouped_gemm_ok(x_g, w_in, w_out), x_g, sizes, offs,
                               w_in.transpose(-2, -1), w_out.transpose(-2, -1))[0]


def forward_program(c: TileCall, w_in, w_out) -> TileProgram:
    def experts(env):
        t = env["tile"]
        tile = c.tiles[t]
        x_g = env.pop("xr").index_select(0, tile.index)
        if c.save:
            leaf = x_g.detach().requires_grad_()
            with recording_graph():  # [Note: per-tile graphs]
                y_g = c.experts(leaf, tile.sizes, tile.offs, w_in, w_out)
            env["graph"] = (leaf, y_g)
            y_g = y_g.detach()
        else:
            y_g = c.experts(x_g, tile.sizes, tile.offs, w_in, w_out)
        env["ys"] = (y_g.index_select(0, tile.inverse), tile.recv, tile.send)

    return TileProgram("moe", (comm("dispatch", "all_to_all", src="xs"), wait("dispatch", dst="xr"),
                               compute("experts", experts), comm("combine", "all_to_all", src="ys"),
                               wait("combine", dst="y")))


def backward_program(c: TileCall, w_in, w_out, accumulate: Accumulator) -> TileProgram:
    def experts_bwd(env):
        t = env["tile"]
        tile = c.tiles[t]
        leaf, y_g = env.pop("graph")
        dy_g = env.pop("dyr").index_select(0, tile.index)
        if y_g.requires_grad:
            dx_g, dwi, dwo = torch.autograd.grad(y_g, (leaf, w_in, w_out), dy_g, allow_unused=True,
                                                 retain_graph=keeps_graph())
        else:  # no rows reached this rank's experts in this tile
            dx_g, dwi, dwo = torch.zeros_like(leaf), None, None
        for key, g in (("w_in", dwi), ("w_out", dwo)):
            if g is not None:
                accumulate(key, lambda buf, g=g: buf.copy_(g), lambda buf, g=g: buf.add_(g))
        env["dxs"] = (dx_g.index_select(0, tile.inverse), tile.recv, tile.send)

    return TileProgram("moe_bwd", (comm("dispatch_bwd", "all_to_all", src="dys"), wait("dispatch_bwd", dst="dyr"),
                                   compute("experts_bwd", experts_bwd),
                                   comm("combine_bwd", "all_to_all", src="dxs"), wait("combine_bwd", dst="dx")))


def _in_order(parts: List[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """The tiles' rows in order (one tile: its tensor, not a copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else empty


class ExpertExchange(torch.autograd.Function):
    """``y_perm`` (expert outputs of the assignment rows ``x_perm``, same order) for the local
    experts ``w_in``, ``w_out``; see the module table."""

    @staticmethod
    def forward(ctx, x_perm, w_in, w_out, call: TileCall):
        offsets = [0]
        for tile in call.tiles:
            offsets.append(offsets[-1] + sum(tile.send))
        envs = [{"tile": t, "xs": (x_perm[offsets[t]:offsets[t + 1]], tile.send, tile.recv)}
                for t, tile in enumerate(call.tiles)]
        run_tiles(call, round_robin(forward_program(call, w_in, w_out), len(envs)), envs, "moe", backward=False,
                  device=x_perm.device)
        if call.save:
            ctx.graphs = [e["graph"] for e in envs]
            ctx.call, ctx.offsets = call, offsets
            ctx.save_for_backward(w_in, w_out)
        return _in_order([e["y"] for e in envs], x_perm.new_zeros((0, w_out.shape[1])))

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_perm):
        c: TileCall = ctx.call
        w_in, w_out = ctx.saved_tensors
        graphs, offs = take(ctx, "graphs"), ctx.offsets
        dy_perm = dy_perm.contiguous()
        grads = {"w_in": torch.zeros_like(w_in), "w_out": torch.zeros_like(w_out)}
        envs = [{"tile": t, "graph": graphs[t], "dys": (dy_perm[offs[t]:offs[t + 1]], c.tiles[t].send, c.tiles[t].recv)}
                for t in range(len(graphs))]
        del graphs
        run_tiles(c, round_robin(backward_program(c, w_in, w_out, Accumulator(grads)), len(envs)), envs, "moe_bwd",
                  backward=True, device=dy_perm.device)
        dx = _in_order([e["dx"] for e in envs], dy_perm.new_zeros(dy_perm.shape))
        return dx, grads["w_in"], grads["w_out"], None

