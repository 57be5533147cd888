"""An all-to-all whose row counts never reach the host, so that a CUDA graph can replay it with
new counts at each replay: the MoE's exchange in graph-replayed calls ([Note: sync-free
exchange], ``layers/moe/device.py``), split by source rank, its bulk on the copy engine.

Reference, for rank r of ws ranks, with G groups per rank (the MoE's local experts) and the count
table ``table[s][d][g]`` (rows rank s sends to rank d's group g, on the device; row s comes from
rank s). Rank s's rows in send order are its rows by destination, then group, destinations in the
order s, s + 1, ... ; the rows it sends d = s + j (j > 0) come in the parts ``parts_at(j)`` (ranges
of groups: all G in one part, except for j = 1 where G > 1, in ``LAST_PARTS`` ranges: a
destination's last peer, whose rows it runs and returns part by part; one part by default).
Each send row has a place in s's send buffer ``[buffer_rows, W]`` (:class:`RegionLayout`)::

    rows [0, rows)            s's rows for itself, in send order, then the overflow rows of each
                              part below, in send order
    rows [rows, buffer_rows)  one region per (j, part), of a fixed capacity ``cap`` (the part's
                              even share of ``rows`` and 1/8 more): the part's first ``cap`` rows

    pull(s, part)       : out[i] = the i-th row s sends r in that part, i < its count
    push(s, part, res)  : send_s[the place of that row] = res[i]   (``back``: ``send`` itself)
    recv_counts         = table[:, r]                    ([source][group])

so once every rank has pushed its results for every source and part, ``back`` holds, at the place
of each of r's send rows to a peer, the result its destination computed for it, and at the places
of its own rows those rows, untouched ([Note: results where their rows were]).

A region's rows move by a copy of the whole region on the copy engine (its size is fixed on the
host, so a graph captures it; rows past the part's count are copied too and never read); the
overflow rows, whose number is known only on the device, by :func:`copy_rows_by_table`, a Triton
kernel that reads its segment on the device. With routing near even a part fits its region and
the kernel copies nothing. On CPU without Triton the kernel's torch path loops over host copies
(its reference, and how the CPU tests check the layout). :class:`DeviceCountAllToAll` runs it over
symmetric memory: each rank writes its row of the table into every rank's table and signals
(:meth:`~DeviceCountAllToAll.ready`), then pulls and pushes source by source, and signals again
(:meth:`~DeviceCountAllToAll.finish`).

[Note: sync-free exchange]
The MoE's exchanges read their split sizes on the host ([Note: MoE host syncs] in
``layers/moe/eager.py``), so its calls stay eager, and with many small experts (qwen3-30b-a3b) an eager
call is host-bound (it launches ~100 ops at tens of microseconds of host each). Graph replay needs
every size on the device: the copy engine takes its sizes from the host, an SM kernel does not.
The copy engine pulls faster than a copy kernel and slows the GEMMs beside it less
(docs/measurements.md, MoE device path). The exchange is split by source so that the MoE can run each
source's rows as they arrive and push their results while the next source's run
(``layers/moe/device.py``, [Note: MoE graph calls]): a whole exchange before the experts and
another after them costs more than the host time replay saves.

Most rows move on the copy engine, in fixed regions: a copy kernel starts only when the grouped
GEMM beside it retires its blocks, and slows the GEMMs it runs beside, so the kernel moves only
the rows past a region (none when routing is near even). The regions cost memory: ``buffer_rows``
is ``rows`` times 1.56 at EP 2 and 1.84 at EP 4. Measured: see docs/measurements.md (MoE, device
path).

Signals, on the workspace's signal pad: per call and peer, channel TABLE "my row of your table
and my send rows are in place" (put by ``ready`` after the table copies, waited before any pull)
and channel BACK "I have pulled from you and pushed my results for your rows into your ``back``"
(put by ``finish``, after every pull and push, waited before it returns). Reuse without barriers:
a rank writes its send rows and table rows (next call) only after waiting every peer's BACK, put
after the peer's last reads of them (its pulls), its last writes of results there (its pushes) and
its last reads of its own table (its segments); ``back`` is written by peers only after this
rank's next TABLE, so it stays valid until the next ``place``.
Every exchange on one workspace runs in the same order on every rank, its signals in one stream
order (a call's ``ready`` may run on a side stream that waited for the previous ``finish``).
The exchange has a workspace of its own (``runtime/symmetric.py``): peers write its table with no
signal of this rank's call, which another exchange's data in the same buffer would race.

[Note: results where their rows were]
A peer's result for a send row lands at that row's place in ``send``: ``back`` is ``send`` itself,
not a buffer of its own beside it, as large. That is safe without another signal:
the only rank that writes a place is the destination of its row, which pulled the row before it
computed the result it pushes there (its pull, experts and push in its streams' order), and the
places of different rows, the regions' tails included, never overlap. The own rows' places are
never pushed to, so what ``place`` put there stays for the whole call (the MoE's own rows, read in
place, and in its backward after the last push). The price is that a call's ``send`` rows are
gone once peers have pushed: nothing may read a peer row's input from ``send`` after ``ready``,
except the pulls. The workspace holds ``buffer_rows`` rows once instead of twice: at
qwen3-30b-a3b's shape (EP 4, 8192 tokens per rank, top 8, hidden 2048, bf16) 472 MiB instead of
944 (``bench/probes/moe_memory_probe.py``).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from ..kernels.device_all_to_all import (CTAS, copy_rows_fused, copy_rows_reference, key_places_fused, own_tail_fused,
                                         remote_pointers, rests_fused, write_table_rows)
from ..kernels.send_rows import place_by_key
from ..kernels.triton_gate import runs_triton
from .symmetric import aligned

TABLE, BACK = 0, 1  # signal channels ([Note: sync-free exchange])
SLACK = 0.125  # a region's rows beyond its part's even share of the rows
# parts of a destination's last peer's rows: the last part's push has nothing beside it, and each part
# costs its own kernels and gaps. The own rows' second half runs last, under that push (and the
# backward's weight gradients after it), so more parts gain nothing and one part keeps one buffer set
# less per call; the tests run two as well. Measured: see docs/measurements.md (MoE, slot rows)
LAST_PARTS = 1
# programs per SM of a copy on the stream of the experts, where no GEMM runs beside it: every SM copies
# (the late own rows' copy into a slot; measured: see docs/measurements.md, MoE device path)
_MAIN_PER_SM = 4

Part = Optional[Tuple[int, int]]  # a range of groups (first, end); None: every group


def last_peer_parts(groups: int) -> List[Part]:
    """The parts of a destination's last peer's rows: ``LAST_PARTS`` ranges of groups, as even as
    the groups allow (one part, None, where that is one)."""
    parts = min(LAST_PARTS, groups)
    if parts <= 1:
        return [None]
    cuts = [groups * i // parts for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def region_caps(ws: int, rows: int, groups: int, slack: float = SLACK) -> dict:
    """``{(j, part): cap}`` in send order: the rows of each region of :class:`RegionLayout` (the
    part's even share of ``rows`` and ``slack`` more, at most ``rows``)."""
    caps = {}
    for j in range(1, ws):
        for part in last_peer_parts(groups) if j == 1 else [None]:
            a, b = (0, groups) if part is None else part
            caps[j, part] = min(rows, math.ceil(rows * (b - a) * (1 + slack) / (ws * groups)))
    return caps


class RegionLayout:
    """Where each of a source's send rows lies in its send buffer (module docstring), for ``ws``
    ranks, ``rows`` send rows at most per rank and ``groups`` groups per rank. Host side:
    :meth:`parts_at`, :meth:`region`, ``buffer_rows``; device side, from counts on ``device``
    (no host read: a graph captures them): :meth:`key_places`, :meth:`rests` (and
    :meth:`rest`, one of them) and :meth:`own_tail`."""

    def __init__(self, ws: int, rows: int, groups: int, device: torch.device, slack: float = SLACK) -> None:
        self.ws, self.rows, self.groups = ws, rows, groups
        self._regions = {}  # (j, part) -> (start, cap)
        order = [(0, None)]  # the source's segments in send order: its own rows, then each (j, part)
        start = rows
        for (j, part), cap in region_caps(ws, rows, groups, slack).items():
            self._regions[j, part] = (start, cap)
            order.append((j, part))
            start += cap
        self.buffer_rows = start
        self.largest_region = max([cap for _, cap in self._regions.values()], default=0)
        self._index = {seg: k for k, seg in enumerate(order)}
        member = torch.zeros(len(order), ws, groups, dtype=torch.int64)
        for k, (j, part) in enumerate(order):
            a, b = (0, groups) if part is None else part
            member[k, j, a:b] = 1
        # made here, not in a capture (a host-to-device copy cannot be captured)
        self._member = member.view(len(order), ws * groups).to(device)
        # [source, column]: the counts' column of each of the source's (destination, group) in its send order
        send_order = [[((s + i // groups) % ws) * groups + i % groups for i in range(ws * groups)] for s in range(ws)]
        self._send_order = torch.tensor(send_order, dtype=torch.int64).to(device)
        self._caps = torch.tensor([0] + [self._regions[s][1] for s in order[1:]], dtype=torch.int64).to(device)
        self._starts = torch.tensor([0] + [self._regions[s][0] for s in order[1:]], dtype=torch.int64).to(device)
        # the segment of each send-order index (destination step j, then group)
        self._segment = member.view(len(order), ws * groups).argmax(0).to(device)

    def parts_at(self, j: int) -> List[Part]:
        """The parts of the rows a source sends the rank ``j`` after it (``0 < j < ws``): for
        ``j = 1`` (the destination's last peer) ``LAST_PARTS`` ranges of groups, as even as the
        groups allow, else one part of every group."""
        return last_peer_parts(self.groups) if j == 1 else [None]

    def region(self, j: int, part: Part) -> Tuple[int, int]:
        """(first row, rows) of that part's region in the source's send buffer."""
        if (j, part) not in self._regions:
            raise ValueError(f"part {part!r} of the rows for the rank {j} on; valid: {self.parts_at(j)} "
                             f"(0 < {j} < {self.ws})")
        return self._regions[j, part]

    def _segments(self, counts: torch.Tensor, send_order: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The counts ``[..., ws * groups]`` (by destination rank, then group) in their sources'
        send order (rows of ``_send_order``), then ``[..., S]`` each: the rows of each segment (own
        rows, then each part), those past its region and where those begin."""
        flat = torch.gather(counts.to(torch.int64), -1, send_order)  # in each source's send order
        n = (flat.unsqueeze(-2) * self._member).sum(-1)
        over = torch.clamp_min(n - self._caps, 0)  # the own rows: all of them (cap 0)
        return flat, n, over, torch.cumsum(over, -1) - over

    def key_places(self, counts: torch.Tensor, source: int) -> torch.Tensor:
        """``[3, ws * groups]`` int64 ``(A, C, D)`` from ``source``'s counts (``[ws, groups]``):
        the i-th of its rows with the send-order index e (``i`` from 0) lies at ``A[e] + i`` if
        ``i < C[e]`` (in its part's region), else at ``D[e] + i`` (its own rows and the rows past
        a region, from row 0). One kernel where Triton runs, else torch ops."""
        E = self.ws * self.groups
        if runs_triton(counts):
            return key_places_fused(counts.reshape(E), self._send_order[source], self._segment, self._caps,
                                    self._starts)
        flat, seg_n, _, over_start = self._segments(counts.reshape(E), self._send_order[source])
        seg = self._segment
        off = torch.cumsum(flat, 0) - flat - (torch.cumsum(seg_n, 0) - seg_n)[seg]
        cap = self._caps[seg]
        return torch.stack([self._starts[seg] + off, cap - off, over_start[seg] + off - cap])

    def own_tail(self, counts: torch.Tensor, source: int, first: int) -> torch.Tensor:
        """``source``'s rows for its own groups ``first ..`` (its counts ``[ws, groups]``), as
        :func:`copy_rows_by_table` segments ``[4, 1]``: (source, their first place, row 0, rows)."""
        if not 0 < first < self.groups:
            raise ValueError(f"first={first}; valid: a group 1 .. {self.groups - 1} (the own rows from it on)")
        if runs_triton(counts):  # one launch (the torch ops below are six)
            return own_tail_fused(counts.reshape(-1), source, first, self.groups)
        mine = counts.reshape(self.ws, self.groups)[source].to(torch.int64)
        return torch.stack([torch.full_like(mine[0], source), mine[:first].sum(), torch.zeros_like(mine[0]),
                            mine[first:].sum()]).view(4, 1)

    def rests(self, table: torch.Tensor) -> torch.Tensor:
        """``[ws, S, 4]`` int64, for every source and segment of its send rows, the overflow as a
        :func:`copy_rows_by_table` segment: (source, first place in its send buffer, row in the
        pulled rows = the region's capacity, rows). One pass over the table: :meth:`rest` picks
        a source's part from it without a kernel of its own. One kernel where Triton runs (the
        torch ops below are about ten)."""
        if runs_triton(table):
            return rests_fused(table.reshape(-1), self._send_order, self._segment, self._caps, self.ws, self.groups)
        _, _, over, over_start = self._segments(table.reshape(self.ws, self.ws * self.groups), self._send_order)
        sources = torch.arange(self.ws, device=table.device)[:, None].expand_as(over)
        return torch.stack([sources, over_start, self._caps.expand_as(over), over], -1)

    def rest(self, rests: torch.Tensor, dest: int, source: int, part: Part) -> torch.Tensor:
        """``[4, 1]``: the segment of :meth:`rests` for ``source``'s rows for ``dest`` in ``part``
        (a view)."""
        j = (dest - source) % self.ws
        self.region(j, part)
        return rests[source, self._index[j, part]].view(4, 1)


def own_diverts(groups: int, own: Optional[Tuple[int, torch.Tensor, Optional[torch.Tensor]]]) -> list:
    """:func:`~overlap_layers.kernels.send_rows.place_by_key`'s diverts for a source's rows for itself (its send-order
    keys ``0 .. groups-1``) given as ``own`` ``(split, first, late)``: those of its groups before
    ``split`` go to ``first``, those from ``split`` on to ``late`` (None where ``split`` is
    ``groups``), each from its row 0 and clipped at its rows, instead of the send buffer; none
    where ``own`` is None."""
    if own is None:
        return []
    split, first, late = own
    if not 0 < split <= groups or (late is None) != (split == groups):
        raise ValueError(f"own split={split}, late {'None' if late is None else 'given'}; valid: 0 < split <= "
                         f"{groups}, a late buffer exactly where split < {groups}")
    return [(0, split, first)] + ([(split, groups, late)] if late is not None else [])


def copy_rows_by_table(segs: torch.Tensor, remotes: Sequence[torch.Tensor], local: torch.Tensor, push: bool,
                       pointers: Optional[torch.Tensor] = None, programs: int = CTAS) -> None:
    """Copy the rows of the segments ``segs`` (``[4, n]`` int64 on ``local``'s device; per
    column: the remote rank, where its rows begin in that rank's buffer, where in ``local``, how
    many: :meth:`RegionLayout.rest`). Pull (``push=False``): ``remotes[s]`` is rank s's send
    rows and ``local`` this rank's pulled rows; each column's rows of ``remotes[source]`` go to
    its rows of ``local``. Push: ``local`` holds this rank's results (laid out as pulled) and
    ``remotes[s]`` is rank s's back rows; the same rows go the other way. Every tensor is
    ``[*, W]``, contiguous, of one dtype, the remotes of one shape; a row past either side's rows
    is not copied (a safety net for counts past the buffers: never a write out of bounds).
    ``pointers``: the remotes' :func:`remote_pointers` (made here if None); ``programs``: the
    kernel's programs on a GPU (few beside a GEMM, many where nothing runs beside it)."""
    if segs.dim() != 2 or segs.shape[0] != 4 or any(t.shape != remotes[0].shape or t.dtype != local.dtype
                                                    for t in remotes) or remotes[0].shape[1:] != local.shape[1:]:
        raise ValueError(f"copy_rows_by_table: segments {tuple(segs.shape)}, remotes "
                         f"{[tuple(t.shape) for t in remotes]} and local rows {tuple(local.shape)} {local.dtype}; "
                         "valid: segments [4, n], remotes of one shape, rows as wide as the local ones, one dtype")
    if runs_triton(local):
        if pointers is None:
            pointers = remote_pointers(remotes)
        copy_rows_fused(segs, pointers, local, remotes[0].shape[0], push,
                        programs if local.is_cuda else 3)  # under the interpreter: a few, each taking several blocks
        return
    copy_rows_reference(segs, remotes, local, push)


class DeviceCountAllToAll:
    """The exchange over a group's symmetric workspace (module docstring): per call, this rank's
    send rows go to their places in ``send`` (:meth:`place`), then :meth:`ready` with
    this rank's counts per destination and group, for each peer source and each of its
    :meth:`parts` both :meth:`pull` (the region, on the copy engine) and :meth:`pull_rest` (the
    overflow, by a kernel), both :meth:`push` and :meth:`push_rest` of the results (any order, on
    any streams that follow ``ready``; a pull's two steps write other rows), and :meth:`finish`
    after them. Nothing reads a size on the host, so a CUDA graph can capture a call and replay it
    with other counts. The workspace layout: the table (``[ws, ws, groups]`` int32), then
    ``send`` (``[layout.buffer_rows, W]``), which is also ``back`` ([Note: results where their
    rows were]); the exchange holds views of the workspace's buffer, so one made before the
    workspace grew raises ``RuntimeError`` (make another). ``streams``: the workspace's pull and
    push streams."""

    def __init__(self, workspace, rows: int, width: int, dtype: torch.dtype, groups: int = 1) -> None:
        w = self.w = workspace
        self.ws, self.rank, self.rows, self.groups = w.ws, w.rank, rows, groups
        elt = dtype.itemsize
        shape = (self.ws, self.ws, groups)
        send_off = aligned(self.ws * self.ws * groups * 4)
        self.layout = RegionLayout(self.ws, rows, groups, w.device)
        buffer = (self.layout.buffer_rows, width)
        self.nbytes = send_off + buffer[0] * width * elt
        w.reserve(self.nbytes)
        self.table = w.view(self.rank, shape, torch.int32, 0)
        self._table_rows = [w.view(q, shape, torch.int32, 0)[self.rank] for q in range(self.ws)]
        self._table_ptrs = remote_pointers(self._table_rows)
        self._sends = [w.view(q, buffer, dtype, send_off) for q in range(self.ws)]
        self.send = self.back = self._sends[self.rank]  # results land where their rows were
        self._send_ptrs = remote_pointers(self._sends)
        self._handle = w.handle
        self.streams = (w.pull_stream, w.push_stream)
        self._rests: Optional[torch.Tensor] = None  # RegionLayout.rests of this call's table, once made
        # the kernel copies run on the caller's stream between its GEMMs: every SM, several times
        self._programs = (_MAIN_PER_SM * torch.cuda.get_device_properties(w.device).multi_processor_count
                          if w.device.type == "cuda" else CTAS)

    def _signal(self, channel: int) -> None:
        peers = [(self.rank + j) % self.ws for j in range(1, self.ws)]
        for q in peers:
            self.w.handle.put_signal(q, channel)
        for q in peers:
            self.w.handle.wait_signal(q, channel)

    def parts(self, source: int) -> List[Part]:
        """The parts (ranges of groups) in which the peer ``source``'s rows come to this rank."""
        return self.layout.parts_at(self._j(source))

    def place(self, src: torch.Tensor, keys: torch.Tensor, top_k: int, counts: torch.Tensor,
              own: Optional[Tuple[int, torch.Tensor, Optional[torch.Tensor]]] = None) -> torch.Tensor:
        """This rank's send rows into ``send`` (:func:`~overlap_layers.kernels.send_rows.place_by_key`: the rows of
        ``src`` ``[T, W]`` for its ``T * top_k`` assignments with ``keys``, their send-order
        indices, dropped at ``ws * groups`` and above; ``counts`` the kept ones', ``[ws, groups]``
        int32 as :meth:`ready` takes). Returns each assignment's row of ``send`` (-1: dropped).
        ``own``: None, or its rows for itself elsewhere (:func:`own_diverts`)."""
        return place_by_key(src, keys, top_k, self.layout.key_places(counts, self.rank), self.send,
                            own_diverts(self.groups, own))

    def ready(self, counts: torch.Tensor) -> None:
        """Start a call: ``counts`` (``[ws, groups]`` int32 on the device, or ``[ws]`` with one
        group: rows for each destination's groups, in send order) into every rank's table, then
        the TABLE signals. This rank's send rows are in place in ``send`` (:meth:`place`)."""
        if self.w.handle is not self._handle:
            raise RuntimeError("DeviceCountAllToAll: the workspace was reallocated (it grew for another exchange) "
                               "since this exchange was made; make a new one")
        if counts.numel() != self.ws * self.groups or counts.dtype != torch.int32:
            raise ValueError(f"counts {tuple(counts.shape)} {counts.dtype}; valid: [{self.ws}, {self.groups}] "
                             "torch.int32 (rows for each destination rank and group)")
        self.w.reserve(self.nbytes)  # marks the buffer captured when a graph captures this call
        counts = counts.reshape(self.ws, self.groups)
        if runs_triton(counts):
            write_table_rows(counts, self._table_ptrs, self.ws)
        else:
            for row in self._table_rows:
                row.copy_(counts)
        self._signal(TABLE)
        self._rests = None

    @property
    def recv_counts(self) -> torch.Tensor:
        """``[ws, groups]`` int32 on the device: rows each source sends this rank for each group
        (valid from :meth:`ready` to :meth:`finish`)."""
        return self.table[:, self.rank]

    def _j(self, source: int) -> int:
        if not (0 <= source < self.ws and source != self.rank):
            raise ValueError(f"source={source}; valid: a peer rank of the group, 0 .. {self.ws - 1} but "
                             f"{self.rank} (the own rows stay in place)")
        return (self.rank - source) % self.ws

    def _checked(self, what: str, t: torch.Tensor) -> None:
        least = self.layout.largest_region
        if t.shape[0] < least or t.shape[1:] != self.send.shape[1:] or t.dtype != self.send.dtype:
            raise ValueError(f"{what} {tuple(t.shape)} {t.dtype}; valid: [>= {least}, {self.send.shape[1]}] "
                             f"{self.send.dtype} (the largest region, which a copy moves whole)")

    def _rest(self, source: int, part: Part) -> torch.Tensor:
        self._j(source)
        if self._rests is None:  # every source's overflow at once, at the call's first use
            self._rests = self.layout.rests(self.table)
        return self.layout.rest(self._rests, self.rank, source, part)

    def own_rows(self, first: int, out: torch.Tensor) -> torch.Tensor:
        """This rank's rows for its own groups ``first ..`` into ``out`` from row 0 (those past its
        rows are not copied), by the kernel (valid from :meth:`ready` to :meth:`finish`); returns
        ``out``."""
        self._checked("own_rows: out", out)
        copy_rows_by_table(self.layout.own_tail(self.table[self.rank], self.rank, first), self._sends, out,
                           push=False, pointers=self._send_ptrs, programs=self._programs)
        return out

    def pull(self, source: int, out: torch.Tensor, part: Part = None) -> torch.Tensor:
        """The region of the rows ``source`` sends this rank in ``part`` (one of
        :meth:`parts`) into the first rows of ``out`` (``[>= layout.largest_region, W]``), by the
        copy engine; with :meth:`pull_rest`, ``out`` holds those rows by group (:attr:`recv_counts`
        rows each, from row 0) as far as its rows go: ``[rows, W]`` holds them all, a smaller one
        those before its end ([Note: MoE slot rows] in ``layers/moe/device_path.py``). Returns ``out``."""
        self._checked("pull: out", out)
        start, cap = self.layout.region(self._j(source), part)
        out[:cap].copy_(self._sends[source][start:start + cap])
        return out

    def pull_rest(self, source: int, out: torch.Tensor, part: Part = None) -> torch.Tensor:
        """The rows of that part past its region into ``out``, by the kernel (none where the
        region held them all)."""
        self._checked("pull_rest: out", out)
        copy_rows_by_table(self._rest(source, part), self._sends, out, push=False, pointers=self._send_ptrs,
                           programs=self._programs)
        return out

    def push(self, source: int, results: torch.Tensor, part: Part = None) -> None:
        """The results for the rows of :meth:`pull` (laid out as they were pulled) into the
        region of ``source``'s ``back``, by the copy engine."""
        self._checked("push: results", results)
        start, cap = self.layout.region(self._j(source), part)
        self._sends[source][start:start + cap].copy_(results[:cap])

    def push_rest(self, source: int, results: torch.Tensor, part: Part = None) -> None:
        """The results for the rows of :meth:`pull_rest` into ``source``'s ``back``, by the kernel."""
        self._checked("push_rest: results", results)
        copy_rows_by_table(self._rest(source, part), self._sends, results, push=True, pointers=self._send_ptrs,
                           programs=self._programs)

    def finish(self) -> torch.Tensor:
        """End the call (the BACK signals, on the stream the pulls and pushes joined); returns
        ``back``: at the place of each of this rank's send rows to a peer, its result (valid
        until this rank's next :meth:`place` on this workspace; at its own rows' places, what
        :meth:`place` put there)."""
        self._signal(BACK)
        self._rests = None
        return self.back
