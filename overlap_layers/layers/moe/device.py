"""An MoE call with every size on the device, so that ``config.graph_calls`` can capture it and
replay it ([Note: MoE graph calls]).

Reference: :func:`experts_by_source` returns what :class:`~overlap_layers.layers.moe.layer.OverlapMoE`'s
eager call returns (``layers/moe/layer.py``'s module docstring), up to rounding: for each token, the sum over
its kept assignments of the combine weight times its expert's output (0 for an assignment dropped
by capacity), plus the shared expert's output.

[Note: MoE graph calls]
An eager MoE call reads its all-to-all sizes on the host ([Note: MoE host syncs] in ``layers/moe/eager.py``),
so with many small experts (qwen3-30b-a3b) its forward is host-bound: its ~100 launches take
longer than its GPU work. With ``config.graph_calls``, a call without autograd whose exchange can
run over symmetric memory runs this path instead, captured once per signature and replayed
([Note: graph calls] in ``planning/call_graphs.py``):

* routing, capacity and the send order as the eager call's (one tile), the send rows gathered
  straight into their places in the exchange's send buffer (``place``, without a sort: the own rows first,
  each peer part's first rows in its fixed region, the rest after the own rows);
* :class:`~overlap_layers.runtime.device_all_to_all.DeviceCountAllToAll` with one group per local
  expert, split by source rank: the send order puts this rank's rows for its own experts first
  (the eager rank exchange's step order), so they run in place in the send buffer while the
  peers' rows are pulled on the workspace's pull stream (each part's region by the copy engine,
  in the order rank + 1, rank + 2, ...: the ranks' reads spread over the peers; the rows past the
  region, none when routing is near even, by a kernel on the main stream just before the part's
  experts, where no GEMM holds the SMs it would wait for); each part's rows run as they arrive,
  and their results are pushed back (region on the push stream by the copy engine, the rest by
  the kernel on the main stream) while the next part's run; the last peer's groups come in
  ``LAST_PARTS`` parts (one by default: ``device_all_to_all.py``), and the own
  rows of the second half of the groups run last (copied from the send buffer to the start of a
  slot by the kernel, every slot being free by then), under the last part's push; the own rows'
  results are never pushed (the combine takes them where they are); the shared expert runs right
  after the first own rows, under the first pulls;
* each source's rows arrive grouped by local expert, so one grouped GEMM per projection runs them
  with offsets computed on the device; its buffer holds the slot rows ([Note: MoE slot rows] in ``layers/moe/device_path.py``),
  and the GEMMs and the fused SwiGLU leave the rows past the offsets' end unread and unwritten;
* memory: the peers' rows go to ``SLOTS`` buffers in turn (a pull waits for the experts that
  read its slot last), and at most ``SLOTS`` peers' results are held (the experts of peer i wait
  for the push of peer i - ``SLOTS``, whose results' memory they may take); each slot and result
  holds the slot rows. With more peer parts than slots (EP 4 with the last peer in two parts) the
  call keeps ``2 * SLOTS`` such buffers instead of two per part. Three slots, not two: the copy
  engine moves pulls and pushes at one shared rate, and with two slots each pull waits for the
  experts of the part two before it, which costs more time than the third slot costs memory. With
  as many peer parts as slots or fewer (EP 2, and EP 4 with the last peer in one part) the number
  does not matter;
* the combine (``kernels/moe_combine.py``): one kernel reads each token's k result rows where they are
  (own rows in the two own results, the others at their places in ``back``, an assignment dropped
  by capacity, placed at -1, as 0) and sums them weighted.

Why this shape: a whole exchange before the experts and another after them costs more than the
host time it saves, so the exchange is split by source and each part's experts hide the next
part's pull and the previous part's push. The count table is written and signalled first, by one
kernel storing into every rank's table: signal kernels queued beside the experts' GEMMs wait for
an SM. The bulk of each part moves on the copy engine, in fixed regions: a copy kernel starts only
when the GEMM beside it retires blocks, and slows it; the regions cost workspace memory. The
experts' GEMMs keep every SM (leaving SMs to the copy kernels costs the GEMMs more than the
copies gain). The late own rows run under the last push, which is otherwise exposed. Measured,
with the alternatives that lost: see docs/measurements.md (MoE, device path).

Whether it runs is measured, per signature ([Note: MoE graph calls: the race] in
``layers/moe/device_path.py``): with large experts the eager call is device-bound and its exchange over
the copy engine or NCCL is faster than this path.

It needs every rank's symmetric memory (the agreed copy-engine floor), grouped GEMMs and no aux
loss (the layer hands it out as a tensor made by the call, which a replay does not make); a call
with autograd runs it too ([Note: MoE training graphs]). The exchange uses a workspace of its own
(``shared_workspace(..., "device_counts")``): its peers write its table rows without a signal of
this rank's call, which data of another exchange in the same buffer would race. The graph's
signature holds every rank's (batch, seq), so that ranks holding different token counts capture
at the same calls. The plan the layer verified on its eager calls does not apply: this path always
splits by source.

[Note: MoE training graphs]
A call with autograd runs the device path through :class:`_SourceExperts`, which takes the
combine weights, so that the router gets its gradient as in the eager call;
``config.graph_calls`` captures its forward and its backward (``planning/call_graphs.py``: the saved
tensors live in the graphs' pool). What the backward needs stays on the device:

* the forward keeps each part's input rows and pre-activations, at the slot rows: each peer
  part gets a slot of its own instead of ``SLOTS`` in turn, and each own half's rows go straight
  to a buffer of their own ([Note: own rows kept apart]); its combine weights the rows as a call
  without autograd does and also keeps each assignment's row, token-major, for the weights'
  gradient ([Note: MoE weighted combine] in ``kernels/moe_combine.py``);
* the backward's first kernel computes the weights' gradient and writes each assignment's output
  gradient (its weight times dy) where its input row went (the forward's ``pos``; the late own
  rows' into a buffer of their own: [Note: own rows kept apart]), then reverses
  the exchange part by part: pull the rows' gradients (every part's at once, into a slot each),
  the data gradient (two grouped GEMMs and SwiGLU's backward on the counted rows only, dh over
  the pre-activations), push it back to its source; then the weight gradients of every part in
  one pass ([Note: expert weight gradients in one pass] in ``kernels/expert_wgrad.py``), under the last
  push, or, in the layer's graph calls, after the backward's replay ([Note: deferred gradients]
  in ``planning/call_graphs.py``); one combine pass sums each token's k rows of dx, the own ones where
  they were made.

Replayed, a training call does not pay the eager backward's host time, but it still computes
more than the compute-only reference: the experts' GEMMs split into parts run about a third slower
per row than whole ones (smaller GEMMs, and each group's partial last row tile in every part),
plus the copies, placing and combine passes. Running the peers' parts on two alternating compute
streams, a receive layout by expert, and smaller grouped-GEMM row tiles were measured and do not
pay (each part's push waits for GEMMs that then end later; the layouts win less than they cost;
smaller tiles run slower than ``torch._grouped_mm``'s 128x256): see docs/measurements.md (MoE,
device path). The training graphs keep each part's rows and activations for the one weight-gradient
pass: ``memory_budget`` bounds them in the race.

[Note: own rows kept apart]
A call without autograd runs its first own rows in place in the send buffer and copies the late
ones into slot 0 once every pull has landed. A training call keeps its own rows for the weights'
gradient past the next exchange on the workspace (another layer's, or its own backward's), which
overwrites the send buffer. Rather than copy them out at the end of the forward, the placing
kernel puts the own rows of each half straight into a buffer of
its own, from row 0 (``DeviceCountAllToAll.place``'s ``own``, the diverts of
:func:`~overlap_layers.kernels.send_rows.place_by_key`), where the experts read them and the
backward finds them, and no copy runs. ``pos`` is unchanged, so the combine is too. The backward
does the same for its late own rows: the kernel that weighs the output gradient
(``weigh_backward_into``) puts their rows' gradients straight into a buffer of their own (its
``divert``: their places, ``n_first .. n_own``) and the rest at their places in the send buffer,
where the first own rows' are read in place, so no copy runs on the experts' stream between the
last peer part and their data gradient. Rows past a buffer are not written, as past any slot
([Note: MoE slot rows]). Measured: see docs/measurements.md (MoE, own rows kept apart).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ...kernels.expert_wgrad import WgradParts, grouped_wgrad_parts
from ...planning.first_order import first_order, keeps_graph, take
from ...runtime.streams import PartStreams
from ..common.activations import act_backward
from .combine import combine_rows, weigh_backward_into
from .experts import experts_forward, grouped_mm


SLOTS = 3  # peers' rows and results held at once ([Note: MoE graph calls]: memory)


class SourceCall:
    """One device-path call's state between its passes: the layer's sizes, the exchange, the
    routing's ``keys`` and ``counts`` (``[ws, El]`` int32); the forward sets ``pos`` (each
    assignment's send row, -1 where dropped) and ``ends`` (``[source, El]`` int32: each source's
    grouped-GEMM offsets), which the backward reuses (its rows go where the forward's went)."""

    def __init__(self, layer, exchange, keys: torch.Tensor, counts: torch.Tensor, slot: Optional[int] = None,
                 report: Optional[tuple] = None, defer: Optional[Callable] = None) -> None:
        self.activation, self.k = layer.activation, layer.top_k
        self.ws, self.El, self.rank = layer.world_size, layer.num_local_experts, layer.rank
        self.exchange, self.keys, self.counts = exchange, keys, counts
        self.slot = exchange.rows if slot is None else slot  # rows of each part's buffers ([Note: MoE slot rows])
        if not exchange.layout.largest_region <= self.slot <= exchange.rows:
            raise ValueError(f"slot={slot}; valid: {exchange.layout.largest_region} .. {exchange.rows} rows (the "
                             "exchange's largest region .. its bound of rows), or None (the bound)")
        self.pos: Optional[torch.Tensor] = None
        self.ends: Optional[torch.Tensor] = None
        self.report = report  # (tensor, event or None): where the forward copies its peak count, then records
        self.peak: Optional[torch.Tensor] = None  # that count on the device, while the copy may be in flight
        self.defer = defer  # CallGraphs.defer of the weights' owner, or None ([Note: deferred gradients])
        # the own rows of the groups from `split` on run last, under the last part's push
        self.split = self.El // 2 if self.ws > 1 and self.El > 1 else self.El

    def peers(self) -> list:
        """``(source, part)`` in run order: sources rank + 1, rank + 2, ..., each in its parts."""
        return [(s, part) for s in ((self.rank + j) % self.ws for j in range(1, self.ws))
                for part in self.exchange.parts(s)]

    def offsets(self, source: int, groups) -> Tuple[int, int, torch.Tensor]:
        """``(a, b, offs)``: the groups ``a .. b-1`` (``groups``; None: all) of ``source``'s rows and
        their grouped-GEMM offsets counted from their first row."""
        a, b = (0, self.El) if groups is None else groups
        ends = self.ends[source]
        return a, b, (ends[a:b] - ends[a - 1] if a else ends[:b])


def _pulls(c: SourceCall, s: PartStreams, peers: list, slots: list):
    """``pull(i)``: the region of peer part i into its slot, on the pull stream, once the slot's
    last rows were read; the first ``len(slots)`` are launched here."""
    def pull(i: int) -> None:
        with s.on(0):
            if i >= len(slots):
                s.pull_after_read(i - len(slots))
            c.exchange.pull(peers[i][0], slots[i % len(slots)], peers[i][1])
            s.mark(s.arrived, i)

    s.fork()
    for i in range(len(slots)):
        pull(i)
    return pull


def _forward(c: SourceCall, x_TH: torch.Tensor, w_in, w_out, extra, save: bool):
    """The forward pass (module docstring): ``(own, back, late, added, saved)``, the own results of
    the groups before ``c.split``, ``back`` (the peers' results at their send rows), ``late``
    (:func:`~.combine.combine_rows`' ``late`` and ``n_first``, or empty), ``extra()``'s
    result; with ``save``, ``saved`` holds each part's input rows and pre-activations for
    :func:`_backward`: "own", each peer part's index, "late". Saving, each peer part keeps a slot
    of its own, and the own rows go to buffers of their own ([Note: own rows kept apart])."""
    ex, H, El, rank = c.exchange, x_TH.shape[1], c.El, c.rank
    own_in = (c.split, x_TH.new_empty((c.slot, H)), x_TH.new_empty((c.slot, H)) if c.split < El else None) \
        if save else None
    # each assignment's row of send (-1: dropped by capacity); saving, the own rows go to own_in's buffers
    c.pos = ex.place(x_TH, c.keys, c.k, c.counts, own=own_in)
    ex.ready(c.counts)
    c.ends = torch.cumsum(ex.recv_counts, 1, dtype=torch.int32)  # [source, El]: grouped-GEMM offsets
    if c.slot < ex.rows:  # past the slots, no row is read or written ([Note: MoE slot rows])
        c.ends.clamp_(max=c.slot)
    s = PartStreams(ex, x_TH.is_cuda, SLOTS)
    if c.report is not None:  # the largest count (every rank's table holds every rank's), read from here on
        c.peak = ex.table.sum(2, dtype=torch.int32).amax()  # c holds it: the push stream reads it
        s.push_after_main()  # copied there (its first push comes later), not between the experts' kernels
        with s.on(1):
            c.report[0].copy_(c.peak, non_blocking=True)
            if c.report[1] is not None:
                c.report[1].record()
    peers = c.peers()
    slots = [x_TH.new_empty((c.slot, H)) for _ in range(len(peers) if save else min(SLOTS, len(peers)))]
    pull = _pulls(c, s, peers, slots)
    w_in_t, w_out_t = w_in.transpose(-2, -1), w_out.transpose(-2, -1)
    saved = {}

    def experts(key, rows: torch.Tensor, source: int, groups=None) -> torch.Tensor:
        a, b, offs = c.offsets(source, groups)
        y, pre = experts_forward(c.activation, True, rows, None, offs, w_in_t[a:b], w_out_t[a:b], offs[-1:])
        if save:
            saved[key] = (rows, pre)
        return y

    first = (0, c.split) if c.split < El else None
    own = experts("own", own_in[1] if save else ex.send[:c.slot], rank, first)  # else in place: they lead send's
    added = extra() if extra is not None else None
    results = {}  # peer part index -> its results, held until the main stream waited for their push
    for i, (src, part) in enumerate(peers):
        s.before_part(i)
        slot = ex.pull_rest(src, slots[i % len(slots)], part)  # on this stream: a kernel beside no GEMM
        results.pop(i - SLOTS, None)  # pushed: its memory may hold these results
        results[i] = experts(i, slot, src, part)
        s.mark(s.read, i)
        if i + len(slots) < len(peers):
            pull(i + len(slots))  # launched after the event it waits for was recorded
        ex.push_rest(src, results[i], part)
        s.push(ex, src, results[i], part, i)
    late = {}
    if c.split < El:  # every pull landed and every slot was read (this stream's order): slot 0 takes them
        rows = own_in[2] if save else ex.own_rows(c.split, slots[0])
        late = dict(late=experts("late", rows, rank, (c.split, El)), n_first=c.ends[rank][c.split - 1])
    s.join()
    return own, ex.finish(), late, added, saved  # own results were not pushed: the combine reads them in place


def _segments(c: SourceCall, parts: list, s: PartStreams) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~overlap_layers.kernels.expert_wgrad.grouped_wgrad_parts`' ``(part, lo, hi)`` ``[source, El]`` for the
    backward's ``parts`` (``(source, (a, b))`` each, in order): source s's rows of group g lie in
    the part holding that group, from its first group's first row on. Allocated on the current
    stream, written on the push stream (which the caller forked)."""
    held = torch.empty((2, c.ws, c.El), dtype=torch.int64, device=c.ends.device)  # each one's part, first group
    out = torch.empty((4, c.ws, c.El), dtype=c.ends.dtype, device=c.ends.device)  # starts, base, lo, hi
    with s.on(1):
        for p, (src, (a, b)) in enumerate(parts):
            held[0, src, a:b].fill_(p)
            held[1, src, a:b].fill_(a)
        torch.sub(c.ends, c.exchange.recv_counts, out=out[0])
        torch.gather(out[0], 1, held[1], out=out[1])
        torch.sub(out[0], out[1], out=out[2])
        torch.sub(c.ends, out[1], out=out[3])
    return held[0], out[2], out[3]


def _backward(c: SourceCall, saved: dict, dy: torch.Tensor, late_dy: Optional[torch.Tensor], w_in, w_out,
              in_place: bool = True, wants: Tuple[bool, bool] = (True, True)):
    """``(dx [T, H], dw_in, dw_out)`` (a weight's None where ``wants`` says so) with each
    assignment's output-row gradient already at the place its input row went (the forward's
    ``c.pos`` in the exchange's send buffer; ``dy [T, H]`` gives the shapes), but the own rows'
    of the groups from ``c.split`` on, which ``late_dy`` (``[c.slot, H]``; None where there are no
    such groups) holds from row 0 ([Note: own rows kept apart]): the forward's exchange reversed.
    Each source's rows run as they arrive (the data gradient, pushed back to the source), the
    weight gradients of every part in one pass at the end, under the last push ([Note: expert
    weight gradients in one pass]; or, where ``c.defer`` takes them, after the replay of the
    backward being captured: the placeholders it gives are returned), and one combine pass sums
    each token's k rows of dx. ``in_place``: dh overwrites the saved pre-activations (else
    buffers of its own: a second backward reads them again)."""
    ex, H, El, rank = c.exchange, dy.shape[1], c.El, c.rank
    ex.ready(c.counts)
    peers = c.peers()
    first = (0, c.split)
    late = (c.split, El) if c.split < El else None
    # every part's rows stay for the weight gradients: a slot per peer part (all pulled at once),
    # the own rows in the send buffer, the late ones in late_dy
    slots = [dy.new_empty((c.slot, H)) for _ in peers] + ([late_dy] if late else [])
    keys = ["own", *range(len(peers))] + (["late"] if late else [])
    spans = [(rank, first)] + [(src, part or (0, El)) for src, part in peers] + ([(rank, late)] if late else [])
    dys = [ex.send[:c.slot]] + slots
    acts = [saved[key][1].new_empty((c.slot, w_out.shape[2])) for key in keys]
    dhs = [saved[key][1] if in_place else torch.empty_like(saved[key][1]) for key in keys]
    s = PartStreams(ex, dy.is_cuda, SLOTS)
    _pulls(c, s, peers, slots[:len(peers)])  # every pull at once
    side = s.push_stream
    s.push_after_main()  # the weight gradients' tables, on the push stream before its first push
    tables = _segments(c, spans, s)
    # the weight gradients autograd wants: (their parts, the weight)
    wanted = [(WgradParts(a, b, side), w) for a, b, w, want in (
        (dhs, [saved[key][0] for key in keys], w_in, wants[0]), (dys, acts, w_out, wants[1])) if want]
    written = {}
    with s.on(1):
        s.mark(written, 0)

    def dgrad(p: int, source: int, groups=None) -> torch.Tensor:
        """Part p's dx; its dh goes to dhs[p], its activations to acts[p]."""
        a, b, offs = c.offsets(source, groups)
        act_backward(c.activation, saved[keys[p]][1], grouped_mm(dys[p], w_out[a:b], offs), out=dhs[p],
                      h_out=acts[p], rows=offs[-1:])
        return grouped_mm(dhs[p], w_in[a:b], offs)

    own = dgrad(0, rank, first)
    results = {}
    for i, (src, part) in enumerate(peers):
        s.before_part(i)
        ex.pull_rest(src, slots[i], part)
        results.pop(i - SLOTS, None)
        results[i] = dgrad(1 + i, src, part)
        ex.push_rest(src, results[i], part)
        s.push(ex, src, results[i], part, i)
    done = {}
    if late:
        done = dict(late=dgrad(len(keys) - 1, rank, late), n_first=c.ends[rank][c.split - 1])

    def weight_grads() -> tuple:
        return tuple(grouped_wgrad_parts(parts, *tables, torch.empty_like(w)) for parts, w in wanted)

    # deferred only where each comes back as a gradient: one autograd drops is not handed out
    grads = c.defer(weight_grads, [w for _, w in wanted]) if c.defer is not None and wanted else None
    if grads is None:
        s.main_after(written, 0)  # not the pushes after them: the last runs under these GEMMs
        grads = weight_grads()
    grads = iter(grads)
    dw_in, dw_out = (next(grads) if want else None for want in wants)
    s.join()
    back = ex.finish()
    dx = combine_rows(own, back, c.pos, dy.new_ones((dy.shape[0], c.k)), c.ends[rank][-1], **done)
    return dx, dw_in, dw_out


class _SourceExperts(torch.autograd.Function):
    """``y [T, H]``: the routed experts' output for this rank's tokens ``x_TH`` with ``weights
    [T, k]`` (of ``x_TH``'s dtype) through the device path, differentiable in ``x_TH``, ``w_in``,
    ``w_out`` and ``weights`` (:func:`_forward` saving, :func:`_backward`); ``c`` a
    :class:`SourceCall`. The combine keeps each assignment's row, token-major, for the weights'
    gradient, and the backward places each row's gradient where its input row went as it computes
    that gradient (:func:`~.combine.weigh_backward_into`)."""

    @staticmethod
    def forward(ctx, x_TH, w_in, w_out, weights, c: SourceCall):
        own, back, late, _, saved = _forward(c, x_TH, w_in, w_out, None, save=True)
        rows = own.new_empty((x_TH.shape[0] * c.k, x_TH.shape[1]))
        y = combine_rows(own, back, c.pos, weights, c.ends[c.rank][-1], rows_out=rows, **late)
        ctx.c, ctx.saved = c, saved
        ctx.save_for_backward(w_in, w_out, weights, rows)
        return y

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy):
        w_in, w_out, weights, rows = ctx.saved_tensors
        c, dy = ctx.c, dy.contiguous()
        late_dy = dy.new_empty((c.slot, dy.shape[1])) if c.split < c.El else None  # [Note: own rows kept apart]
        # the late rows' places (a stack of views: an index list would copy from the host, which a capture forbids)
        ends = c.ends[c.rank]
        late = (torch.stack((ends[c.split - 1], ends[-1])), late_dy) if late_dy is not None else None
        d_weights = weigh_backward_into(rows.view(-1, c.k, dy.shape[1]), weights, dy, c.pos, c.exchange.send, late)
        dx, dw_in, dw_out = _backward(c, take(ctx, "saved"), dy, late_dy, w_in, w_out, in_place=not keeps_graph(),
                                      wants=tuple(ctx.needs_input_grad[1:3]))
        return dx, dw_in, dw_out, d_weights, None


def experts_by_source(layer, x_TH: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, exchange,
                      extra: Optional[Callable[[], Optional[torch.Tensor]]] = None, slot: Optional[int] = None,
                      report: Optional[tuple] = None, defer: Optional[Callable] = None) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` for this rank's tokens ``x_TH`` (module docstring),
    plus ``extra()`` where it returns a tensor (the shared expert: launched after the own rows'
    experts without autograd, after the combine with it), through ``exchange`` (a
    ``DeviceCountAllToAll`` of ``layer.num_local_experts`` groups, or anything with its ``send``,
    ``rows``, ``place``, ``ready``, ``recv_counts``, ``parts``, ``pull``, ``pull_rest``, ``push``,
    ``push_rest``, ``own_rows``, ``finish`` and, for side streams, ``streams``), with no value read
    on the host. Under autograd ([Note: MoE training graphs]) the combine weights in autograd
    (:class:`_SourceExperts` takes the weights), so that the router gets its gradient.

    ``slot``: the rows of each part's buffers (None: the exchange's bound, ``rows``; [Note: MoE
    slot rows]). With fewer, the result is the reference only if no rank sends another more rows
    than ``slot``: ``report`` ``(tensor, event or None)``, where given, gets that largest count
    (copied without a wait: a host tensor should be pinned) and then the event's record, both
    right after the exchange's counts, so the caller can read it before it uses the result.

    ``defer``: a ``CallGraphs.defer`` ([Note: deferred gradients] in ``planning/call_graphs.py``) the
    backward hands the weights' gradients to (only where ``w_in`` and ``w_out`` are the
    parameters themselves, whose gradients autograd returns as they are)."""
    ws, El = layer.world_size, layer.num_local_experts
    keys, weights, counts = layer._route_keys(x_TH, 1, step_order=True)  # own experts' keys first
    c = SourceCall(layer, exchange, keys, counts.view(ws, El).to(torch.int32), slot, report, defer)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_TH, w_in, w_out, weights)):
        y = _SourceExperts.apply(x_TH, w_in, w_out, weights.to(x_TH.dtype), c)
        added = extra() if extra is not None else None
    else:
        own, back, late, added, _ = _forward(c, x_TH, w_in, w_out, extra, save=False)
        y = combine_rows(own, back, c.pos, weights, c.ends[c.rank][-1], **late)  # own rows: counts[rank]'s sum
    return y if added is None else y + added
