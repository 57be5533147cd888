"""Expert-parallel mixture of experts: route on the local tokens, dispatch by all-to-all, run the
local experts, combine by all-to-all; the tokens are cut into K tiles so one tile's exchanges
hide under another tile's experts, in forward and backward.

Reference (what :class:`OverlapMoE` must equal, up to rounding), per rank on its own tokens
``x [T, H]``, with all E experts' dense weights::

    p = softmax(x @ router_weight.T)               # in float32, or the input dtype if wider
    (w, e) = top-k of p per token                  # ties to the lower expert index
    w = w / sum(w)                                 # if normalize_topk
    drop assignments over capacity                 # capacity_factor c: per expert, at most
                                                   # ceil(c*T*k/E), by decreasing p, then token
    y = sum over kept (t, e, w) of w * expert_e(x_t) + shared_expert(x)
    expert_e(x) = act(x @ w_in[e].T) @ w_out[e].T   # act: swiglu (gate rows, then up), gelu, relu
    aux_loss = aux_loss_coef * E * sum_e f_e * P_e  # f_e = assignments to e / (T*k), P_e = mean p_e

Rank r holds experts ``r*E/ws ..`` (``w_in``, ``w_out``); the router and the shared expert are
replicated. Legend: T local tokens, N kept assignments, H hidden, E experts, El = E/ws local
experts, K tiles (of the local tokens; every rank runs K tiles, some possibly empty).

``_ExpertExchange`` (per rank, per tile; A2A = uneven all_to_all_single):

=========  ==========================================================================
forward    xr = A2A(x_perm tile rows) (rows grouped by source, then by local expert);
           y_g = experts(regroup(xr)) (graph kept);  y_perm tile rows = A2A(ungroup(y_g))
backward   dyr = A2A(dy_perm tile rows);  dx_g, dw_in, dw_out = experts'(regroup(dyr));
           dx_perm tile rows = A2A(ungroup(dx_g))
=========  ==========================================================================

With ``plan.decomposition == "rank"`` (one tile) the exchange is split by source rank instead
(``layers/moe/ranks.py``): the assignment rows go straight into a rank all-to-all's send buffer, each
source's rows run as they arrive, and the results come back in place, in send order.

Routing, capacity and the permutations stay outside, on the whole call: ``order`` sorts the
token-major assignments into send order (by tile, then expert, dropped ones last; for the rank
exchange by expert in its step order, this rank's own experts first) and ``pos`` is its inverse.
The dispatch rows are ``x_perm = x[order // k]`` (``Dispatch``: its gradient gathers each
token's k rows by ``pos`` and sums them, no atomic scatter-add); the combine puts
``y_perm`` back in token-major order with a gather (``PermuteRows``: a permutation, whose
gradient is the inverse gather) and weighs each token's k rows (``moe_combine.weigh_rows``: one
kernel each way, [Note: MoE weighted combine]) in autograd, so the router gets its gradient
through the weights (and the aux loss).

[Note: MoE host syncs]
An uneven all-to-all needs its split sizes on the host. All K tiles' send counts, per destination
rank and local expert, are computed at once from the routing (one count) and exchanged by one
small device all-gather over the group: one device-to-host copy per call, before any tile is
launched, so no tile's exchange waits on a sync and the backward reuses the same splits reversed
(no sync at all). The host waits for that copy only (``HostReader``: into pinned memory, then an
event on the current stream, which work launched after the copy does not delay), and everything
that does not need the sizes on the host is launched before the wait - the gather of the
assignment rows, the shared expert, and, from the gathered counts on the device, the
index that groups each tile's received rows by local expert, its inverse and the grouped-GEMM
offsets (sized by a bound the host knows: every rank's tokens times k, from the call's agreement).
Between the counts' arrival and the first exchange the host only slices those and builds lists
(plain Python lists: host tensor ops cost more there): that window is the GPU's one idle gap of
a call (about 0.2-0.3 ms on the H200 machines), which is why extra tiles, each adding two NCCL launches to the
host's path, rarely pay for the MoE over NVLink. The rank-chunk exchange takes its sizes from the
same read (one tile); its grouped-GEMM offsets (computed on the device from the gathered counts),
its peer signals (``ready()``) and, on the grouped-GEMM path, its first own piece (``launch_first``:
rows at a fixed place, own rows first) need no host sizes and are launched before the wait, so the
device computes while the host reads the counts and starts the exchange.

[Note: MoE no-grad combine]
A call without autograd needs no token-major rows (only the router's gradient reads them): its
combine is :func:`~.combine.combine_rows`, one kernel reading each token's k result rows where
they are in send order (the rank exchange's back rows, and its own pieces' results where their
GEMMs wrote them: ``moe_ranks.combine_back``; the tiles' ``y_perm``), a row past the kept count
(dropped by capacity) as 0. The grad-mode combine (a gather into token order, zero rows for the
dropped assignments, ``weigh_rows``) writes and reads the rows twice more; the rank exchange's gather
is the same kernel with unit weights and one row per output, and its backward sums each token's
k input-row gradients with it ([Note: MoE own results in place] in ``layers/moe/ranks.py``).
"""
from __future__ import annotations

import math
import zlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ...config import Decomposition, OverlapConfig, check_positive_int
from ...kernels import triton_gate
from ...kernels.routing import count, key_dtype
from ...kernels.send_rows import place_in_key_order
from ...planning.calls import LayerCall, apply_saving, run_tiles
from ...planning.checks import X_ERRORS, check_dtype, finite_number, resolve_config, x_error
from ...planning.dtensor import Layout
from ...planning.first_order import first_order, keeps_graph, take
from ...planning.entry import planned_forward
from ...planning.layer_spec import TiledLayer
from ...planning.plan import TilePlan
from ...planning.planner import LayerPlanner
from ...planning.rank_plans import RankChunkPlans
from ...runtime import resolve_group
from ...runtime.collectives import all_gather_single as all_gather_rows
from ...runtime.device_all_to_all import DeviceCountAllToAll, region_caps
from ...runtime.exchange import shared_workspace
from ...runtime.executor import profiler_range
from ...runtime.rank_all_to_all import CopyEngineAllToAll, PointToPointAllToAll
from ...runtime.streams import HostReader, peak_event
from ...schedule import TileProgram, comm, compute, round_robin, wait
from ..common.activations import ACTIVATIONS, act
from ..common.init import init_linear_
from ..common.tp_program import Accumulator, recording_graph
from .combine import combine_rows, weigh_rows
from .cost import MoECostModel
from .device import DevicePathRace, experts_by_source, rows_bound, slot_rows
from .ranks import RankCall, RankChunkExperts, combine_back, experts_forward, first_rows, launch_first, piece_offsets
from .routing import route_topk

