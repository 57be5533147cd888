"""One eager call of :class:`~overlap_layers.layers.moe.layer.OverlapMoE` under a plan: route
the local tokens, exchange the split sizes ([Note: MoE host syncs]), run the exchange (batch tiles,
``layers/moe/tiles.py``, or rank chunks, ``layers/moe/ranks.py``), combine each token's rows.

Reference: ``layers/moe/layer.py``'s module docstring. Routing, capacity and the permutations
stay outside the exchange, on the whole call: ``order`` sorts the token-major assignments into
send order (by tile, then expert, dropped ones last; for the rank exchange by expert in its step
order, this rank's own experts first, placed without a sort) and ``pos`` is its inverse. The
combine weighs each token's k rows (``moe_combine.weigh_rows``: one kernel each way, [Note: MoE
weighted combine]) in autograd, so the router gets its gradient through the weights (and the aux
loss).

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
a call (about 0.2-0.3 ms on the H200 machines), which is why extra tiles, each adding two NCCL
launches to the host's path, rarely pay for the MoE over NVLink. The rank-chunk exchange takes its
sizes from the same read (one tile); its grouped-GEMM offsets (computed on the device from the
gathered counts), its peer signals (``ready()``) and, on the grouped-GEMM path, its first own
piece (``launch_first``: rows at a fixed place, own rows first) need no host sizes and are
launched before the wait, so the device computes while the host reads the counts and starts the
exchange.

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

import torch

from ...config import Decomposition
from ...kernels.send_rows import place_in_key_order
from ...planning.calls import apply_saving
from ...planning.plan import TilePlan
from ...runtime.collectives import all_gather_single as all_gather_rows
from ...runtime.executor import profiler_range
from .combine import combine_rows, weigh_rows
from .experts import grouped_gemm_ok
from .ranks import RankCall, RankChunkExperts, combine_back, first_rows, launch_first, piece_offsets, rows_bound
from .tiles import Dispatch, ExpertExchange, PermuteRows, TileCall, count_table, tile_tensors, tiles_of


def eager_call(layer, x_TH: torch.Tensor, w_in, w_out, plan: TilePlan, save: bool, max_tokens: int,
               trial=None, trace=None) -> torch.Tensor:
    """``y [T, H]`` of ``layer``'s call on its tokens ``x_TH`` under ``plan`` (the module
    docstring), ``w_in``, ``w_out`` its experts in the call's dtype; ``max_tokens`` is the group's
    largest token count this call."""
    if plan.decomposition == Decomposition.RANK:
        return _rank_chunks(layer, x_TH, w_in, w_out, plan, save, max_tokens, trial, trace)
    return _tiles(layer, x_TH, w_in, w_out, plan, save, max_tokens, trial, trace)


def _counts_read(layer, counts: torch.Tensor):
    """``(gathered, read)``: every rank's ``counts`` in one device gather, and the host read of it
    started ([Note: MoE host syncs]: read while the assignment rows are gathered)."""
    gathered = counts.new_empty(layer.world_size * counts.numel())
    all_gather_rows(gathered, counts.reshape(-1), group=layer.group)
    return gathered, layer._host_reader.start(gathered)


def _tiles(layer, x_TH, w_in, w_out, plan: TilePlan, save: bool, max_tokens: int, trial, trace):
    """The call over batch tiles (``layers/moe/tiles.py``)."""
    K, ws, k, rank = plan.num_tiles, layer.world_size, layer.top_k, layer.rank
    with profiler_range("overlap::moe::route"):
        keys, weights, counts = layer._route_keys(x_TH, K)
        order = torch.sort(keys, stable=True).indices  # into send order: by tile, then expert, dropped ones last
    gathered, read = _counts_read(layer, counts)  # those over capacity sort last: cut below
    n = x_TH.shape[0] * k
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=order.device))
    mine = gathered.view(ws, K, ws, -1)[:, :, rank].transpose(0, 1)  # [tile, source, El]
    tensors = tile_tensors(mine, ws * max_tokens * k)
    x_perm = Dispatch.apply(x_TH, order, pos, k)
    shared = layer._shared_expert(x_TH)
    with profiler_range("overlap::moe::read_counts"):
        table = count_table(read(), ws, K)  # [src][tile][dst][El]
    kept = sum(sum(r) for tile in table[rank] for r in tile)
    if kept < n:
        x_perm = x_perm[:kept]
    call = TileCall(layer, plan, save, layer.planner.streams.get(x_TH.device, min(K, plan.num_streams)),
                    tiles_of(table, rank, *tensors))
    call.trial, call.trace = trial, trace
    rows = apply_saving(ExpertExchange, save, x_perm, w_in, w_out, call)
    with profiler_range("overlap::moe::combine"):
        y = combine(rows, pos, order, weights, kept, save, token_major=False)
    return y if shared is None else y + shared


def _rank_chunks(layer, x_TH, w_in, w_out, plan: TilePlan, save: bool, max_tokens: int, trial, trace):
    """The call split by source rank (``layers/moe/ranks.py``): the rows go straight into the
    exchange's send buffer."""
    K, ws, k, rank, H = plan.num_tiles, layer.world_size, layer.top_k, layer.rank, x_TH.shape[1]
    with profiler_range("overlap::moe::route"):  # one tile, keys in the step order (own experts first), no sort
        keys, weights, counts = layer._route_keys(x_TH, 1, step_order=True)
    gathered, read = _counts_read(layer, counts)
    n = x_TH.shape[0] * k
    _, exchange = layer._rank_run(plan, x_TH.device)
    capacity = rows_bound(max_tokens, k)  # the same on every rank
    sent = exchange(n, H, x_TH.dtype, x_TH.device, capacity)
    # the send rows by key, each key's after the earlier keys': [Note: placing without a sort]
    pos = place_in_key_order(x_TH.detach(), keys, k, layer.num_experts, sent.send)
    # its signals, the pieces' offsets and the first own piece need no host sizes: launched before the wait
    sent.ready()
    m, grouped = first_rows(n, ws), grouped_gemm_ok(x_TH, w_in, w_out)
    offsets = piece_offsets(gathered.view(ws, K, ws, -1)[:, 0, rank], rank, m)
    first = launch_first(sent.send, m, offsets[0], w_in, w_out, layer.activation, trace) \
        if grouped and sent.early_ok and m else None
    shared = layer._shared_expert(x_TH)
    with profiler_range("overlap::moe::read_counts"):
        table = count_table(read(), ws, K)  # [src][tile][dst][El]
    send_table = [[sum(r) for r in row[0]] for row in table]
    sent.start(send_table)  # the pulls first: nothing else waits on the host here
    kept = sum(send_table[rank])
    call = RankCall(rank=rank, world_size=ws, activation=layer.activation, grouped=grouped, save=save,
                    table=send_table, sizes=[row[0][rank] for row in table], first_rows=m, offsets=offsets,
                    keys=keys, pos=pos, kept=kept, top_k=k, capacity_rows=capacity, exchange=exchange,
                    sent=sent, first=first, launch_log=layer.launch_log)
    call.trial, call.trace, call.gather = trial, trace, save  # [Note: MoE no-grad combine]
    rows = apply_saving(RankChunkExperts, save, x_TH, w_in, w_out, call)
    with profiler_range("overlap::moe::combine"):
        if not save:  # the peers' results in send order, the own ones where they were made
            y = combine_back(call, rows, weights, call.own_results)
        else:
            y = combine(rows, pos, None, weights, kept, save, token_major=True)
    return y if shared is None else y + shared


def combine(rows: torch.Tensor, pos, order, weights: torch.Tensor, kept: int, save: bool,
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
