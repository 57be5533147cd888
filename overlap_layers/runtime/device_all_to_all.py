"""An all-to-all whose row counts never reach the host: the first brick of a MoE exchange that a
CUDA graph can replay. Not used by the layers yet ([Note: sync-free exchange]).

Reference, for rank r of ws ranks, with the count table ``table[s][d]`` (rows rank s sends to d,
on the device; row s comes from rank s) and r's send rows ``send [rows, W]`` laid out by
destination, rank 0 first::

    starts[s][d]  = sum(table[s][:d])              (where s's rows for d begin in s's send rows)
    dispatch      : recv = concat over s = 0 .. ws-1 of  send_s[starts[s][r] : + table[s][r]]
    recv_counts   = table[:, r]                    (rows from each source, in recv order)
    combine(res)  : back_r = for each d, in d's order, the rows res_d[recv_start_d[r] : + table[r][d]]
                    where recv_start_d[r] = sum(table[:r, d]) -- the results d computed for r's rows

so ``back`` holds, for each of r's send rows, the result its destination computed for it, in
send order (``combine(dispatch(send))`` with the identity is ``send[:sum(table[r])]``).

:func:`copy_rows_by_table` moves the rows: one Triton kernel that reads the table on the device,
so the counts decide how many rows it copies and where, with nothing on the host; it takes one
pointer per source (pull: the peers' send rows into this rank's ``recv``) or per destination
(push: this rank's results into the peers' ``back``). On CPU without Triton it is a torch loop
over host copies of the table (its reference, and how the CPU tests check the layout).
:class:`DeviceCountAllToAll` runs it over symmetric memory: each rank writes its row of the table
into every rank's table, signals, and pulls.

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
that takes 2-3x the device time per eager call. What is left for the MoE: route and gather into
``send`` (device only already), size ``recv`` by a bound (every rank's rows: ``ws * rows``), run
the grouped GEMMs with offsets from ``recv_counts`` (``torch._grouped_mm`` takes them on the
device), combine, and capture the call.

Signals, on the workspace's signal pad (channels of their own, beside [Note: exchange signals]):
per call and peer, channel TABLE "my row of your table and my send rows are in place" (put after
the table copies, waited before the pull) and channel BACK "my results for your rows are in your
``back``" (put after the push, waited before ``combine`` returns). Reuse without barriers: a rank
writes its send rows and table rows (next call) only after waiting every peer's BACK, which each
peer puts after its pull from it and after its push (the last reads of its own table); ``back``
is written by peers only after this rank's next TABLE, so it stays valid until the next dispatch.
Every exchange on one workspace runs on one stream, in the same order on every rank.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .exchange import _aligned
from .triton_gate import runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path
    triton = None

TABLE, BACK = 2, 3  # signal channels ([Note: sync-free exchange]; the exchange's own are 0 and 1)
_ROWS = 8  # rows a program copies at a time
_CTAS = 32  # programs: the probe's knee (173 GB/s, 11% off a GEMM beside it)
_BITS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}  # rows move as raw bits of the element size


def _starts(table: Sequence[Sequence[int]], rank: int):
    """``(n, send_start, recv_start)`` per source s: rows s sends to ``rank``, where they begin in
    s's send rows, where they begin in ``rank``'s recv rows."""
    ws = len(table)
    n = [table[s][rank] for s in range(ws)]
    send_start = [sum(table[s][:rank]) for s in range(ws)]
    recv_start = [sum(n[:s]) for s in range(ws)]
    return n, send_start, recv_start


def remote_pointers(remotes: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``[ws]`` int64 addresses of ``remotes`` on their device, for :func:`copy_rows_by_table`
    (made once, outside a capture: a host-to-device copy cannot be captured)."""
    return torch.tensor([t.data_ptr() for t in remotes], dtype=torch.int64).to(remotes[0].device)


