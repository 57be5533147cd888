"""An all-to-all whose row counts never reach the host, so that a CUDA graph can replay it with
new counts at each replay: the MoE's exchange in graph-replayed calls ([Note: sync-free
exchange], ``layers/moe_device.py``), split by source rank.

Reference, for rank r of ws ranks, with G groups per rank (the MoE's local experts) and the count
table ``table[s][d][g]`` (rows rank s sends to rank d's group g, on the device; row s comes from
rank s), r's send rows ``send [rows, W]`` laid out by destination, then group, destinations in the
order r, r + 1, ... (its own rows first, at row 0, where its own work reads them in place)::

    send_start[s][d][g] = rows of table[s] before (d, g), destinations in the order s, s + 1, ...
    pull(s)       : the rows s sends to r, by group:  for g: send_s[send_start[s][r][g] : + table[s][r][g]]
    push(s, res)  : back_s[send_start[s][r][g] : + table[s][r][g]] = the rows of res that pull(s)
                    put there for group g, for every g
    recv_counts   = table[:, r]                    ([source][group])

so once every rank has pushed its results for every source, ``back`` holds, for each of r's send
rows, the result its destination computed for it, in send order (pushing what was pulled gives
``send[:table[r].sum()]``).

:func:`segments` turns the table into one segment per group of the rows one source sends to this
rank (source rank, start in the source's send rows, start in the pulled rows, rows), in torch ops
on the device; :func:`copy_rows_by_table` moves them with one Triton kernel that reads the
segments on the device, so the counts decide how many rows it copies and where, with nothing on
the host. It takes one pointer per source (pull: the peers' send rows into this rank's rows) or
per destination (push: this rank's results into the peers' ``back``). On CPU without Triton it is
a torch loop over host copies of the segments (its reference, and how the CPU tests check the
layout). :class:`DeviceCountAllToAll` runs it over symmetric memory: each rank writes its row of
the table into every rank's table and signals (:meth:`~DeviceCountAllToAll.ready`), then pulls
and pushes source by source, and signals again (:meth:`~DeviceCountAllToAll.finish`).

[Note: sync-free exchange]
The MoE's exchanges read their split sizes on the host ([Note: MoE host syncs] in
``layers/moe.py``), so its calls stay eager, and on the 4x H200 machine its qwen3 shape is
host-bound at 2.3x the limit (an eager call launches ~100 ops at 20-50 us of host each). Graph
replay needs every size on the device: the copy engine takes its sizes from the host, an SM kernel
does not. Measured before building this (``bench/peer_pull_probe.py``, 4x H200, 4096 rows of 2048
bf16 from each of 3 peers, 48 MiB per rank, session 30): copy-engine pulls 187 us (270 GB/s), a
Triton pull with 32 CTAs 290 us (173 GB/s), 64 CTAs 247 us, 132 CTAs 236 us; five GEMMs of 1797 us
ran 1926 us beside the copy engine's pulls and 1994 us beside the 32-CTA kernel's. So the kernel
costs about half as much again as the copy engine in link time and GEMM slowdown, against a host
that takes 2-3x the device time per eager call. The exchange is split by source so that the MoE
can run each source's rows as they arrive and push their results while the next source's run
(``layers/moe_device.py``, [Note: MoE graph calls]): a whole exchange before the experts and
another after them ran the qwen3 forward in 4.23 ms against 3.74 eager (4x H200, session 31).

Signals, on the workspace's signal pad: per call and peer, channel TABLE "my row of your table
and my send rows are in place" (put by ``ready`` after the table copies, waited before any pull)
and channel BACK "I have pulled from you and pushed my results for your rows into your ``back``"
(put by ``finish``, after every pull and push, waited before it returns). Reuse without barriers:
a rank writes its send rows and table rows (next call) only after waiting every peer's BACK, put
after the peer's last reads of them (its pulls) and of its own table (its segments); ``back`` is
written by peers only after this rank's next TABLE, so it stays valid until the next ``ready``.
Every exchange on one workspace runs in the same order on every rank, its signals in one stream
order (a call's ``ready`` may run on a side stream that waited for the previous ``finish``).
The exchange has a workspace of its own (``runtime/exchange.py``): peers write its table with no
signal of this rank's call, which another exchange's data in the same buffer would race.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .exchange import _aligned
from .triton_gate import runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path
    triton = None

TABLE, BACK = 0, 1  # signal channels ([Note: sync-free exchange])
_ROWS = 8  # rows a program copies at a time
# programs: in the MoE's replayed qwen3 forward (4x H200, session 32) 64 ran it in 2.757 ms against
# 2.833 with 32 (the probe's knee: 173 GB/s, 11% off a GEMM beside it): there the pulls set the
# pace, and 64 pull at 204 GB/s for 1.6% more GEMM time (session 30's probe)
_CTAS = 64
_BITS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}  # rows move as raw bits of the element size


def segments(table: torch.Tensor, rank: int, source: int, groups: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """``[4, G]`` int64 on the table's device, one column per group g of the rows ``source``
    sends to ``rank`` (module docstring): the source, where the rows begin in its send rows, where
    they begin in the pulled rows (by group), how many. ``groups = (first, end)``: the columns of
    those groups only, the pulled rows beginning at row 0 (a source's groups pulled in parts).
    Device ops only (a graph captures them); ``table`` is ``[ws, ws, G]`` (or ``[ws, ws]``: G = 1)."""
    ws = table.shape[0]
    t = table.reshape(ws, ws, -1)[source].to(torch.int64)  # [d, g]: what source sends
    G = t.shape[1]
    a, b = (0, G) if groups is None else groups
    if not 0 <= a < b <= G:
        raise ValueError(f"groups={groups!r}; valid: None or (first, end) with 0 <= first < end <= {G}")
    flat = torch.roll(t, -source, 0).reshape(-1)  # in source's send order: destinations source, source + 1, ...
    send_start = torch.roll((torch.cumsum(flat, 0) - flat).view(ws, G), source, 0)[rank, a:b]
    n = t[rank, a:b]
    return torch.stack([torch.full_like(n, source), send_start, torch.cumsum(n, 0) - n, n])


def remote_pointers(remotes: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``[ws]`` int64 addresses of ``remotes`` on their device, for :func:`copy_rows_by_table`
    (made once, outside a capture: a host-to-device copy cannot be captured)."""
    return torch.tensor([t.data_ptr() for t in remotes], dtype=torch.int64).to(remotes[0].device)


def copy_rows_by_table(segs: torch.Tensor, remotes: Sequence[torch.Tensor], local: torch.Tensor, push: bool,
                       pointers: Optional[torch.Tensor] = None) -> None:
    """Copy the rows of the :func:`segments` ``segs`` (``[4, n]`` int64 on ``local``'s device).
    Pull (``push=False``): ``remotes[s]`` is rank s's send rows and ``local`` this rank's pulled
    rows; each column's rows of ``remotes[source]`` go to its rows of ``local``. Push: ``local``
    holds this rank's results (laid out as pulled) and ``remotes[s]`` is rank s's back rows; the
    same rows go the other way. Every tensor is ``[*, W]``, contiguous, of one dtype, the remotes
    of one shape; a row past either side's rows is not copied (a safety net for counts past the
    buffers: never a write out of bounds). ``pointers``: the remotes' :func:`remote_pointers`
    (made here if None)."""
    if segs.dim() != 2 or segs.shape[0] != 4 or any(t.shape != remotes[0].shape or t.dtype != local.dtype
                                                    for t in remotes) or remotes[0].shape[1:] != local.shape[1:]:
        raise ValueError(f"copy_rows_by_table: segments {tuple(segs.shape)}, remotes "
                         f"{[tuple(t.shape) for t in remotes]} and local rows {tuple(local.shape)} {local.dtype}; "
                         "valid: segments [4, n], remotes of one shape, rows as wide as the local ones, one dtype")
    if runs_triton(local):
        if pointers is None:
            pointers = remote_pointers(remotes)
        W, nseg = local.shape[1], segs.shape[1]
        ctas = _CTAS if local.is_cuda else 3  # under the interpreter: a few, each taking several row blocks
        _segments_kernel[(ctas,)](segs, pointers, local, remotes[0].shape[0], local.shape[0], W, NSEG=nseg,
                                  NSEG_P2=triton.next_power_of_2(nseg), PUSH=push,
                                  BITS=getattr(tl, _BITS[local.element_size()]), ROWS=_ROWS,
                                  BLOCK_W=min(1024, triton.next_power_of_2(W)), num_warps=8)
        return
    for s, remote_start, local_start, n in segs.t().tolist():
        a, b = (local_start, remote_start) if push else (remote_start, local_start)
        src, dst = (local, remotes[s]) if push else (remotes[s], local)
        k = max(0, min(n, src.shape[0] - a, dst.shape[0] - b))
        dst[b:b + k].copy_(src[a:a + k])


if triton is not None:
    @triton.jit
    def _segments_kernel(seg_ptr, remote_ptrs, local_ptr, remote_rows, local_rows, W: tl.constexpr, NSEG: tl.constexpr,
                         NSEG_P2: tl.constexpr, PUSH: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_W: tl.constexpr):
        """Rows of the segments laid end to end, ``ROWS`` at a time per program: each row finds
        its segment (the columns of ``seg_ptr``, :func:`segments`) and so its source pointer and
        offsets, so small segments do not leave programs idle."""
        q = tl.arange(0, NSEG_P2)
        n = tl.load(seg_ptr + 3 * NSEG + q, mask=q < NSEG, other=0)
        ends = tl.cumsum(n, 0)
        total = tl.sum(n, 0)
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        r_off = tl.arange(0, ROWS)
        c_off = tl.arange(0, BLOCK_W)
        local = local_ptr.to(tl.pointer_type(BITS), bitcast=True)
        r0 = pid * ROWS
        while r0 < total:  # a loop bound from the device (a while: Triton's interpreter takes it too)
            r = r0 + r_off
            live = r < total
            seg = tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), 1)  # [ROWS]: the segment of each row
            seg = tl.where(live, seg, 0)
            before = tl.sum(tl.where(q[None, :] < seg[:, None], n[None, :], 0), 1)  # rows of earlier segments
            i = r - before
            src_rank = tl.load(seg_ptr + seg, mask=live, other=0)
            rem = tl.load(seg_ptr + NSEG + seg, mask=live, other=0) + i
            loc = tl.load(seg_ptr + 2 * NSEG + seg, mask=live, other=0) + i
            ok = live & (rem < remote_rows) & (loc < local_rows)
            remote = tl.load(remote_ptrs + src_rank, mask=ok, other=0).to(tl.pointer_type(BITS))
            if PUSH:
                src, dst = local + loc * W, remote + rem * W
            else:
                src, dst = remote + rem * W, local + loc * W
            for c0 in tl.static_range(0, W, BLOCK_W):
                c = c0 + c_off
                m = ok[:, None] & (c < W)[None, :]
                v = tl.load(src[:, None] + c[None, :], mask=m)
                tl.store(dst[:, None] + c[None, :], v, mask=m)
            r0 += nprog * ROWS

    @triton.jit
    def _table_rows_kernel(counts_ptr, row_ptrs, N: tl.constexpr, BLOCK: tl.constexpr):
        """This rank's counts into rank ``program_id``'s table (a store to a peer's memory: one
        launch for every rank, where a peer-to-peer copy per rank took 60-110 us each in a replay,
        4x H200, session 32)."""
        dst = tl.load(row_ptrs + tl.program_id(0)).to(tl.pointer_type(tl.int32))
        i = tl.arange(0, BLOCK)
        m = i < N
        tl.store(dst + i, tl.load(counts_ptr + i, mask=m), mask=m)


