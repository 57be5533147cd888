"""The MoE's expert exchange split by source rank instead of by tile (``plan.decomposition ==
"rank"``, one tile): own rows first while the peers' rows are pulled, each peer's results pushed
back while the next source's rows run (``runtime/rank_all_to_all.py``).

Reference (what it must equal): the K=1 exchange of ``layers/moe/tiles.py``. Each expert's output row depends
on its input row only, so the rows this rank's experts receive split into independent
per-source pieces. The send order is by destination, then local expert, so each source's rows
arrive grouped by local expert: a piece is one grouped GEMM per projection (offsets from the
counts), with no regrouping gather. Per rank r, pieces in launch order:

=========  ==============================================================  ==================
piece      forward                                                         results to
=========  ==============================================================  ==================
own, 1st   y = experts(own rows[:h])  (before the host has the counts)      kept where made
peer q     y = experts(rows pulled from q)   (later pulls run meanwhile)   rank q (push)
own, 2nd   y = experts(own rows[h:])                                        kept where made
=========  ==============================================================  ==================

``experts(rows)``: per local expert e, ``act(rows_e @ w_in[e].T) @ w_out[e].T``. Peers come in
step order q = r+1, r+2, ... (mod ws). The own first part starts at once (no pipeline fill), the
second hides the last push (no drain). The send rows are in step order, own rows first, so the
first part, ``h = min(own rows, m)`` with ``m`` (:func:`first_rows`) fixed from the call's
assignment count alone, is ``send[:m]`` with device offsets: on the grouped-GEMM path it is
launched before the host waits for the counts (:func:`launch_first`), and fills what would be
the device's idle gap while the host reads them and starts the exchange.

Backward: the own rows whole and first (two parts would only add a weight-gradient pass), then
the peers', each pushing dx before its weight gradients, so those hide the push:

=========  =======================================================================
dgrad      da = dy @ w_out[e];  (dpre, a) = act'(pre, da);  dx = dpre @ w_in[e]  -> the source
wgrad      dw_out[e] += dy.T @ a;  dw_in[e] += dpre.T @ x
=========  =======================================================================

Legend: pre = rows @ w_in[e].T (the pre-activations), saved per piece (as the K=1 layer saves them for
every received row). The output rows are token-major (zero where capacity dropped an assignment)
and dx is per token: one pass of the combine reads the peers' results in send order and the own
ones where they were made ([Note: MoE own results in place]).

[Note: MoE own results in place]
The own pieces' results (and in the backward the own rows' dx) stay where their GEMMs wrote them:
the combine (:func:`combine_back`, one pass of ``moe_combine.combine_rows``) reads them there and
the peers' from the exchange's back rows. Copying them over their own rows in the send buffer
would cost device copies, and gathering every dx row into token order and then summing each
token's k would read the rows twice; the combine reads each row once and writes each token once
(measured: see docs/measurements.md, MoE eager path).

[Note: MoE weight-gradient accumulation]
Each piece's weight gradients add into the accumulators. With few local experts (at most
``LOOP_WGRAD_EXPERTS``: mixtral's 2 at EP 4) they run as one ``addmm_`` per expert and projection,
which accumulates in the GEMM; with many small experts (qwen3's 32) as one grouped GEMM per
projection per piece, since a GEMM per expert would cost ws*2*El launches of small GEMMs: the
first piece's writes the accumulator, each later one adds into it in its epilogue on CUDA
(``kernels/expert_wgrad.py``, [Note: expert weight gradients in the GEMM]; elsewhere a grouped GEMM and
an add).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ...kernels.expert_wgrad import grouped_wgrad
from ...kernels.moe_ranks import piece_offsets_fused, piece_offsets_reference
from ...kernels.send_rows import place_in_key_order
from ...kernels.triton_gate import runs_triton
from ...planning.calls import recorded_pass
from ...planning.first_order import first_order, take
from ..common.activations import act_backward
from ..common.rank_chunks import piece, piece_tag
from .combine import combine_rows
from .experts import experts_forward, grouped_mm

LOOP_WGRAD_EXPERTS = 8  # [Note: MoE weight-gradient accumulation]


class RankCall:
    """What one rank-chunk call needs besides the differentiable tensors (host lists from the
    count table; device index tensors).

    ``table[s][d]`` rows rank s sends to d; ``sizes[s]`` rows from source s per local expert of
    this rank, from which come ``piece_sizes`` (:func:`piece_sizes` with ``first_rows``, once per
    call); ``offsets`` the pieces' grouped-GEMM offsets on the device (:func:`piece_offsets` of
    the same counts and ``first_rows``, launched before the host had them); ``first`` the first
    own piece's ``(y, pre)`` where :func:`launch_first` ran it before the host had the counts;
    ``keys`` each assignment's send-order key (token-major; the experts' count and above:
    dropped), by which :func:`~overlap_layers.kernels.send_rows.place_in_key_order` placed the
    forward's rows and places the backward's, ``pos`` each assignment's send row (-1: dropped),
    ``kept`` the rows sent.
    ``exchange(rows, width, dtype, device, capacity_rows)`` makes a rank all-to-all; ``sent`` is
    the forward's, made and filled (the assignment rows in send order) before the table was
    known, and started with ``table`` as soon as it was (its pulls then run while the host builds
    the rest of the call)."""

    def __init__(self, *, rank: int, world_size: int, activation: str, grouped: bool, save: bool, table, sizes,
                 first_rows: int, offsets, keys, pos, kept: int, top_k: int, capacity_rows: int, exchange, sent,
                 first=None, launch_log=None):
        self.rank, self.ws, self.activation, self.grouped, self.save = rank, world_size, activation, grouped, save
        self.table, self.keys, self.pos, self.kept, self.k = table, keys, pos, kept, top_k
        self.piece_sizes = piece_sizes(sizes, rank, first_rows)
        self.offsets, self.first = offsets, first
        self.capacity_rows, self.exchange, self.sent, self.launch_log = capacity_rows, exchange, sent, launch_log
        self.trial = self.trace = None  # first-call verification / export_trace(measured=True)
        self.gather = True  # False: the forward returns the back rows in send order ([Note: MoE no-grad combine])
        self.own_results = None  # without gather: the own results, for combine_back

    def pieces(self, backward: bool) -> List[Tuple[int, int, int, int, List[int]]]:
        """``(piece index, step, first row, end row, rows per local expert)`` in launch order;
        step 0 is the own rows (rows of the source's chunk; the index selects ``offsets``, in
        :func:`piece_sizes` order)."""
        sizes = self.piece_sizes
        n, h = sum(sizes[2]), sum(sizes[0])
        peers = [(2 + j, j, 0, sum(sizes[2 + j]), sizes[2 + j]) for j in range(1, self.ws)]
        if backward:
            return [(2, 0, 0, n, sizes[2])] + peers
        return [(0, 0, 0, h, sizes[0])] + peers + [(1, 0, h, n, sizes[1])]


def rows_bound(max_tokens: int, top_k: int) -> int:
    """Send rows a rank may need: the group's largest token count, rounded up to a power of two
    (so that nearby counts share an exchange and a capture), times ``top_k``."""
    return (1 << max(max_tokens - 1, 0).bit_length()) * top_k



def first_rows(assignments: int, world_size: int) -> int:
    """``m``: the own rows the first own piece takes at most, half of the own rows routing would
    give a rank's experts if balanced (``assignments`` of this rank's tokens, 1 / world_size of
    them its own), known before the counts."""
    return assignments // (2 * world_size)


def piece_sizes(sizes: Sequence[Sequence[int]], rank: int, m: int) -> List[List[int]]:
    """Rows per local expert of each piece, by piece index: own first part (rows ``[0, m)`` of
    the own rows), own second part (the rest), own whole, then the peers in step order; from
    ``sizes[s][e]``, rows from source s for local expert e."""
    ws, own = len(sizes), list(sizes[rank])
    first, left = [], m  # on the call's critical path: one plain pass
    for s in own:
        t = s if s < left else left
        first.append(t)
        left -= t
    return [first, [s - f for s, f in zip(own, first)], own] + [list(sizes[(rank + j) % ws]) for j in range(1, ws)]


def piece_offsets(counts: torch.Tensor, rank: int, m: int) -> torch.Tensor:
    """``[ws + 2, El]`` int32 grouped-GEMM offsets of the pieces, the cumulative sums of their
    :func:`piece_sizes` (same ``m``), from ``counts [ws, El]`` (rows from source s per local
    expert of ``rank``; any strides) on the counts' device, without reading them: the MoE launches
    them before its host waits for the counts. One kernel where Triton runs (a host that launches
    slower than the device computes is the pace there: small launches before the first GEMM leave
    the device idle), else torch ops."""
    if runs_triton(counts):  # one launch: on the host's critical path before the first GEMM (four in torch)
        return piece_offsets_fused(counts, rank, m)
    return piece_offsets_reference(counts, rank, m)


def launch_first(send: torch.Tensor, m: int, offs: torch.Tensor, w_in, w_out, activation: str, trace=None):
    """The first own piece's ``(y, pre)`` on the grouped-GEMM path, launched before the host has
    the counts: the experts of ``send[:m]`` (the own rows first, in step order) with the piece's
    device offsets ``offs``; rows past its end (own rows fewer than m) come out meaningless and
    are never read. Timed as the first forward piece under ``trace`` (export_trace)."""
    recorder = trace.fwd if trace is not None else None
    with torch.no_grad(), piece(recorder, "fwd", "own[:h]", "overlap::moe::rank_chunk[0]"):
        return experts_forward(activation, True, send[:m], None, offs, w_in.transpose(-2, -1),
                               w_out.transpose(-2, -1))


def experts_dgrad(c: RankCall, dy, pre, sizes, offs, w_in, w_out):
    """``(dx, dh, a)``: the data gradient of :func:`experts_forward` and what its weight
    gradients need (``dh`` = d(loss)/d(pre), ``a`` = act(pre))."""
    if c.grouped:
        dh, a = act_backward(c.activation, pre, grouped_mm(dy, w_out, offs))
        return grouped_mm(dh, w_in, offs), dh, a
    da = torch.cat([rows @ w_out[e] for e, rows in enumerate(dy.split(sizes))])
    dh, a = act_backward(c.activation, pre, da)
    return torch.cat([rows @ w_in[e] for e, rows in enumerate(dh.split(sizes))]), dh, a


def experts_wgrad(c: RankCall, grads: dict, x, dy, dh, a, sizes, offs) -> None:
    """``dw_in[e] += dh_e.T @ x_e``, ``dw_out[e] += dy_e.T @ a_e``; a None accumulator is set
    instead ([Note: MoE weight-gradient accumulation])."""
    if c.grouped and len(sizes) > LOOP_WGRAD_EXPERTS:
        for key, l, r in (("w_in", dh, x), ("w_out", dy, a)):
            if grads[key] is None:
                grads[key] = grouped_mm(l.t(), r, offs)
            else:  # added in the GEMM ([Note: expert weight gradients in the GEMM])
                grouped_wgrad(l, r, offs, grads[key])
        return
    for key, l, r, shape in (("w_in", dh, x, (dh.shape[1], x.shape[1])), ("w_out", dy, a, (dy.shape[1], a.shape[1]))):
        if grads[key] is None:
            grads[key] = x.new_zeros((len(sizes), *shape))
        buf = grads[key]
        for e, (lr, rr) in enumerate(zip(l.split(sizes), r.split(sizes))):
            if lr.shape[0]:
                buf[e].addmm_(lr.t(), rr)


def combine_back(c: RankCall, back: torch.Tensor, weights: torch.Tensor, own) -> torch.Tensor:
    """``[T, H]``: per token, its ``k = weights.shape[1]`` assignments' result rows (``c.pos``,
    token-major, grouped k per token) weighted and summed, zero where dropped: the peers' from
    ``back`` in send order, the own rows' (send rows ``[0, own rows)``) where their pieces left them,
    ``own = (first rows, rest, n_first)``: rows ``[0, n_first)`` in ``first``, the others in
    ``rest`` from its row 0 (:func:`~.combine.combine_rows`, one pass; no copy of the own
    results into ``back``)."""
    first, rest, n_first = own
    return combine_rows(first, back, c.pos, weights, sum(c.piece_sizes[2]), late=rest, n_first=n_first)


def forward(c: RankCall, x_TH: torch.Tensor, w_in, w_out, n: int, recorder=None):
    """``(rows [n, H] token-major, saved)``: the module table's forward; ``saved`` (under
    ``c.save``) holds each piece's input rows and pre-activations for :func:`backward`. Without
    ``c.gather`` the rows are the exchange's back rows in send order (the first ``c.kept`` valid,
    but the own rows', which ``c.own_results`` holds for :func:`combine_back`)."""
    H = x_TH.shape[1]
    ex, c.sent = c.sent, None  # started by the caller
    own_x = ex.own().clone() if c.save and ex.shared_send else ex.own()  # the backward's exchange reuses it
    own_y = []  # the own pieces' results, left where their GEMMs wrote them
    saved = {2: (own_x, [])}  # the own rows whole, their two parts' pre-activations
    own = sum(c.piece_sizes[2])
    w_in_t, w_out_t, offs = w_in.transpose(-2, -1), w_out.transpose(-2, -1), c.offsets.unbind(0)
    for i, j, a, b, sizes in c.pieces(backward=False):
        tag = piece_tag(j, a, b, own)
        first = c.first if i == 0 else None  # launched before the counts were read, and timed then
        with piece(None if first is not None else recorder, "fwd", tag, f"overlap::moe::rank_chunk[{j}]"):
            x = own_x[a:b] if j == 0 else ex.pull(j)
            if first is not None:
                y, pre = (t[:b] for t in first)
                c.first = None
            elif b > a:
                y, pre = experts_forward(c.activation, c.grouped, x, sizes, offs[i], w_in_t, w_out_t)
            else:
                y, pre = x.new_empty((0, H)), x.new_empty((0, w_in.shape[1]))
            if j:
                ex.push(j, y)
            else:
                own_y.append(y)
            if c.save and j:
                saved[i] = (x, pre)
            elif c.save:
                saved[2][1].append(pre)
        if c.launch_log is not None:
            c.launch_log.append((f"step{j}[{tag}]", "rank_chunk", "fwd"))
    with piece(recorder, "finish", 0):
        back = ex.finish()
        own = (own_y[0], own_y[1], own_y[0].shape[0])
        if not c.gather:
            c.own_results = own
            return back, saved
        return combine_back(c, back, back.new_ones((n, 1)), own), saved


