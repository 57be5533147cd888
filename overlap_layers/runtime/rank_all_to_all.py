"""Rank-chunk all-to-all: rows dispatched to their destination ranks, taken one source rank at a
time, and each destination's results returned in place, so that compute on one source's rows hides
the transfer of the next (the MoE's expert exchange, ``layers/moe/ranks.py``).

Reference, for rank r of a group of ws ranks, with the count table ``counts[s][d]`` (rows rank s
sends to rank d; the same table on every rank) and r's send rows ``send [sum_d counts[r][d], W]``
laid out by destination in step order: r's own rows first, then those for r+1, r+2, ... (mod ws),
so the own rows start at row 0 whatever the counts::

    step j = 1 .. ws-1 talks to q = (r + j) % ws
    own()            == send's rows for r itself
    pull(j)          == the rows q sent to r (counts[q][r] rows, in q's order)
    push(j, rows)    gives q the results for the rows r pulled from q (same count, same order)
    finish()         == [rows of send, W]: for each d != r, the results d gave for r's rows to d
                        (the own rows' range: unspecified; the caller keeps its own results)

An exchange is made for ``rows`` send rows (any bound on r's count: the caller may fill ``send``
before the table is known, the rows it does not send last). The caller fills ``send``, may call
``ready()`` (the signals, which need no sizes: the MoE issues them before its host waits for the
counts), calls ``start(counts)``, then pulls and pushes each step once, in step order. Where
``early_ok``, work the caller launches between ``ready()`` and ``start()`` (the MoE's first own
piece, on rows ``send[:m]`` it chose before knowing the counts) does not delay the transfers.
Every rank issues its transfers in the same order, so matching is by construction (every rank
knows the whole table). Two transports implement it:

* :class:`CopyEngineAllToAll` (CUDA, symmetric memory): ``send`` is this rank's symmetric buffer
  (the caller gathers its rows straight into it); peers pull their rows with device-to-device
  copies and push the results back over them, in place ("Memcpy PtoP": the copy engines, no SMs).
  ``send`` is the workspace's, which the next exchange on it overwrites (``shared_send``: rows
  kept past the call must be copied out). ``finish()`` returns a view of the symmetric buffer,
  valid until the next exchange on this workspace (read it on the current stream before then).
* :class:`PointToPointAllToAll` (any backend with ``isend``/``irecv``: NCCL, gloo): one
  ``batch_isend_irecv`` per step and direction; how the schedule is tested on CPU.

Signals follow [Note: exchange signals] (``exchange.py``) on the shared workspace, with the send
rows in place of the sources and the returned results in place of the partial slots: per call and
peer, channel 0 "my send rows are in my buffer" (waited before the first pull) and channel 1 "my
results for your rows are in your buffer" (put after the push, waited by ``finish``). A rank
overwrites its buffer (next exchange) only after ``finish`` waited every peer's channel 1, which
each peer puts after its pull from it; a peer pushes only after the owner's channel 0 of the same
exchange.
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import Transport
from .exchange import PULL, PUSH, peers
from .symmetric import SymmetricWorkspace


def _starts(counts: Sequence[int]) -> List[int]:
    """Exclusive prefix sums: where each group of ``counts`` starts."""
    return list(itertools.accumulate(counts, initial=0))[:-1]


def _step_starts(row: Sequence[int], s: int) -> List[int]:
    """Where rank s's rows for each destination start in its send buffer (``row[d]`` rows for d,
    laid out in step order: s, s+1, ... mod ws)."""
    ws = len(row)
    rotated = _starts([row[(s + j) % ws] for j in range(ws)])
    return [rotated[(d - s) % ws] for d in range(ws)]


class _Layout:
    """Row ranges of one exchange from the count table (host lists)."""

    def __init__(self, counts: Sequence[Sequence[int]], rank: int):
        self.ws, self.rank = len(counts), rank
        self.counts = [[int(c) for c in row] for row in counts]
        assert all(len(row) == self.ws for row in self.counts) and all(c >= 0 for row in self.counts for c in row)
        self.send_rows = sum(self.counts[rank])
        self.send_start = [_step_starts(row, s) for s, row in enumerate(self.counts)]  # [s][d], in s's buffer
        self.recv_counts = [self.counts[s][rank] for s in range(self.ws)]  # rows from each source

    def send_range(self, d: int):
        a = self.send_start[self.rank][d]
        return a, a + self.counts[self.rank][d]


class PointToPointAllToAll:
    """The exchange over ``isend``/``irecv`` (see the module docstring); ``capacity_rows`` is
    the copy engine's (unused here)."""

    transport = Transport.NCCL
    shared_send = False  # send is this exchange's own tensor

    def __init__(self, group, rows: int, width: int, dtype: torch.dtype, device, capacity_rows: int = 0):
        self.group, self.ws, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        # NCCL's stream waits for the caller's at each call; on the CPU every op runs as issued
        self.early_ok = torch.device(device).type != "cuda"
        self._g = [dist.get_global_rank(group, i) for i in range(self.ws)]
        self.send = torch.empty((rows, width), dtype=dtype, device=device)
        self.layout: Optional[_Layout] = None
        self._recv = {}
        self._pull_works, self._push_works, self._keep = {}, [], []
        self._pushed = 0

    def ready(self) -> None:
        """Nothing: :meth:`start`'s receives match the sends."""

    def start(self, counts: Sequence[Sequence[int]]) -> None:
        lay = self.layout = _Layout(counts, self.rank)
        assert lay.send_rows <= self.send.shape[0], "the exchange was made for fewer rows than this rank sends"
        self._back = self.send.new_empty((lay.send_rows, self.send.shape[1]))
        for j, q, s in peers(self.rank, self.ws):
            ops = []
            a, b = lay.send_range(s)
            if b > a:
                ops.append(dist.P2POp(dist.isend, self.send[a:b], self._g[s], self.group))
            n = lay.recv_counts[q]
            self._recv[j] = self.send.new_empty((n, self.send.shape[1]))
            if n:
                ops.append(dist.P2POp(dist.irecv, self._recv[j], self._g[q], self.group))
            self._pull_works[j] = dist.batch_isend_irecv(ops) if ops else []

    def own(self) -> torch.Tensor:
        a, b = self.layout.send_range(self.rank)
        return self.send[a:b]

    def pull(self, j: int) -> torch.Tensor:
        for w in self._pull_works.pop(j):
            w.wait()
        return self._recv.pop(j)

    def push(self, j: int, rows: torch.Tensor) -> None:
        q, s = (self.rank + j) % self.ws, (self.rank - j) % self.ws
        rows = rows.contiguous()
        assert rows.shape[0] == self.layout.recv_counts[q], "push the results of the rows pulled at this step"
        assert j == self._pushed + 1, "pushes go in step order (the sends and receives of a step match)"
        self._pushed = j
        self._keep.append(rows)
        ops = []
        if rows.shape[0]:
            ops.append(dist.P2POp(dist.isend, rows, self._g[q], self.group))
        a, b = self.layout.send_range(s)
        if b > a:
            ops.append(dist.P2POp(dist.irecv, self._back[a:b], self._g[s], self.group))
        if ops:
            self._push_works += dist.batch_isend_irecv(ops)

    def finish(self) -> torch.Tensor:
        assert not self._pull_works, "every step must pull once"
        for w in self._push_works:
            w.wait()
        self._keep.clear()
        return self._back