class DeviceCountAllToAll:
    """The exchange over a group's symmetric workspace (module docstring): ``send`` (this rank's
    send rows, ``[rows, W]``, which the caller fills), then per call :meth:`ready` with this
    rank's counts per destination and group, :meth:`pull` and :meth:`push` once per source (or
    once per source and range of groups, the ranges covering its groups; any order, on any
    streams that follow ``ready``), :meth:`finish` after them. Nothing reads a size on the host,
    so a CUDA graph can capture a call and replay it with other counts. The
    workspace layout: the table (``[ws, ws, groups]`` int32), then ``send``, then ``back``; the
    exchange holds views of the workspace's buffer, so one made before the workspace grew raises
    ``RuntimeError`` (make another). ``streams``: the workspace's pull and push streams."""

    def __init__(self, workspace, rows: int, width: int, dtype: torch.dtype, groups: int = 1) -> None:
        w = self.w = workspace
        self.ws, self.rank, self.rows, self.groups = w.ws, w.rank, rows, groups
        elt = dtype.itemsize
        shape = (self.ws, self.ws, groups)
        send_off = _aligned(self.ws * self.ws * groups * 4)
        back_off = send_off + _aligned(rows * width * elt)
        self.nbytes = back_off + rows * width * elt
        w.reserve(self.nbytes)
        self.table = w.view(self.rank, shape, torch.int32, 0)
        self._table_rows = [w.view(q, shape, torch.int32, 0)[self.rank] for q in range(self.ws)]
        self._table_ptrs = remote_pointers(self._table_rows)
        self._sends = [w.view(q, (rows, width), dtype, send_off) for q in range(self.ws)]
        self._backs = [w.view(q, (rows, width), dtype, back_off) for q in range(self.ws)]
        self.send, self.back = self._sends[self.rank], self._backs[self.rank]
        self._send_ptrs, self._back_ptrs = remote_pointers(self._sends), remote_pointers(self._backs)
        self._handle = w.handle
        self.streams = (w.pull_stream, w.push_stream)
        self._segs: dict = {}  # source -> its segments, this call

    def _signal(self, channel: int) -> None:
        peers = [(self.rank + j) % self.ws for j in range(1, self.ws)]
        for q in peers:
            self.w.handle.put_signal(q, channel)
        for q in peers:
            self.w.handle.wait_signal(q, channel)

    def ready(self, counts: torch.Tensor) -> None:
        """Start a call: ``counts`` (``[ws, groups]`` int32 on the device, or ``[ws]`` with one
        group: rows of ``send`` for each destination's groups, in ``send`` by destination then
        group, rank 0 first) into every rank's table, then the TABLE signals."""
        if self.w.handle is not self._handle:
            raise RuntimeError("DeviceCountAllToAll: the workspace was reallocated (it grew for another exchange) "
                               "since this exchange was made; make a new one")
        if counts.numel() != self.ws * self.groups or counts.dtype != torch.int32:
            raise ValueError(f"counts {tuple(counts.shape)} {counts.dtype}; valid: [{self.ws}, {self.groups}] "
                             "torch.int32 (rows for each destination rank and group)")
        self.w.reserve(self.nbytes)  # marks the buffer captured when a graph captures this call
        counts = counts.reshape(self.ws, self.groups)
        if runs_triton(counts):
            n = counts.numel()
            _table_rows_kernel[(self.ws,)](counts.contiguous(), self._table_ptrs, N=n,
                                           BLOCK=triton.next_power_of_2(n), num_warps=1)
        else:
            for row in self._table_rows:
                row.copy_(counts)
        self._signal(TABLE)
        self._segs = {}

    @property
    def recv_counts(self) -> torch.Tensor:
        """``[ws, groups]`` int32 on the device: rows each source sends this rank for each group
        (valid from :meth:`ready` to :meth:`finish`)."""
        return self.table[:, self.rank]

    def _segments(self, source: int, groups: Optional[Tuple[int, int]]) -> torch.Tensor:
        if not 0 <= source < self.ws:
            raise ValueError(f"source={source}; valid: a rank of the group, 0 .. {self.ws - 1}")
        segs = self._segs.get((source, groups))
        if segs is None:
            segs = self._segs[(source, groups)] = segments(self.table, self.rank, source, groups)
        return segs

    def pull(self, source: int, out: torch.Tensor, groups: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """The rows ``source`` sends this rank into ``out`` (``[>= rows, W]``: any counts fit), by
        group (:attr:`recv_counts` ``[source]`` rows each); returns ``out``. ``groups``: only the
        groups ``first .. end - 1``, from row 0 of ``out`` on."""
        if out.shape[0] < self.rows or out.shape[1:] != self.send.shape[1:] or out.dtype != self.send.dtype:
            raise ValueError(f"pull: out {tuple(out.shape)} {out.dtype}; valid: [>= {self.rows}, "
                             f"{self.send.shape[1]}] {self.send.dtype} (a source's rows could all come here)")
        copy_rows_by_table(self._segments(source, groups), self._sends, out, push=False, pointers=self._send_ptrs)
        return out

    def push(self, source: int, results: torch.Tensor, groups: Optional[Tuple[int, int]] = None) -> None:
        """The results for the rows pulled from ``source`` (``results`` laid out as :meth:`pull`
        put them, with the same ``groups``) into its ``back``."""
        if results.shape[0] < self.rows or results.shape[1:] != self.send.shape[1:] or results.dtype != self.send.dtype:
            raise ValueError(f"push: results {tuple(results.shape)} {results.dtype}; valid: laid out as pull's out, "
                             f"[>= {self.rows}, {self.send.shape[1]}] {self.send.dtype}")
        copy_rows_by_table(self._segments(source, groups), self._backs, results, push=True, pointers=self._back_ptrs)

    def finish(self) -> torch.Tensor:
        """End the call (the BACK signals, on the stream the pulls and pushes joined); returns
        ``back``: the results for this rank's send rows, in send order (valid until the next
        :meth:`ready` on this workspace)."""
        self._signal(BACK)
        self._segs = {}
        return self.back