_INPUT_ERRORS = {**X_ERRORS, 1: X_ERRORS[1] + " (batch*seq may be 0 and may differ across ranks)"}


class _HalfRouterLogits(torch.autograd.Function):
    """``x.float() @ w.float().T`` for bfloat16 or float16 ``x`` and ``w`` of one dtype on CUDA, as
    one GEMM on the half operands with float32 output (``torch.mm``'s ``out_dtype``): their
    products are exact in float32 and summed in float32, so it equals the converted GEMM up to
    summation order, without the two conversions and the float32 GEMM (98 us of a qwen3 forward
    on H200). The backward is that reference's: float32 GEMMs, each gradient cast to its
    operand's dtype."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = (g @ w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x.float()).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def router_logits(x_TH: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """``x @ router_weight.T`` in float32 (float64 if x is), from the operands converted to it
    (:class:`_HalfRouterLogits` on CUDA half operands; its GEMM alone where no gradient is wanted)."""
    if x_TH.is_cuda and x_TH.dtype in (torch.bfloat16, torch.float16) and router_weight.dtype == x_TH.dtype:
        if torch.is_grad_enabled() and (x_TH.requires_grad or router_weight.requires_grad):
            return _HalfRouterLogits.apply(x_TH, router_weight)
        return torch.mm(x_TH, router_weight.t(), out_dtype=torch.float32)
    rdt = torch.float64 if x_TH.dtype == torch.float64 else torch.float32
    return x_TH.to(rdt) @ router_weight.to(rdt).t()


def route(x_TH: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool, shift: int = 0):
    """``(probs [T, E], top-k probs [T, k], top-k experts [T, k], combine weights [T, k], sort keys
    [T*k] ((expert - shift) mod E), assignments per expert [E])``: :func:`~.routing.route_topk` of
    the router logits; probs in float32 (or x's dtype if wider), ties to the lower expert index."""
    return route_topk(router_logits(x_TH, router_weight), top_k, normalize, shift)


def keep_within_capacity(experts: torch.Tensor, priority: torch.Tensor, num_experts: int, capacity: int):
    """Mask over the flattened assignments (token-major): at most ``capacity`` per expert, by
    decreasing ``priority``, ties to the lower token (earlier assignment)."""
    n = experts.numel()
    by_priority = torch.sort(-priority, stable=True).indices
    order = by_priority[torch.sort(experts[by_priority], stable=True).indices]
    e_sorted = experts[order]
    counts = count(e_sorted, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    keep_sorted = torch.arange(n, device=experts.device) - starts[e_sorted] < capacity
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


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


def tile_index(n: int, k: int, device) -> torch.Tensor:
    """The tile of each of ``n`` rows cut into ``k`` tiles as
    :func:`~overlap_layers.planning.tiling.tile_bounds` cuts them (the
    first ``n % k`` tiles one row longer), in a fixed number of kernels whatever ``k``."""
    base, extra = divmod(n, max(1, min(k, n)))
    i = torch.arange(n, device=device)
    cut = extra * (base + 1)
    return torch.where(i < cut, i // (base + 1), extra + (i - cut) // max(base, 1))


def grouped_gemm_ok(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: it exists in this torch, the dtype is
    a float type it supports, and every row stride is a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    e = x.element_size()
    return all(d * e % 16 == 0 for d in (x.shape[1], w_in.shape[1], w_out.shape[1], w_out.shape[2]))


def routed_ends(rows: int, groups: int) -> torch.Tensor:
    """Grouped-GEMM offsets (int32, each group's end) of ``rows`` rows routed uniformly at random
    over ``groups`` experts: the counts balanced routing gives, each group's last row tile mostly
    partial ([Note: grouped GEMMs cost more than dense ones] in ``layers/moe/cost.py``). Seeded, so every
    rank draws the same."""
    g = torch.Generator().manual_seed(rows)
    counts = torch.bincount(torch.randint(0, groups, (rows,), generator=g), minlength=groups)
    return torch.cumsum(counts, 0, dtype=torch.int32)


class _Tile:
    """What one tile's exchange needs ([Note: MoE host syncs]): split sizes and rows per local
    expert (host lists), and on the device the index grouping the received rows by local expert,
    its inverse, and the grouped-GEMM offsets."""

    def __init__(self, send: List[int], recv: List[int], sizes: List[int], index, inverse, offs):
        self.send, self.recv, self.sizes = send, recv, sizes
        self.index, self.inverse, self.offs = index, inverse, offs


def _tile_tensors(counts: torch.Tensor, bound: int):
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


def _tiles(table, rank: int, index, inverse, offs) -> List[_Tile]:
    """The tiles of one call from every rank's counts on the host (:func:`count_table`) and
    :func:`_tile_tensors` of this rank's: host lists and views only, no launches (this runs
    between the counts' arrival and the first exchange)."""
    out, a = [], 0
    for t in range(len(table[0])):
        mine = [table[s][t][rank] for s in range(len(table))]  # [source][El]
        recv = [sum(r) for r in mine]
        b = a + sum(recv)
        out.append(_Tile([sum(r) for r in table[rank][t]], recv, [sum(c) for c in zip(*mine)], index[a:b],
                         inverse[a:b], offs[t]))
        a = b
    return out


class _Call(LayerCall):
    """Everything one call needs besides the differentiable tensors."""

    def __init__(self, layer: "OverlapMoE", plan: TilePlan, save: bool, streams, tiles: List[_Tile]):
        super().__init__(layer.group, plan, save, streams, layer.launch_log)
        self.activation = layer.activation
        self.tiles = tiles

    def experts(self, x_g: torch.Tensor, sizes: List[int], offs: torch.Tensor, w_in, w_out) -> torch.Tensor:
        """Rows grouped by local expert (``sizes`` rows each; ``offs`` their cumulative ends on the
        device) through their experts (:func:`~.ranks.experts_forward`: one grouped GEMM per
        projection where :func:`grouped_gemm_ok`, else a GEMM pair per expert)."""
        return experts_forward(self.activation, grouped_gemm_ok(x_g, w_in, w_out), x_g, sizes, offs,
                               w_in.transpose(-2, -1), w_out.transpose(-2, -1))[0]


def _forward_program(c: _Call, w_in, w_out) -> TileProgram:
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


def _backward_program(c: _Call, w_in, w_out, accumulate: Accumulator) -> TileProgram:
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


def _rows(parts: List[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """The tiles' rows in order (one tile: its tensor, not a copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else empty


class _ExpertExchange(torch.autograd.Function):
    """``y_perm`` (expert outputs of the assignment rows ``x_perm``, same order) for the local
    experts ``w_in``, ``w_out``; see the module table."""

    @staticmethod
    def forward(ctx, x_perm, w_in, w_out, call: _Call):
        offsets = [0]
        for tile in call.tiles:
            offsets.append(offsets[-1] + sum(tile.send))
        envs = [{"tile": t, "xs": (x_perm[offsets[t]:offsets[t + 1]], tile.send, tile.recv)}
                for t, tile in enumerate(call.tiles)]
        run_tiles(call, round_robin(_forward_program(call, w_in, w_out), len(envs)), envs, "moe", backward=False,
                  device=x_perm.device)
        if call.save:
            ctx.graphs = [e["graph"] for e in envs]
            ctx.call, ctx.offsets = call, offsets
            ctx.save_for_backward(w_in, w_out)
        return _rows([e["y"] for e in envs], x_perm.new_zeros((0, w_out.shape[1])))

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_perm):
        c: _Call = ctx.call
        w_in, w_out = ctx.saved_tensors
        graphs, offs = take(ctx, "graphs"), ctx.offsets
        dy_perm = dy_perm.contiguous()
        grads = {"w_in": torch.zeros_like(w_in), "w_out": torch.zeros_like(w_out)}
        envs = [{"tile": t, "graph": graphs[t], "dys": (dy_perm[offs[t]:offs[t + 1]], c.tiles[t].send, c.tiles[t].recv)}
                for t in range(len(graphs))]
        del graphs
        run_tiles(c, round_robin(_backward_program(c, w_in, w_out, Accumulator(grads)), len(envs)), envs, "moe_bwd",
                  backward=True, device=dy_perm.device)
        dx = _rows([e["dx"] for e in envs], dy_perm.new_zeros(dy_perm.shape))
        return dx, grads["w_in"], grads["w_out"], None


class OverlapMoE(RankChunkPlans, TiledLayer, nn.Module):
    """Drop-in expert-parallel MoE; equals the module docstring's reference on each rank's tokens.

    Parameters (``group=`` the expert-parallel group): ``router_weight [E, H]`` (replicated),
    ``w_in [E/ws, 2*ffn, H]`` (swiglu: gate rows then up rows; else ``[E/ws, ffn, H]``),
    ``w_out [E/ws, H, ffn]`` for experts ``r*E/ws ..``, and the replicated shared expert
    ``shared_w_in [2*shared_ffn, H]``, ``shared_w_out [H, shared_ffn]``. ``router_weight.grad`` and
    the shared expert's gradients hold *this rank's tokens'* contribution (the data-parallel
    reduction over the group sums them); expert gradients hold every rank's tokens routed to them.
    With ``mesh=`` the same tensors are the local parts of DTensor parameters (experts Shard(0),
    the rest Replicate); see overlap_layers.planning.dtensor.

    Input ``[batch, seq, hidden]``: this rank's own tokens (the count may differ across ranks and
    may be 0); output the same shape. Capacity drops order by the router probability (before
    renormalisation). ``layer.aux_loss`` is set by every call (0 unless ``aux_loss_coef > 0``).
    ``num_tiles`` is K (tiles of the local tokens; every rank runs K, some tiles may be empty) or
    "auto": planned from the group's largest token count (bucketed) assuming balanced routing,
    then verified on the first calls. The planner also weighs the exchange split by source rank
    (``plan.decomposition == "rank"``, ``layers/moe/ranks.py``): on CUDA over the copy engine where every
    rank has symmetric memory, else over send/recv. With ``config.graph_calls``, calls without
    autograd (and without aux loss) where every rank has symmetric memory run with their sizes on
    the device and are replayed from CUDA graphs ([Note: MoE graph calls] in ``layers/moe/device.py``).
    """

    _exchanges = (CopyEngineAllToAll, PointToPointAllToAll)
    _planned_send_recv = True
    _source_split = True  # every rank's rows for this rank's experts are a piece
    _dense_when_empty = False  # ranks may hold no tokens while others do; routing none sets the aux loss
    _graphable = True  # config.graph_calls: calls by the device path ([Note: MoE graph calls], [Note: MoE training graphs])
    _group_shapes: tuple = ()  # every rank's (batch, seq) in the current call (the graphs' signature)
    _device_workspace = None  # the group's "device_counts" workspace, once the device path runs
    _workspace_purposes = ("exchange", "device_counts")  # the rank chunks' and the device path's

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *, group=None,
                 mesh=None, axis=None, activation: str = "swiglu", normalize_topk: bool = True,
                 capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.0,
                 shared_expert_ffn: Optional[int] = None, num_tiles=None, config: Optional[OverlapConfig] = None,
                 dtype=None, device=None):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                        ("num_experts", num_experts), ("top_k", top_k)):
            check_positive_int(v, name)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must be at most num_experts={num_experts}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}; valid: {ACTIVATIONS}")
        if capacity_factor is not None and not finite_number(capacity_factor):
            raise ValueError(f"capacity_factor={capacity_factor!r}; must be None (dropless) or a positive finite "
                             f"number")
        if not finite_number(aux_loss_coef, zero_ok=True):
            raise ValueError(f"aux_loss_coef={aux_loss_coef!r}; must be a finite number >= 0")
        check_positive_int(shared_expert_ffn, "shared_expert_ffn", none_ok=True)
        self.config, self.num_tiles = resolve_config(config, num_tiles)
        check_dtype(dtype)
        self.group = resolve_group(group, mesh, axis)
        ws = dist.get_world_size(self.group)
        if num_experts % ws:
            raise ValueError(f"num_experts={num_experts} must be divisible by the group size {ws}")
        self.world_size, self.rank = ws, dist.get_rank(self.group)
        self.hidden_size, self.ffn_hidden_size, self.num_experts, self.top_k = \
            hidden_size, ffn_hidden_size, num_experts, top_k
        self.activation, self.normalize_topk, self.capacity_factor = activation, bool(normalize_topk), capacity_factor
        self.aux_loss_coef, self.shared_expert_ffn = float(aux_loss_coef), shared_expert_ffn
        self.num_local_experts = num_experts // ws
        kw = {"dtype": dtype, "device": device}
        n_in = (2 if activation == "swiglu" else 1) * ffn_hidden_size
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self.w_in = nn.Parameter(torch.empty(self.num_local_experts, n_in, hidden_size, **kw))
        self.w_out = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, ffn_hidden_size, **kw))
        if shared_expert_ffn:
            s_in = (2 if activation == "swiglu" else 1) * shared_expert_ffn
            self.shared_w_in = nn.Parameter(torch.empty(s_in, hidden_size, **kw))
            self.shared_w_out = nn.Parameter(torch.empty(hidden_size, shared_expert_ffn, **kw))
        else:
            self.shared_w_in = self.shared_w_out = None
        self.launch_log: Optional[list] = None
        self.planner = LayerPlanner(self, self.config)  # plans, agrees and runs each call: planning/planner.py
        self._init_caches()
        self.reset_parameters()
        self._as_dtensors(mesh, axis)

    def _init_caches(self) -> None:
        self._aux: Optional[torch.Tensor] = None  # the last call's aux loss (see aux_loss), once made
        self._aux_zero_of = None  # while it is 0 and not made: (device, dtype, whether the call had autograd)
        self._host_reader = HostReader()
        self._device_exchanges: dict = {}  # (rows, hidden, dtype) -> DeviceCountAllToAll of the device path
        self._device_race = DevicePathRace(self.planner.agreement)  # [Note: MoE graph calls: the race]
        # [Note: MoE slot rows]: per race signature, the largest count the slots must hold (none: an
        # even routing's); the device-path call being made (its signature, slot rows and send rows);
        # the host tensor its calls copy their peak count into, and the
        # event they record after it
        self._device_needs: dict = {}
        self._device_call: Optional[tuple] = None
        self._device_peak: Optional[tuple] = None
        self._race_hooks = (None, 0, [])  # a timed training call's gradient hooks (its key, graph bytes, handles)

    # ----------------------------------------------------------------- weights
    def _dtensor_layouts(self) -> Dict[str, Layout]:
        """[Note: DTensor parameters] (``planning/dtensor.py``): the experts Shard(0) over experts,
        the router and the shared expert Replicate."""
        return {"router_weight": Layout(Replicate()), "w_in": Layout(Shard(0)), "w_out": Layout(Shard(0)),
                "shared_w_in": Layout(Replicate()), "shared_w_out": Layout(Replicate())}

    def _dtensor_input_placements(self) -> tuple:
        """[Note: DTensor inputs]: tokens split across the group, by batch or by sequence."""
        return (Shard(0), Shard(1))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Router and experts as ``nn.Linear`` (no bias) would initialise them under the same seed,
        in the order router, every expert's fc1 then fc2 (dense, then this rank's slice), shared
        fc1, fc2: the same on every rank."""
        if self.w_in.device.type == "meta":
            return
        init_linear_(self.router_weight, None)
        kw = {"dtype": self.w_in.dtype, "device": self.w_in.device}
        dense_in = torch.empty(self.num_experts, *self.w_in.shape[1:], **kw)
        dense_out = torch.empty(self.num_experts, *self.w_out.shape[1:], **kw)
        for e in range(self.num_experts):
            init_linear_(dense_in[e], None)
            init_linear_(dense_out[e], None)
        mine = slice(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)
        self.w_in.copy_(dense_in[mine])
        self.w_out.copy_(dense_out[mine])
        if self.shared_w_in is not None:
            init_linear_(self.shared_w_in, None)
            init_linear_(self.shared_w_out, None)

    @classmethod
    def from_dense(cls, router_weight: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, *, top_k: int,
                   shared_w_in=None, shared_w_out=None, group=None, mesh=None, axis=None, activation: str = "swiglu",
                   normalize_topk: bool = True, capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.0,
                   num_tiles=None, config: Optional[OverlapConfig] = None) -> "OverlapMoE":
        """From dense weights: ``router_weight [E, H]``, ``w_in [E, 2*ffn, H]`` (swiglu; else
        ``[E, ffn, H]``), ``w_out [E, H, ffn]``, shared ``shared_w_in [2*sffn, H]`` (swiglu),
        ``shared_w_out [H, sffn]`` (both or neither)."""
        for name, t, dim in (("router_weight", router_weight, 2), ("w_in", w_in, 3), ("w_out", w_out, 3)):
            if not isinstance(t, torch.Tensor) or t.dim() != dim:
                raise ValueError(f"{name} must be a {dim}-D tensor; got {getattr(t, 'shape', t)!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}; valid: {ACTIVATIONS}")
        E, H = router_weight.shape
        ffn = w_out.shape[2]
        mult = 2 if activation == "swiglu" else 1
        for name, t, want in (("w_in", w_in, (E, mult * ffn, H)), ("w_out", w_out, (E, H, ffn))):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; with router_weight {tuple(router_weight.shape)} "
                                 f"and activation={activation!r} it must be {want}")
        if (shared_w_in is None) != (shared_w_out is None):
            raise ValueError("pass both shared_w_in and shared_w_out, or neither")
        sffn = None
        if shared_w_in is not None:
            sffn = shared_w_out.shape[-1] if shared_w_out.dim() == 2 else -1
            if shared_w_out.dim() != 2 or tuple(shared_w_out.shape) != (H, sffn) or \
                    shared_w_in.dim() != 2 or tuple(shared_w_in.shape) != (mult * sffn, H):
                raise ValueError(f"shared_w_in {tuple(shared_w_in.shape)} / shared_w_out {tuple(shared_w_out.shape)}: "
                                 f"must be [{mult}*shared_ffn, {H}] and [{H}, shared_ffn]")
        layer = cls(H, ffn, E, top_k, group=resolve_group(group, mesh, axis), activation=activation,
                    normalize_topk=normalize_topk, capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef,
                    shared_expert_ffn=sffn, num_tiles=num_tiles, config=config, dtype=w_in.dtype, device="meta")
        layer.to_empty(device=w_in.device)
        with torch.no_grad():
            mine = slice(layer.rank * layer.num_local_experts, (layer.rank + 1) * layer.num_local_experts)
            layer.router_weight.copy_(router_weight)
            layer.w_in.copy_(w_in[mine])
            layer.w_out.copy_(w_out[mine])
            if sffn:
                layer.shared_w_in.copy_(shared_w_in)
                layer.shared_w_out.copy_(shared_w_out)
        layer._as_dtensors(mesh, axis)
        return layer

    @torch.no_grad()
    def to_dense(self) -> dict:
        """The dense weights (keys of :meth:`from_dense`; None where absent). A collective: every
        rank of the group must call it."""
        def gather(t):
            out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
            all_gather_rows(out, t.contiguous(), group=self.group)
            return out
        shared = self.shared_w_in is not None
        p = {n: self._local(n) for n in ("router_weight", "w_in", "w_out", "shared_w_in", "shared_w_out")}
        return {"router_weight": p["router_weight"].detach().clone(), "w_in": gather(p["w_in"]),
                "w_out": gather(p["w_out"]), "shared_w_in": p["shared_w_in"].detach().clone() if shared else None,
                "shared_w_out": p["shared_w_out"].detach().clone() if shared else None}

    # ----------------------------------------------------------------- forward
    @property
    def aux_loss(self) -> Optional[torch.Tensor]:
        """The last call's load-balancing loss on this rank's tokens (module docstring; a scalar,
        None before the first call). With ``aux_loss_coef == 0`` it is 0, still attached to the
        router so that ``aux_loss.backward()`` works on any rank, made when first read."""
        src, self._aux_zero_of = self._aux_zero_of, None
        if src is not None:
            device, dtype, graph = src
            router = self._local("router_weight")
            if graph and router.requires_grad:
                # hung from the router's weight, not from the call's graph: held between calls, that
                # graph would keep its parameters' gradient nodes, made on the stream of that call,
                # alive into the next call (which a training graph's capture cannot follow:
                # [Note: MoE training graphs] in layers/moe/device.py)
                with torch.enable_grad():
                    self._aux = router.to(dtype).sum() * 0.0
            else:
                self._aux = torch.zeros((), device=device, dtype=dtype, requires_grad=graph)
        return self._aux

    @property
    def _weight(self) -> torch.Tensor:
        return self.w_in

    def _tile_units(self, shape: tuple) -> int:
        return 1 << 30  # K is never capped by a rank's own tokens: every rank must run the same K

    def _agreed_shape(self, shape: tuple, table) -> tuple:
        """Plans come from the group's largest token count (every rank has the table)."""
        self._group_shapes = tuple((row[1], row[2]) for row in table)
        return (1, max(row[1] * row[2] for row in table), self.hidden_size)

    # ----------------------------------------------------------------- the device path
    def _graphed_run(self, run, shape: tuple, dtype: torch.dtype, save: bool):
        """[Note: MoE graph calls]: a call without aux loss, where every rank has symmetric memory
        and the grouped GEMM takes the operands, captures :meth:`_run_device` (with autograd:
        [Note: MoE training graphs]) where the race has picked it or is timing it; any other call
        runs eagerly (None)."""
        if self.aux_loss_coef > 0 or self._weight.device.type != "cuda" or triton_gate.triton is None \
                or not self._grouped_for(dtype) or not self._copy_engine_available():
            return None
        signature = (self._group_shapes, dtype, save)
        if not self._device_race.choose(signature):
            return None
        rows = rows_bound(shape[1], self.top_k)
        need = self._device_needs.get(signature, rows // self.world_size)  # at first: an even routing's count
        slot = self._device_slot(rows, need)
        self._device_call = (signature, slot, rows)
        if self._device_peak is not None:
            self._device_peak[0].zero_()  # a call that does not reach the device path reads 0 (no copy in flight)
        return lambda plan, trial, trace, x: self._run_device(x, shape[1], slot)

    def _grouped_for(self, dtype: torch.dtype) -> bool:
        """Whether input rows of ``dtype`` run the experts by grouped GEMMs (:func:`grouped_gemm_ok`)."""
        return grouped_gemm_ok(torch.empty(0, self.hidden_size, dtype=dtype, device="meta"), self.w_in, self.w_out)

    def _graph_signature(self) -> tuple:
        # [Note: MoE graph calls]: ranks with other token counts capture alike; [Note: MoE slot rows]
        return self._group_shapes, self._device_call[1] if self._device_call is not None else None

    def _device_overflowed(self) -> bool:
        """[Note: MoE slot rows]: whether the call just made by the device path had a count past
        its slots (its result is not the reference; the same on every rank: the peak is read from
        the table every rank holds), which raises its signature's need to that count and drops its
        graph. Reads the peak on the host only where the slots hold fewer than the bound of rows."""
        call, self._device_call = self._device_call, None
        if call is None:
            return False
        signature, slot, rows = call
        if slot >= rows:
            return False
        peak, event = self._device_peak
        if event is not None:
            event.synchronize()  # the call's exchange has its counts: the host waits for that much of it
        elif self._weight.device.type == "cuda":  # no event a graph records: the whole call
            torch.cuda.current_stream(self._weight.device).synchronize()
        peak = int(peak)
        if peak <= slot:
            return False
        self._device_needs[signature] = peak
        if self.planner.call_graphs is not None:
            self.planner.call_graphs.forget_last()
        return True

    def _device_slot(self, rows: int, need: int) -> int:
        """[Note: MoE slot rows]: the slot rows of a call with ``rows`` send rows whose slots must
        hold ``need`` (at least the exchange's largest region)."""
        return slot_rows(rows, max(region_caps(self.world_size, rows, self.num_local_experts).values(), default=0),
                         need)

    def _graph_stage(self, plan, t: torch.Tensor, role: str):
        return None  # the device path gathers its send rows from x itself; its backward starts from others

    def _device_exchange(self, rows: int, dtype: torch.dtype, device: torch.device) -> DeviceCountAllToAll:
        """The device path's exchange for ``rows`` send rows of ``dtype`` (made outside a capture:
        the graph's first run makes it), made anew when its workspace grew since."""
        if self._device_workspace is None:
            self._device_workspace = shared_workspace(self.group, device, "device_counts")
        key = (rows, self.hidden_size, dtype)
        ex = self._device_exchanges.get(key)
        if ex is None or ex._handle is not self._device_workspace.handle:
            if len(self._device_exchanges) >= 8:
                self._device_exchanges.clear()
            ex = self._device_exchanges[key] = DeviceCountAllToAll(self._device_workspace, rows, self.hidden_size,
                                                                   dtype, groups=self.num_local_experts)
        return ex

    def _run_device(self, x: torch.Tensor, max_tokens: int, slot: Optional[int] = None) -> torch.Tensor:
        """One call by :func:`~.device.experts_by_source` ([Note: MoE graph calls]);
        ``max_tokens``: the group's largest token count this call; ``slot``: the rows of each part's
        buffers (:meth:`_device_slot`, [Note: MoE slot rows]; None: the bound of rows), with fewer
        than the bound its peak count written into ``self._device_peak``."""
        B, S, H = x.shape
        x, (w_in, w_out) = self._call_tensors(x, ("w_in", "w_out"))
        x_TH = x.reshape(B * S, H)
        with torch.autocast(x.device.type, enabled=False):
            exchange = self._device_exchange(rows_bound(max_tokens, self.top_k), x_TH.dtype, x.device)
            if slot is not None and self._device_peak is None:  # made by a first call, outside a capture
                cuda = x.device.type == "cuda"
                self._device_peak = (torch.zeros((), dtype=torch.int32, pin_memory=cuda),
                                     peak_event() if cuda else None)
            # the weights' gradients wait for no replay's copy where they reach the parameters as they are
            graphs = self.planner.call_graphs
            defer = graphs.defer if graphs is not None and w_in is self.w_in \
                and w_out is self.w_out else None
            y = experts_by_source(self, x_TH, w_in, w_out, exchange, lambda: self._shared_expert(x_TH), slot,
                                  self._device_peak if slot is not None and slot < exchange.rows else None, defer)
        return y.view(B, S, H)

    def _shared_expert(self, x_TH: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared expert's output on every local token (None without one)."""
        if self.shared_w_in is None:
            return None
        sw_in, sw_out = self._local("shared_w_in").to(x_TH.dtype), self._local("shared_w_out").to(x_TH.dtype)
        return act(self.activation, x_TH @ sw_in.t()) @ sw_out.t()

    def _plan_key(self, shape: tuple, dtype: torch.dtype, save: bool) -> tuple:
        tokens = shape[0] * shape[1]
        return (1 << max(tokens - 1, 0).bit_length(), dtype, save)  # bucketed to a power of two

    def _cost_model(self, key: tuple, hw) -> MoECostModel:
        grouped = self._grouped_for(key[1])
        return MoECostModel(tokens=key[0], world_size=self.world_size, hidden=self.hidden_size,
                            n_in=self.w_in.shape[1], ffn=self.ffn_hidden_size, experts=self.num_experts,
                            top_k=self.top_k, elt=torch.tensor([], dtype=key[1]).element_size(), model=hw,
                            activation=self.activation, grouped=grouped)

    def _programs(self, k: int, save: bool, regather: bool):
        call = _Call(self, TilePlan(k), save, None, [])
        return _forward_program(call, None, None), _backward_program(call, None, None, Accumulator({}))

    def _op_setups(self, cm: MoECostModel, dtype: torch.dtype) -> dict:
        """The copy engine's ops and the grouped GEMMs ([Note: grouped GEMMs cost more than dense
        ones] in ``layers/moe/cost.py``); dense GEMMs are measured by shape, the rest costed by bandwidth."""
        return {**self._copy_engine_setups(cm), **self._grouped_setups(cm, dtype)}

    def _grouped_setups(self, cm: MoECostModel, dtype: torch.dtype) -> dict:
        """Per :meth:`MoECostModel.grouped_ops` key, a setup of that grouped GEMM as the layer runs
        it: on its own weights (the forward's as transposed views), the rows routed at random
        (:func:`routed_ends`)."""
        w_in, w_out = self.w_in.detach().to(dtype), self.w_out.detach().to(dtype)
        weights = (w_in.transpose(-2, -1), w_out.transpose(-2, -1), w_out, w_in)  # MoECostModel.gemms' order
        El, dev = w_in.shape[0], w_in.device

        def setup(m: int, k: int, i: int):
            x = torch.randn(m, k, dtype=dtype, device=dev)
            offs = routed_ends(m, El).to(dev)
            return lambda: torch._grouped_mm(x, weights[i], offs=offs)
        return {key: (lambda m=m, k=k, i=i: setup(m, k, i)) for key, (m, n, k, i) in cm.grouped_ops().items()}

    def _config_digest(self) -> int:
        key = (self.hidden_size, self.ffn_hidden_size, self.num_experts, self.top_k, self.activation,
               self.normalize_topk, self.capacity_factor, self.shared_expert_ffn)
        return zlib.crc32(repr(key).encode())

    @planned_forward  # torch.compile: one op; a DTensor x: its local tensor (planning/entry.py)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        agreed = self.planner.agree(x, x_error(x, self.hidden_size, self.w_in), _INPUT_ERRORS, "x",
                                    extra=(self._config_digest(),), extra_names=("layer config",),
                                    shape_names=(None, None, "hidden"))
        shape, save = agreed.shape, agreed.save
        if self.planner.capturing:  # agreed: every rank raises
            raise RuntimeError("OverlapMoE cannot be captured into a CUDA graph: each call copies its all-to-all "
                               "split sizes (from the routing) to the host; run it eagerly, or build it with "
                               "OverlapConfig(graph_calls=True), whose calls (without aux loss) replay graphs of a "
                               "path with the sizes on the device")
        # [Note: MoE graph calls: the race]: a training call is timed to the end of its backward
        self._end_race_hooks()  # an earlier call's backward that never came: its timing ends here
        run = lambda plan, trial, trace, x: self._run(x, plan, save, shape[1], trial, trace)  # noqa: E731
        self._device_call = None
        y = self.planner.call(x, agreed, run)
        while self._device_overflowed():  # agreed: the call again, with slots for its counts (each time more)
            # dropped first: its graph holds the parameters' gradient nodes, made on this stream, which
            # the new capture's backward could not follow (as _aux's note says)
            y = None
            y = self.planner.call(x, agreed, run)
        watched = ([p for p in self.parameters() if p.requires_grad] or ([x] if x.requires_grad else [])) \
            if save and self._device_race.timing else []  # listed only while a call is timed
        if watched:
            left = [len(watched)]

            def done(*_) -> None:  # as each gradient is made; the last ends the timing
                left[0] -= 1
                if not left[0]:
                    self._end_race_hooks()
            graphs = self.planner.call_graphs
            self._race_hooks = (graphs.last_key, graphs.last_nbytes, [
                t.register_post_accumulate_grad_hook(done) if t.is_leaf else t.register_hook(done) for t in watched])
        else:
            graphs = self.planner.call_graphs
            self._race_done(None, graphs.last_nbytes if graphs is not None else 0)
        return y

    def _race_done(self, key, nbytes: int) -> None:
        """End the race's timing of a call (whose graph kept ``nbytes``); drop its signature's graph
        (``key``; None: the last call's) if the device path lost, else, if it won, the layer's hold
        on the eager calls' symmetric workspace ([Note: MoE graph calls: the race])."""
        choice = self._device_race.finish(nbytes, self.planner.maker.budget)
        if choice is False:
            self.planner.call_graphs.forget_last(key)
        elif choice:
            self._workspace = None

    def _end_race_hooks(self) -> None:
        """Where a timed training call's gradient hooks are still set: remove them (a hook on the
        parameters would outlive the backward it waits for) and end that call's timing."""
        key, nbytes, hooks = self._race_hooks
        if hooks:
            for h in hooks:
                h.remove()
            self._race_hooks = (None, 0, [])
            self._race_done(key, nbytes)

    def _route_and_count(self, x_TH, K: int):
        """Routing on the whole local batch and capacity: ``(order, weights, counts)``, ``order``
        the permutation of the token-major assignments into send order (by tile, then expert; the
        dropped ones last), ``weights [T, k]`` the combine weights (with the router's graph),
        ``counts [K, ws, El]`` the assignments kept per tile and destination expert."""
        sort_key, weights, counts = self._route_keys(x_TH, K)
        return torch.sort(sort_key, stable=True).indices, weights, counts

    def _route_keys(self, x_TH, K: int, step_order: bool = False):
        """:meth:`_route_and_count` before its sort: ``(keys, weights, counts)``, ``keys`` each
        token-major assignment's place in the send order's key order (``K * E`` where dropped by
        capacity; ``E`` with one tile); with ``step_order`` (one tile) by expert in the rank
        exchange's step order, own experts first."""
        T, E, k, El, ws = x_TH.shape[0], self.num_experts, self.top_k, self.num_local_experts, self.world_size
        shift = El * self.rank if step_order else 0
        probs, top_p, experts, weights, keys, per_expert = route(x_TH, self._local("router_weight"), k,
                                                                 self.normalize_topk, shift)
        flat_e = experts.reshape(-1)
        keep = None
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * T * k / E)
            keep = keep_within_capacity(flat_e, top_p.detach().reshape(-1), E, cap)
        if self.aux_loss_coef > 0 and T > 0:
            f = per_expert.to(probs.dtype) / (T * k)
            self._aux, self._aux_zero_of = self.aux_loss_coef * E * (f * probs.mean(0)).sum(), None
        else:  # 0, made when read (launches off the call's path)
            self._aux = None
            self._aux_zero_of = (weights.device, weights.dtype, weights.requires_grad)
        # Send order: by tile, then expert; dropped assignments sort last (key K*E) and are cut off
        # once the counts are on the host ([Note: MoE host syncs]: no sync here).
        if K == 1:  # the routing's own keys (in the step order if asked) and counts
            sort_key, counts = keys, per_expert
            if keep is not None:
                sort_key = torch.where(keep, keys, E)
                counts = count(torch.where(keep, flat_e, E), E + 1)[:E]
            counts = counts.view(1, ws, El)
        else:  # tiles: never the step order (rank chunks run one tile)
            tokens = torch.arange(T, device=x_TH.device).repeat_interleave(k)
            key = tile_index(T, K, x_TH.device)[tokens] * E + flat_e
            if keep is not None:
                key = torch.where(keep, key, K * E)
            sort_key = key.to(key_dtype(K * E))
            counts = count(key, K * E + 1)[:K * E].view(K, ws, El)
        return sort_key, weights, counts

    def _run(self, x, plan: TilePlan, save: bool, max_tokens: int, trial=None, trace=None) -> torch.Tensor:
        """One call under ``plan``; ``max_tokens`` is the group's largest token count this call."""
        dev = x.device.type
        B, S, H = x.shape
        K, ws, k = plan.num_tiles, self.world_size, self.top_k
        ranked = plan.decomposition == Decomposition.RANK
        x, (w_in, w_out) = self._call_tensors(x, ("w_in", "w_out"))
        x_TH = x.reshape(B * S, H)
        with torch.autocast(dev, enabled=False):
            with profiler_range("overlap::moe::route"):
                if ranked:  # one tile, keys in the step order (own experts first), no sort
                    keys, weights, counts = self._route_keys(x_TH, 1, step_order=True)
                else:
                    order, weights, counts = self._route_and_count(x_TH, K)
            # [Note: MoE host syncs]: every rank's counts in one device gather, read on the host
            # while the assignment rows are gathered (those over capacity sort last: cut below).
            gathered = counts.new_empty(ws * counts.numel())
            all_gather_rows(gathered, counts.reshape(-1), group=self.group)
            read = self._host_reader.start(gathered)
            n = x_TH.shape[0] * k
            if ranked:  # the rows go straight into the exchange's send buffer (layers/moe/ranks.py)
                plan, exchange = self._rank_run(plan, x.device)
                capacity = rows_bound(max_tokens, k)  # the same on every rank
                sent = exchange(n, H, x_TH.dtype, x_TH.device, capacity)
                # the send rows by key, each key's after the earlier keys': [Note: placing without a sort]
                pos = place_in_key_order(x_TH.detach(), keys, k, self.num_experts, sent.send)
                # its signals, the pieces' offsets and the first own piece need no host sizes: launched before the wait
                sent.ready()
                m, grouped = first_rows(n, ws), grouped_gemm_ok(x_TH, w_in, w_out)
                offsets = piece_offsets(gathered.view(ws, K, ws, -1)[:, 0, self.rank], self.rank, m)
                first = launch_first(sent.send, m, offsets[0], w_in, w_out, self.activation, trace) \
                    if grouped and sent.early_ok and m else None
            else:
                pos = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=order.device))
                mine = gathered.view(ws, K, ws, -1)[:, :, self.rank].transpose(0, 1)  # [tile, source, El]
                tensors = _tile_tensors(mine, ws * max_tokens * k)
                x_perm = Dispatch.apply(x_TH, order, pos, k)
            shared = self._shared_expert(x_TH)
            with profiler_range("overlap::moe::read_counts"):
                table = count_table(read(), ws, K)  # [src][tile][dst][El]
            if ranked:
                send_table = [[sum(r) for r in row[0]] for row in table]
                sent.start(send_table)  # the pulls first: nothing else waits on the host here
                kept = sum(send_table[self.rank])
                call = RankCall(rank=self.rank, world_size=ws, activation=self.activation, grouped=grouped, save=save,
                                table=send_table,
                                sizes=[row[0][self.rank] for row in table], first_rows=m, offsets=offsets,
                                keys=keys, pos=pos, kept=kept, top_k=k, capacity_rows=capacity, exchange=exchange,
                                sent=sent, first=first, launch_log=self.launch_log)
                call.trial, call.trace, call.gather = trial, trace, save  # [Note: MoE no-grad combine]
                rows = apply_saving(RankChunkExperts, save, x_TH, w_in, w_out, call)
            else:
                kept = sum(sum(r) for tile in table[self.rank] for r in tile)
                if kept < n:
                    x_perm = x_perm[:kept]
                call = _Call(self, plan, save, self.planner.streams.get(x.device, min(K, plan.num_streams)),
                             _tiles(table, self.rank, *tensors))
                call.trial, call.trace = trial, trace
                rows = apply_saving(_ExpertExchange, save, x_perm, w_in, w_out, call)
            with profiler_range("overlap::moe::combine"):
                if ranked and not save:  # the peers' results in send order, the own ones where they were made
                    y = combine_back(call, rows, weights, call.own_results)
                else:
                    y = self._combine(rows, pos, None if ranked else order, weights, kept, save, token_major=ranked)
            if shared is not None:
                y = y + shared
        return y.view(B, S, H)

    @staticmethod
    def _combine(rows: torch.Tensor, pos, order, weights: torch.Tensor, kept: int, save: bool,
                 token_major: bool) -> torch.Tensor:
        """``y [T, H]``: each token's kept result rows weighted, from ``rows`` in send order (the
        first ``kept`` valid), or token-major (``token_major``: the rank exchange's, with zero
        rows where dropped); with ``save`` in autograd (the module docstring), else by
        :func:`~.combine.combine_rows` ([Note: MoE no-grad combine])."""
        n, H = pos.numel(), rows.shape[1]
        if not save:
            return combine_rows(rows, rows, pos, weights, kept, None if kept == n else kept)
        if not token_major:
            if kept < n:  # dropped assignments: zero rows
                rows = torch.cat([rows[:kept], rows.new_zeros((n - kept, H))])
            rows = PermuteRows.apply(rows, pos, order)
        return weigh_rows(rows.view(-1, weights.shape[1], H), weights.to(rows.dtype))  # [T, k, H] weighted

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, activation={self.activation}, "
                f"capacity_factor={self.capacity_factor}, shared_expert_ffn={self.shared_expert_ffn}, "
                f"world_size={self.world_size}, num_tiles={self.num_tiles!r}")