def backward(c: RankCall, d_rows: torch.Tensor, saved: dict, w_in, w_out, recorder=None):
    """``(dx [n / k, H], dw_in, dw_out)``: the module table's backward, for ``d_rows`` the
    gradient of its token-major rows (``dx[t]``: the sum over token t's assignments of their
    input rows' gradients)."""
    n, H = d_rows.shape
    ex = c.exchange(c.kept, H, d_rows.dtype, d_rows.device, c.capacity_rows)
    # each assignment's row where its input row was sent
    place_in_key_order(d_rows, c.keys, 1, len(c.table) * len(c.piece_sizes[0]), ex.send)  # keys: ws * El
    ex.start(c.table)
    grads = {"w_in": None, "w_out": None}
    own = sum(c.piece_sizes[2])
    offs = c.offsets.unbind(0)
    own_dx = d_rows.new_empty((0, H))  # the own rows' dx, left where their GEMM wrote it
    for i, j, a, b, sizes in c.pieces(backward=True):
        tag = piece_tag(j, a, b, own)
        x, pre = saved.pop(i)
        if not j:
            pre = pre[0] if len(pre) == 1 else torch.cat(pre)
        with piece(recorder, "bwd", tag, f"overlap::moe_bwd::rank_chunk[{j}]"):
            dy = ex.own()[a:b] if j == 0 else ex.pull(j)
            if b == a:
                if j:
                    ex.push(j, dy)
                continue
            dx, dh, acts = experts_dgrad(c, dy, pre, sizes, offs[i], w_in, w_out)
            if j:
                ex.push(j, dx)
            else:
                own_dx = dx
            experts_wgrad(c, grads, x, dy, dh, acts, sizes, offs[i])
        if c.launch_log is not None:
            c.launch_log.append((f"step{j}[{tag}]", "rank_chunk", "bwd"))
    with piece(recorder, "finish", 0):
        dx = combine_back(c, ex.finish(), d_rows.new_ones((n // c.k, c.k)), (own_dx, own_dx, own_dx.shape[0]))
    # None: no rows reached this rank's experts
    return dx, *(torch.zeros_like(w) if grads[k] is None else grads[k] for k, w in (("w_in", w_in), ("w_out", w_out)))


class RankChunkExperts(torch.autograd.Function):
    """``rows [n, H]``: each assignment's expert output, token-major (zero where dropped), for
    the assignment rows ``x_TH[i // k]`` (which ``c.sent`` holds already, in send order); the
    module table, with ``c`` a :class:`RankCall` (without ``c.gather``, under no autograd: the
    rows in send order, :func:`forward`)."""

    @staticmethod
    def forward(ctx, x_TH, w_in, w_out, c: RankCall):
        n = x_TH.shape[0] * c.k
        with recorded_pass(c, backward=False, device=x_TH.device) as recorder:
            rows, saved = forward(c, x_TH, w_in, w_out, n, recorder)
        if c.save:
            ctx.c, ctx.saved = c, saved
            ctx.save_for_backward(w_in, w_out)
        return rows

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, d_rows):
        c: RankCall = ctx.c
        w_in, w_out = ctx.saved_tensors
        saved = take(ctx, "saved")
        with recorded_pass(c, backward=True, device=d_rows.device) as recorder:
            dx, dw_in, dw_out = backward(c, d_rows.contiguous(), saved, w_in, w_out, recorder)
        return dx, dw_in, dw_out, None