def copy_rows_by_table(table: torch.Tensor, remotes: Sequence[torch.Tensor], local: torch.Tensor, rank: int,
                       push: bool, pointers: Optional[torch.Tensor] = None) -> None:
    """Copy rows as ``table`` ``[ws, ws]`` (int32, on ``local``'s device) says (module
    docstring). Pull (``push=False``): ``remotes[s]`` is source s's send rows and ``local`` this
    rank's recv rows; rows ``send_start[s] ..`` of ``remotes[s]`` go to rows ``recv_start[s] ..``
    of ``local``. Push: ``local`` holds this rank's results (recv order) and ``remotes[s]`` is
    rank s's back rows; rows ``recv_start[s] ..`` go to rows ``send_start[s] ..``. Every tensor is
    ``[*, W]``, contiguous, of one dtype, the remotes of one shape; a count past either side's rows
    copies only the rows that fit (a safety net: never a write out of bounds). ``pointers``: the
    remotes' :func:`remote_pointers` (made here if None)."""
    ws = table.shape[0]
    if len(remotes) != ws or any(t.shape != remotes[0].shape or t.dtype != local.dtype for t in remotes) \
            or remotes[0].shape[1:] != local.shape[1:]:
        raise ValueError(f"copy_rows_by_table: remotes {[tuple(t.shape) for t in remotes]} for a {ws}-rank table "
                         f"and local rows {tuple(local.shape)} {local.dtype}; valid: {ws} remotes of one shape, "
                         "rows as wide as the local ones, one dtype")
    if runs_triton(local):
        if pointers is None:
            pointers = remote_pointers(remotes)
        W = local.shape[1]
        ctas = _CTAS if local.is_cuda else 3  # under the interpreter: a few, each taking several row blocks
        _rows_kernel[(ctas,)](table, pointers, local, remotes[0].shape[0], local.shape[0], rank, W, WS=ws,
                              WS_P2=triton.next_power_of_2(ws), PUSH=push, BITS=getattr(tl, _BITS[local.element_size()]),
                              ROWS=_ROWS, BLOCK_W=min(1024, triton.next_power_of_2(W)), num_warps=8)
        return
    n, send_start, recv_start = _starts(table.tolist(), rank)
    for s in range(ws):
        a, b = (recv_start[s], send_start[s]) if push else (send_start[s], recv_start[s])
        src, dst = (local, remotes[s]) if push else (remotes[s], local)
        k = max(0, min(n[s], src.shape[0] - a, dst.shape[0] - b))
        dst[b:b + k].copy_(src[a:a + k])


if triton is not None:
    @triton.jit
    def _pick(vec, idx, i):
        """``vec[i]`` as a scalar (``idx``: ``arange`` over ``vec``)."""
        return tl.sum(tl.where(idx == i, vec, 0), 0)

    @triton.jit
    def _rows_kernel(table_ptr, remote_ptrs, local_ptr, remote_rows, local_rows, rank, W: tl.constexpr, WS: tl.constexpr,
                     WS_P2: tl.constexpr, PUSH: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_W: tl.constexpr):
        i = tl.arange(0, WS_P2)
        live = i < WS
        tab = tl.load(table_ptr + i[:, None] * WS + i[None, :], mask=live[:, None] & live[None, :], other=0)
        n_all = tl.sum(tl.where(i[None, :] == rank, tab, 0), 1)  # [s]: rows s sends to rank
        send_all = tl.sum(tl.where(i[None, :] < rank, tab, 0), 1)  # [s]: where they begin in s's send rows
        recv_all = tl.cumsum(n_all, 0) - n_all  # [s]: where they begin in rank's recv rows
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        r_off = tl.arange(0, ROWS)
        c_off = tl.arange(0, BLOCK_W)
        local = local_ptr.to(tl.pointer_type(BITS), bitcast=True)
        for p in tl.static_range(WS):
            s = (rank + p) % WS  # rank r starts at itself, then r+1, ...: the ranks' reads spread over the peers
            n = _pick(n_all, i, s)
            remote = tl.load(remote_ptrs + s).to(tl.pointer_type(BITS))
            if PUSH:  # a: rows read, b: rows written
                a, b = _pick(recv_all, i, s), _pick(send_all, i, s)
                n = tl.maximum(tl.minimum(n, tl.minimum(local_rows - a, remote_rows - b)), 0)
                src, dst = local, remote
            else:
                a, b = _pick(send_all, i, s), _pick(recv_all, i, s)
                n = tl.maximum(tl.minimum(n, tl.minimum(remote_rows - a, local_rows - b)), 0)
                src, dst = remote, local
            r0 = pid * ROWS
            while r0 < n:  # a loop bound from the device (a while: Triton's interpreter takes it too)
                r = r0 + r_off
                for c0 in tl.static_range(0, W, BLOCK_W):
                    c = c0 + c_off
                    m = (r < n)[:, None] & (c < W)[None, :]
                    v = tl.load(src + (a + r).to(tl.int64)[:, None] * W + c[None, :], mask=m)
                    tl.store(dst + (b + r).to(tl.int64)[:, None] * W + c[None, :], v, mask=m)
                r0 += nprog * ROWS