class CopyEngineAllToAll:
    """The exchange over symmetric memory and the copy engines (see the module docstring).
    ``capacity_rows`` (the same on every rank) sizes the workspace: at least every rank's send
    rows, so that growing it, a collective, happens alike on every rank."""

    transport = Transport.COPY_ENGINE
    shared_send = True  # send is the workspace's (the next exchange on it overwrites it)
    early_ok = True  # the pulls wait for ready() only (their rows are allocated on the pull stream)

    def __init__(self, workspace: SymmetricWorkspace, rows: int, width: int, dtype: torch.dtype, device=None,
                 capacity_rows: int = 0):
        w = self.w = workspace
        self.ws, self.rank = w.ws, w.rank
        assert capacity_rows >= rows, f"capacity_rows={capacity_rows} < rows={rows}"
        w.reserve(capacity_rows * width * dtype.itemsize)
        self.width, self.dtype = width, dtype
        self._full = w.view(self.rank, (capacity_rows, width), dtype, 0)
        self.send = self._full[:rows]
        self.layout: Optional[_Layout] = None
        self._pulled = {}  # step -> (rows, the event after their copy)
        self._left = self.ws - 1
        self._ready = False

    def _peer_rows(self, q: int, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` of rank q's buffer (the workspace caches one view per peer)."""
        return self.w.view(q, (self._full.shape[0], self.width), self.dtype, 0)[a:b]

    def ready(self) -> None:
        """Tell every peer that the send rows are in the buffer (written on the current stream by
        now) and wait for theirs, on the pull stream; :meth:`start` does it if the caller did not."""
        w, self._ready = self.w, True
        w.pull_stream.wait_stream(torch.cuda.current_stream(w.device))
        with torch.cuda.stream(w.pull_stream):
            for _, _, s in peers(self.rank, self.ws):
                w.handle.put_signal(s, PULL)
            for _, q, _ in peers(self.rank, self.ws):  # every peer first: the pulls of a step form a permutation
                w.handle.wait_signal(q, PULL)

    def start(self, counts: Sequence[Sequence[int]]) -> None:
        w, lay = self.w, _Layout(counts, self.rank)
        assert max(sum(row) for row in lay.counts) <= self._full.shape[0], "a rank sends more than capacity_rows"
        self.layout = lay
        if not self._ready:
            self.ready()
        starts = _starts(lay.recv_counts)
        caller = torch.cuda.current_stream(w.device)
        with torch.cuda.stream(w.pull_stream):
            # allocated on the pull stream, so the pulls need not wait for the caller's stream;
            # read on the caller's (pull()), so freed only after that
            recv = torch.empty((sum(lay.recv_counts), self.width), dtype=self.dtype, device=w.device)
            recv.record_stream(caller)
            for j, q, _ in peers(self.rank, self.ws):
                a = lay.send_start[q][self.rank]
                n = lay.recv_counts[q]
                dst = recv[starts[q]:starts[q] + n]
                if n:
                    dst.copy_(self._peer_rows(q, a, a + n))
                ev = torch.cuda.Event()
                ev.record(w.pull_stream)
                self._pulled[j] = dst, ev

    def own(self) -> torch.Tensor:
        a, b = self.layout.send_range(self.rank)
        return self.send[a:b]

    def pull(self, j: int) -> torch.Tensor:
        rows, ev = self._pulled.pop(j)
        torch.cuda.current_stream(self.w.device).wait_event(ev)
        return rows

    def push(self, j: int, rows: torch.Tensor) -> None:
        w, lay = self.w, self.layout
        q = (self.rank + j) % self.ws
        assert rows.shape[0] == lay.recv_counts[q], "push the results of the rows pulled at this step"
        assert j == self.ws - self._left, "pushes go in step order"
        w.push_stream.wait_stream(torch.cuda.current_stream(w.device))
        rows.record_stream(w.push_stream)
        with torch.cuda.stream(w.push_stream):
            a = lay.send_start[q][self.rank]
            if rows.shape[0]:
                self._peer_rows(q, a, a + rows.shape[0]).copy_(rows)
            w.handle.put_signal(q, PUSH)
        self._left -= 1

    def finish(self) -> torch.Tensor:
        assert not self._left and not self._pulled, "every step must pull and push once"
        compute = torch.cuda.current_stream(self.w.device)
        compute.wait_stream(self.w.push_stream)
        for _, _, s in peers(self.rank, self.ws):
            self.w.handle.wait_signal(s, PUSH)
        return self.send