class DeviceCountAllToAll:
    """The exchange over a group's symmetric workspace (module docstring): ``send`` (this rank's
    send rows, ``[rows, W]``, which the caller fills), :meth:`dispatch` with this rank's counts
    per destination, :meth:`combine` with the results, in that order, once each per call. Nothing
    reads a size on the host, so a CUDA graph can capture a call and replay it with other counts.
    The workspace layout: the table (``[ws, ws]`` int32), then ``send``, then ``back``; the
    exchange holds views of the workspace's buffer, so one made before the workspace grew raises
    ``RuntimeError`` (make another)."""

    def __init__(self, workspace, rows: int, width: int, dtype: torch.dtype) -> None:
        w = self.w = workspace
        self.ws, self.rank, self.rows = w.ws, w.rank, rows
        elt = dtype.itemsize
        table_bytes = _aligned(self.ws * self.ws * 4)
        send_off = table_bytes
        back_off = send_off + _aligned(rows * width * elt)
        w.reserve(back_off + rows * width * elt)
        self.table = w.view(self.rank, (self.ws, self.ws), torch.int32, 0)
        self._table_rows = [w.view(q, (self.ws, self.ws), torch.int32, 0)[self.rank] for q in range(self.ws)]
        self._sends = [w.view(q, (rows, width), dtype, send_off) for q in range(self.ws)]
        self._backs = [w.view(q, (rows, width), dtype, back_off) for q in range(self.ws)]
        self.send, self.back = self._sends[self.rank], self._backs[self.rank]
        self._send_ptrs, self._back_ptrs = remote_pointers(self._sends), remote_pointers(self._backs)
        self._handle = w.handle
        self._recv = None

    def _signal(self, channel: int) -> None:
        peers = [(self.rank + j) % self.ws for j in range(1, self.ws)]
        for q in peers:
            self.w.handle.put_signal(q, channel)
        for q in peers:
            self.w.handle.wait_signal(q, channel)

    def dispatch(self, counts: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
        """Rows ``send[...]`` to their destinations by ``counts`` (``[ws]`` int32 on the device:
        rows for each destination, in ``send`` by destination, rank 0 first); returns ``recv``
        (``[>= ws * rows, W]`` to hold any counts) filled by source, rank 0 first, with
        :attr:`recv_counts` rows from each."""
        if self.w.handle is not self._handle:
            raise RuntimeError("DeviceCountAllToAll: the workspace was reallocated (it grew for another exchange) "
                               "since this exchange was made; make a new one")
        if recv.shape[0] < self.ws * self.rows or recv.shape[1:] != self.send.shape[1:] or recv.dtype != self.send.dtype:
            raise ValueError(f"recv {tuple(recv.shape)} {recv.dtype}; valid: [>= {self.ws * self.rows}, "
                             f"{self.send.shape[1]}] {self.send.dtype} (every rank's rows could come here)")
        for row in self._table_rows:
            row.copy_(counts)
        self._signal(TABLE)
        copy_rows_by_table(self.table, self._sends, recv, self.rank, push=False, pointers=self._send_ptrs)
        self._recv = recv
        return recv

    @property
    def recv_counts(self) -> torch.Tensor:
        """``[ws]`` int32 on the device: rows :meth:`dispatch` received from each source."""
        return self.table[:, self.rank]

    def combine(self, results: torch.Tensor) -> torch.Tensor:
        """Each source's rows of ``results`` (laid out as ``recv``) back to it; returns ``back``:
        the results for this rank's send rows, in send order (valid until the next dispatch on
        this workspace)."""
        if self._recv is None or results.shape != self._recv.shape or results.dtype != self.send.dtype:
            raise ValueError(f"combine: results {tuple(results.shape)} {results.dtype}; valid: after dispatch, "
                             f"shaped as its recv {None if self._recv is None else tuple(self._recv.shape)} "
                             f"{self.send.dtype}")
        copy_rows_by_table(self.table, self._backs, results, self.rank, push=True, pointers=self._back_ptrs)
        self._signal(BACK)
        self._recv = None
        return self.back
