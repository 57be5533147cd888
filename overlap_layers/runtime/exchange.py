"""Rank-chunk exchanges: an all-gather taken one source rank at a time and a reduce-scatter given
one destination rank at a time, so that compute on one chunk hides the transfer of the next.

Reference, for rank r of a group of ws ranks, local sources ``src[i]`` of shape ``[T, ...]`` and
partials of shape ``[T, *partial]``::

    step j = 1 .. ws-1 talks to q = (r + j) % ws (it receives q's rows) and s = (r - j) % ws
    pull(j)[i]      == src[i] of rank q                          (all-gather, one chunk)
    whole(i)        == src[i] of every rank ``[ws, T, ...]``, after every pull, where
                       ``keep_gathered[i]`` copied the own rows in (the all-gather)
    push(j, p_rq)   sends rank r's partial for q's rows to q
    finish()        == own + sum over s != r of the partial rank s pushed for r's rows
                       (reduce-scatter of the partials; ``own`` is written into ``own_partial``)
    reduce_early(n) may come after the last push, once rows ``[0, n)`` of ``own_partial`` are
                    written (default: all rows): the copy engine then sums those rows on its push
                    stream while the caller computes on (the MLP backward's weight gradients, its
                    forward's own second half); ``finish()`` joins it and sums the rest

With ``blocks`` (row ranges ``[a, b)`` of ``T``, default one block of all rows; the attention's
batch tiles), every step moves block by block: ``pull(j, i)`` is rows ``blocks[i]`` of q's
sources and ``push(j, p, i)`` fills rows ``blocks[i]`` of q's slot; ``finish`` needs every
(step, block) pushed once.

With ``split_last`` (and a last block of two rows or more), the last push, step ws-1 of the last
block, comes in two halves, ``push(j, p, i, half=0)`` then ``half=1``, rows ``halves`` of the
block, so that the first half's transfer runs while the second half is computed ([Note: halved
last push]).

Every rank issues steps in the same order (pulls block by block, 1..ws-1 each, at creation, then
pushes as it calls them: block by block, in step order), so matching is by construction. Two
transports implement it:

* :class:`CopyEngineExchange` (CUDA, ``torch.distributed._symmetric_memory``): sources are copied
  into this rank's symmetric buffer, peers pull them with device-to-device copies over NVLink
  ("Memcpy PtoP": the copy engines, no SMs), partials are copied into the owner's buffer; a pull
  and a push each wait for peer signals instead of a barrier ([Note: exchange signals]).
* :class:`PointToPointExchange` (any backend with ``isend``/``irecv``: NCCL, gloo): one
  ``batch_isend_irecv`` group per step. On NCCL these are SM kernels like any collective; on CPU
  it is how the rank-chunk schedule is tested.

[Note: exchange signals]
A rank's symmetric workspace holds its sources (pulled by peers) and ws partial slots (pushed into
by peers; slot r is its own). Per call and peer p, two signals on the workspace's signal pad:
channel 0 "my sources are in my buffer" (put after the local copy; every peer's is waited before
the first pull) and channel 1 "my partial for you is in your slot" (put after the push, waited
before the sum). Reuse is safe without barriers: rank r overwrites its sources (next call) only
after waiting for every peer's channel-1 signal, which each peer puts after its pull from r, and r
pushes into p's slot only after p's channel-0 signal of the same call, which p puts after summing
its slots of the previous call (all ordered on p's current stream; a sum that ``reduce_early`` ran
on the push stream, with its signal waits, is joined into the current stream by ``finish`` before
the call returns). A signal is a flag that the wait resets, and the order above never puts a flag
twice before it is waited. Every exchange on one workspace must run on the same current stream, in
the same order on every rank: one layer after another, as a model runs them. A halved last push
([Note: halved last push]) puts channel 1 once, after its second half.

[Note: halved last push]
A rank-chunk pass ends with its last push (step ws-1: the partial for rank r-1, whose sum waits
for it) and the sum of the slots. In the attention forward the last peer's projection runs, then
its push beside the own rows' projection, then the sum. In halves, the first half's copy starts
one half-projection earlier, beside the second half's. Every rank halves the same push (step ws-1
of the last block, rows split at ``(b - a) // 2``), so the transfers match by construction; the
peer's slot is complete, and signalled, after the second half.

The first half is not signalled on its own (which would let the sum of the rows before the split
start while the second half is in flight): the signal's kernel, queued between the two copies,
waits for an SM beside the own projection's GEMM and holds back the second copy by as much, the
sum in two kernels costs more than in one, and the sum cannot start before the stream joins the
pushes anyway. The same wait for an SM is why the signals stay off the compute stream's busy
stretches.

What the first pull waits for: the last rank to finish its previous call. The ranks' backward
passes end tens of microseconds apart (each ends with its sum beside the weight gradient), and the
next forward's first pulls start together on every rank, once the last rank has signalled. The
rank that sets the pace, the last, does not wait there: its own rows' work outlasts the pull,
and the other ranks' waits only move to their next wait on it. So the copy streams keep the
default priority, the compute stream does not wait for this rank's PULL signals before its first
GEMM, and the first pull is not split in halves: each of these was measured and made no
difference beyond noise.

The signals are the handle's kernels of one warp, which beside a GEMM holding every SM start only
once an SM frees. Stream memory operations, which take no SM (``cuStreamWriteValue32`` on the
peer's signal pad, ``cuStreamWaitValue32``, then a write of 0), measured no faster either. A plain
write of 1 would also need every flag's next put to follow its reset, which the exchanges give
but the planner's timed signal (a put-then-wait ring, repeated) does not.

Measured, with the numbers of each alternative: see docs/measurements.md (Attention).
"""
from __future__ import annotations

import importlib.util
import math
import warnings
import weakref
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config import Transport
from ..kernels.slot_sum import sum_slots

PULL, PUSH = 0, 1  # signal channels ([Note: exchange signals])


def peers(rank: int, world_size: int) -> List[Tuple[int, int, int]]:
    """``(j, q, s)`` per step: receive from ``q = rank + j``, send to ``s = rank - j`` (mod ws)."""
    return [(j, (rank + j) % world_size, (rank - j) % world_size) for j in range(1, world_size)]


def _blocks(blocks: Optional[Sequence[Tuple[int, int]]], rows: int) -> List[Tuple[int, int]]:
    """The row blocks of an exchange (default: one block of all ``rows``)."""
    out = [(0, rows)] if blocks is None else [(int(a), int(b)) for a, b in blocks]
    assert out and all(0 <= a < b <= rows for a, b in out), f"blocks {out} must be row ranges of {rows} rows"
    return out


def block_tag(block: int, tag, blocks: int):
    """A tag in traces (a transfer's step, a piece's name), prefixed by its block (the
    attention's batch tile) when an exchange has several; the cost models tag their predicted
    events the same way."""
    return tag if blocks == 1 else f"{block}.{tag}"


def push_tag(block: int, step, blocks: int, half: Optional[int] = None):
    """A push's tag in traces (or a piece's: ``step`` may be any tag): :func:`block_tag` of its
    step, with ``[:h]`` or ``[h:]`` for the halves of a halved last push ([Note: halved last
    push])."""
    return block_tag(block, step if half is None else f"{step}{('[:h]', '[h:]')[half]}", blocks)


def _push_step(n: int, world_size: int) -> Tuple[int, int]:
    """``(step, block)`` of the n-th push: block by block, steps 1..ws-1 in each."""
    return n % (world_size - 1) + 1, n // (world_size - 1)


class _PushOrder:
    """The pushes of one exchange, as the module docstring orders them: block by block, steps
    1..ws-1 in each, the last one in two halves with ``split_last``."""

    def __init__(self, blocks: List[Tuple[int, int]], world_size: int, split_last: bool):
        a, b = blocks[-1]
        self.blocks, self.ws = blocks, world_size
        self.split = a + (b - a) // 2 if split_last and b - a >= 2 else None  # the halves' boundary row
        self.n = 0  # pushes so far (a half counts as one)
        self.total = len(blocks) * (world_size - 1) + (self.split is not None)

    @property
    def halves(self) -> Optional[Tuple[Tuple[int, int], Tuple[int, int]]]:
        """The halves of the last push, rows relative to its block (None: pushed whole)."""
        if self.split is None:
            return None
        a, b = self.blocks[-1]
        return (0, self.split - a), (self.split - a, b - a)

    def next(self, j: int, block: int, half: Optional[int]) -> Tuple[int, int]:
        """Rows ``[a, b)`` of the slot that this push fills, after checking that it comes next."""
        assert not self.done, "every step pushed each block already"
        last = len(self.blocks) * (self.ws - 1) - 1  # the last (step, block)'s index
        n = min(self.n, last)
        want = (*_push_step(n, self.ws), None if self.split is None or n < last else self.n - last)
        assert (j, block, half) == want, f"push (step, block, half) {(j, block, half)}; the next one is {want}"
        self.n += 1
        a, b = self.blocks[block]
        return (a, b) if half is None else (a, self.split) if half == 0 else (self.split, b)

    @property
    def done(self) -> bool:
        return self.n == self.total


def _gathered(sources: Sequence[torch.Tensor], world_size: int) -> List[torch.Tensor]:
    """``[ws, T, ...]`` receive buffers per source (row block ``rank`` stays unwritten unless
    :func:`_keep_own` fills it)."""
    return [s.new_empty((world_size, *s.shape)) for s in sources]


def _keep_own(gathered: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], rank: int,
              keep: Sequence[bool]) -> None:
    """Copy each source into row block ``rank`` of its receive buffer where ``keep`` says so (the
    caller keeps the whole gathered tensor), on the current stream."""
    for i, (g, s) in enumerate(zip(gathered, sources)):
        if i < len(keep) and keep[i]:
            g[rank].copy_(s)


class PointToPointExchange:
    """The exchange over ``isend``/``irecv`` (see the module docstring)."""

    transport = Transport.NCCL

    def __init__(self, group, sources: Sequence[torch.Tensor], partial_shape: Tuple[int, ...],
                 keep_gathered: Sequence[bool] = (), recorder=None, blocks: Optional[Sequence[Tuple[int, int]]] = None,
                 split_last: bool = False):
        self.group, self.ws, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.recorder = recorder  # an OpRecorder: marks each wait and push on the current stream
        self._g = [dist.get_global_rank(group, i) for i in range(self.ws)]
        self.sources = [s.contiguous() for s in sources]
        self.gathered = _gathered(self.sources, self.ws)
        _keep_own(self.gathered, self.sources, self.rank, keep_gathered)
        x = self.sources[0]
        self.slots = x.new_empty((self.ws, *partial_shape))
        self.own_partial = self.slots[self.rank]
        self.blocks = _blocks(blocks, x.shape[0])
        self._pull_works, self._push_works, self._keep = {}, [], []
        for i, (a, b) in enumerate(self.blocks):
            for j, q, s in peers(self.rank, self.ws):
                ops = []
                for src, dst in zip(self.sources, self.gathered):
                    ops += [dist.P2POp(dist.isend, src[a:b], self._g[s], group),
                            dist.P2POp(dist.irecv, dst[q, a:b], self._g[q], group)]
                self._pull_works[j, i] = dist.batch_isend_irecv(ops)
        self._order = _PushOrder(self.blocks, self.ws, split_last)
        self.halves = self._order.halves  # the last push's halves (rows of its block), or None

    summed_early = False  # NCCL's works are waited on the current stream: the sums stay in finish

    def whole(self, i: int) -> torch.Tensor:
        """Source ``i`` of every rank ``[ws, T, ...]``, once every step pulled it and its own
        rows were kept (``keep_gathered``)."""
        assert not self._pull_works, "every step must pull each block first"
        return self.gathered[i]

    def reduce_early(self, rows: Optional[int] = None) -> None:
        """Nothing: :meth:`finish` waits for the pushes and sums (see the module docstring)."""

    def pull(self, j: int, block: int = 0) -> List[torch.Tensor]:
        for w in self._pull_works.pop((j, block)):
            w.wait()
        if self.recorder is not None:
            self.recorder.mark("pull", block_tag(block, j, len(self.blocks)), "comm")
        q, (a, b) = (self.rank + j) % self.ws, self.blocks[block]
        return [g[q, a:b] for g in self.gathered]

    def push(self, j: int, partial: torch.Tensor, block: int = 0, half: Optional[int] = None) -> None:
        partial = partial.contiguous()
        self._keep.append(partial)
        if self.recorder is not None:
            self.recorder.mark("push", push_tag(block, j, len(self.blocks), half), "comm")
        a, b = self._order.next(j, block, half)
        q, s = (self.rank + j) % self.ws, (self.rank - j) % self.ws
        self._push_works += dist.batch_isend_irecv([dist.P2POp(dist.isend, partial, self._g[q], self.group),
                                                    dist.P2POp(dist.irecv, self.slots[s, a:b], self._g[s], self.group)])

    def finish(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        assert self._order.done and not self._pull_works, "every step must pull and push each block once"
        for w in self._push_works:
            w.wait()
        self._keep.clear()
        return sum_slots(self.slots, out)


class SymmetricWorkspace:
    """One rank's symmetric buffer for a group (sources, then ws partial slots), its handle and
    the two copy streams; grown collectively when a call needs more bytes.

    Layers get it from :func:`shared_workspace`, so every layer of a group shares one buffer
    (sized for the largest exchange) instead of each holding its own. Its bytes are persistent
    device memory beside the layers'; it is freed when the last layer holding it is. Growing is a
    collective decided from each rank's own size, so every rank must hold the same workspace: the
    bytes a rank holds are a column of every call's agreement (:func:`held_workspace_bytes`), and
    when ranks differ (some still hold the workspace of freed layers) all release theirs first.

    A CUDA graph that captured an exchange copies into this buffer, and its peers' graphs into
    theirs, at every replay: once captured, a buffer outgrown later is kept (with its handle)
    rather than freed, and growing during a capture raises RuntimeError ([Note: CUDA graphs] in
    ``planning/planned.py``)."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.ws, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.nbytes, self._buf, self.handle = 0, None, None
        self.captured = False  # whether a CUDA graph captured an exchange on the current buffer
        self._retired: list = []  # (buffer, handle) outgrown after a capture: graphs still use them
        self._views: dict = {}  # (rank, shape, dtype, offset) -> tensor: every call asks for the same few
        self.pull_stream = torch.cuda.Stream(device=device)
        self.push_stream = torch.cuda.Stream(device=device)

    def reserve(self, nbytes: int) -> None:
        """Grow to at least ``nbytes`` (a collective: every rank passes the same number)."""
        capturing = torch.cuda.is_current_stream_capturing()
        if nbytes <= self.nbytes:
            self.captured |= capturing
            return
        if capturing:
            raise RuntimeError(f"a copy-engine exchange needs {nbytes} symmetric bytes while a CUDA graph is being "
                               f"captured, and the workspace has {self.nbytes}: allocating them is a collective "
                               "with host synchronisation, which capture forbids; run one eager call of this "
                               "shape before capturing")
        from torch.distributed import _symmetric_memory as symm_mem
        if self._buf is not None:
            self.release()
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed on older torch; a deprecated no-op on newer ones
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group.group_name)
        nbytes = -(-nbytes // 4096) * 4096
        self._buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self._buf, self.group)
        self.nbytes = nbytes

    def release(self) -> None:
        """Free the buffer (kept alive instead if a graph captured it) once every rank has drained
        its work, since peers may still read it: a collective, every rank of the group calls it at
        the same point (growing, or :meth:`RankChunkPlans._after_agreement` when the ranks'
        workspaces differ), with or without a buffer."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        if self.captured:
            self._retired.append((self._buf, self.handle))
        self._buf = self.handle = None
        self._views.clear()
        self.nbytes, self.captured = 0, False

    def view(self, rank: int, shape: Tuple[int, ...], dtype: torch.dtype, offset_bytes: int) -> torch.Tensor:
        """Rank ``rank``'s buffer from ``offset_bytes`` as a ``shape`` tensor of ``dtype`` (made
        once per workspace size: a peer buffer's tensor costs host time to build)."""
        key = (rank, tuple(shape), dtype, offset_bytes)
        t = self._views.get(key)
        if t is None:
            if len(self._views) >= 256:  # many shapes (e.g. varying lengths): start over
                self._views.clear()
            elt = dtype.itemsize
            assert offset_bytes % elt == 0
            t = self._views[key] = self.handle.get_buffer(rank, tuple(shape), dtype, offset_bytes // elt)
        return t


_WORKSPACES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _workspace_key(group, device: torch.device, purpose: str) -> tuple:
    """``(id(group), device index, purpose)``: a workspace holds its group, so the id is that
    group's for as long as the entry lives. Not the group's name: names repeat after
    ``destroy_process_group`` and a new ``init_process_group``, while layers of the old group may
    still hold its workspace."""
    return id(group), device.index if device.index is not None else torch.cuda.current_device(), purpose


def shared_workspace(group, device: torch.device, purpose: str = "exchange") -> SymmetricWorkspace:
    """The workspace of ``group`` on ``device`` for ``purpose``, shared by the layers that hold it
    (a weak cache: no layer holding it, no buffer). Exchanges whose protocols differ use
    workspaces of their own: "exchange" for the copy-engine exchanges of this module,
    "device_counts" for ``device_all_to_all.DeviceCountAllToAll`` (its peers write its table
    without waiting for this rank's next call, which another protocol's data there would race)."""
    key = _workspace_key(group, device, purpose)
    w = _WORKSPACES.get(key)
    if w is None:
        w = _WORKSPACES[key] = SymmetricWorkspace(group, torch.device("cuda", key[1]))
    return w


def held_workspace_bytes(group, device: torch.device, purpose: str = "exchange") -> int:
    """Bytes of ``group``'s shared workspace on ``device`` in this process; 0 when it has none
    (CPU included). Never creates one. Ranks can differ here only when some still hold the
    workspace of layers that others have freed (garbage collection runs at different times)."""
    if device.type != "cuda":
        return 0
    w = _WORKSPACES.get(_workspace_key(group, device, purpose))
    return w.nbytes if w is not None else 0


def staged_source(workspace: SymmetricWorkspace, x: torch.Tensor) -> Optional[torch.Tensor]:
    """Where :class:`CopyEngineExchange` copies a first source with ``x``'s elements, as a tensor
    of ``x``'s shape in this rank's buffer (a contiguous source there is not copied again:
    [Note: staged input] in ``planning/call_graphs.py``); None while the buffer is smaller."""
    if workspace.handle is None or workspace.nbytes < aligned(x.numel() * x.element_size()):
        return None
    return workspace.view(workspace.rank, (x.numel(),), x.dtype, 0).view(x.shape)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 256 (each source starts on a 256-byte boundary)."""
    return -(-nbytes // 256) * 256


def workspace_bytes(world_size: int, source_shapes: Sequence[Tuple[int, ...]], partial_shape: Tuple[int, ...],
                    elt: int) -> int:
    """Symmetric bytes one exchange needs: its sources and ``world_size`` partial slots."""
    return sum(aligned(math.prod(s) * elt) for s in source_shapes) + world_size * math.prod(partial_shape) * elt


class CopyEngineExchange:
    """The exchange over symmetric memory and the copy engines (see the module docstring)."""

    transport = Transport.COPY_ENGINE

    def __init__(self, workspace: SymmetricWorkspace, sources: Sequence[torch.Tensor],
                 partial_shape: Tuple[int, ...], keep_gathered: Sequence[bool] = (), recorder=None,
                 blocks: Optional[Sequence[Tuple[int, int]]] = None, split_last: bool = False):
        w = self.w = workspace
        rec = self.recorder = recorder  # an OpRecorder: times each copy on its stream
        self.ws, self.rank = w.ws, w.rank
        self.sources = [s.contiguous() for s in sources]
        dtype = self.sources[0].dtype
        elt = self.sources[0].element_size()
        w.reserve(workspace_bytes(self.ws, [tuple(s.shape) for s in self.sources], tuple(partial_shape), elt))
        self._src_offsets, off = [], 0
        for s in self.sources:
            self._src_offsets.append(off)
            off += aligned(s.numel() * elt)
        self._slot_offset, self._partial_shape, self._dtype = off, tuple(partial_shape), dtype
        self.slots = w.view(self.rank, (self.ws, *partial_shape), dtype, off)
        self.own_partial = self.slots[self.rank]
        self.gathered = _gathered(self.sources, self.ws)
        self.blocks = _blocks(blocks, self.sources[0].shape[0])
        compute = torch.cuda.current_stream(w.device)
        w.pull_stream.wait_stream(compute)
        self._pulled = {}
        with torch.cuda.stream(w.pull_stream):  # the compute stream starts on the own rows meanwhile
            tok = rec.begin("to_symmetric", 0, "comm", stream=w.pull_stream) if rec is not None else None
            for s, off in zip(self.sources, self._src_offsets):
                place = w.view(self.rank, tuple(s.shape), dtype, off)
                if place.data_ptr() != s.data_ptr():  # else staged there already ([Note: staged input])
                    place.copy_(s)
            if tok is not None:
                rec.end(tok, stream=w.pull_stream)
            for _, _, s in peers(self.rank, self.ws):
                w.handle.put_signal(s, PULL)
            # every peer's sources first: all ranks then pull step by step together, and step j's
            # reads (rank r from r + j) form a permutation; a rank one step ahead of its neighbour
            # would read the same source as it, both at half speed (measured: 180 us pulls for 90)
            for _, q, _ in peers(self.rank, self.ws):
                w.handle.wait_signal(q, PULL)
            for i, (a, b) in enumerate(self.blocks):
                for j, q, _ in peers(self.rank, self.ws):
                    tok = rec.begin("pull", block_tag(i, j, len(self.blocks)), "comm", stream=w.pull_stream) \
                        if rec is not None else None
                    for src, g, off in zip(self.sources, self.gathered, self._src_offsets):
                        g[q, a:b].copy_(w.view(q, tuple(src.shape), dtype, off)[a:b])
                    if tok is not None:
                        rec.end(tok, stream=w.pull_stream)
                    ev = torch.cuda.Event()
                    ev.record(w.pull_stream)
                    self._pulled[j, i] = ev
            # after the pulls: a copy beside the GEMMs runs at a third of its speed (measured: 51 us for
            # 16), and before the signals it delayed every pull by that much
            _keep_own(self.gathered, self.sources, self.rank, keep_gathered)
            self._kept = torch.cuda.Event()  # finish() joins it: the caller may read every gathered row after
            self._kept.record(w.pull_stream)
        self._order = _PushOrder(self.blocks, self.ws, split_last)
        self.halves = self._order.halves  # the last push's halves (rows of its block), or None
        self._early: Optional[Tuple[torch.Tensor, int, torch.cuda.Event]] = None  # (sum, rows, done): reduce_early

    def whole(self, i: int) -> torch.Tensor:
        """Source ``i`` of every rank ``[ws, T, ...]``, once every step pulled it and its own
        rows were kept (``keep_gathered``): the current stream joins the copy of the own rows."""
        assert not self._pulled, "every step must pull each block first"
        torch.cuda.current_stream(self.w.device).wait_event(self._kept)
        return self.gathered[i]

    def pull(self, j: int, block: int = 0) -> List[torch.Tensor]:
        torch.cuda.current_stream(self.w.device).wait_event(self._pulled.pop((j, block)))
        q, (a, b) = (self.rank + j) % self.ws, self.blocks[block]
        return [g[q, a:b] for g in self.gathered]

    def push(self, j: int, partial: torch.Tensor, block: int = 0, half: Optional[int] = None) -> None:
        w, q = self.w, (self.rank + j) % self.ws
        a, b = self._order.next(j, block, half)
        w.push_stream.wait_stream(torch.cuda.current_stream(w.device))
        partial.record_stream(w.push_stream)
        with torch.cuda.stream(w.push_stream):
            dst = w.view(q, (self.ws, *self._partial_shape), self._dtype, self._slot_offset)[self.rank]
            tok = self.recorder.begin("push", push_tag(block, j, len(self.blocks), half), "comm",
                                      stream=w.push_stream) if self.recorder is not None else None
            dst[a:b].copy_(partial)
            if tok is not None:
                self.recorder.end(tok, stream=w.push_stream)
            if block == len(self.blocks) - 1 and half != 0:  # the peer's slot is complete: one signal per call
                w.handle.put_signal(q, PUSH)

    @property
    def summed_early(self) -> bool:
        """Whether :meth:`reduce_early` summed every row (``finish`` then only joins it)."""
        return self._early is not None and self._early[1] == self.slots.shape[1]

    def reduce_early(self, rows: Optional[int] = None) -> None:
        """Queue the sum of the slots' rows ``[0, rows)`` (default all) on the push stream, after
        this rank's pushes and the peers' PUSH signals, so that compute launched after this call
        runs beside it; :meth:`finish` sums the rest. Every push must be done and those rows of
        ``own_partial`` written (both ordered before the push stream by now: each push waits for
        the current stream). Timed as ``sum[early]`` on ``compute1`` by the recorder."""
        assert self._order.done and not self._pulled, "every step must pull and push each block once"
        w, compute = self.w, torch.cuda.current_stream(self.w.device)
        n = self.slots.shape[1] if rows is None else rows
        out = torch.empty(self.slots.shape[1:], dtype=self.slots.dtype, device=w.device)  # the caller's stream owns it
        w.push_stream.wait_stream(compute)
        with torch.cuda.stream(w.push_stream):
            tok = self.recorder.begin("sum", "early", "compute1", stream=w.push_stream) if self.recorder is not None \
                else None
            for _, _, s in peers(self.rank, self.ws):
                w.handle.wait_signal(s, PUSH)
            sum_slots(self.slots[:, :n], out[:n])
            if tok is not None:
                self.recorder.end(tok, stream=w.push_stream)
            done = torch.cuda.Event()
            done.record(w.push_stream)
        self._early = (out, n, done)

    def finish(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of the slots (into ``out`` if given). After :meth:`reduce_early`: joins it and
        sums the remaining rows (the peers' signals were waited there)."""
        assert self._order.done and not self._pulled, "every step must pull and push each block once"
        compute = torch.cuda.current_stream(self.w.device)
        compute.wait_event(self._kept)
        if self._early is not None:
            summed, n, done = self._early
            compute.wait_event(done)
            if n < summed.shape[0]:
                sum_slots(self.slots[:, n:], summed[n:])
            return summed if out is None else out.copy_(summed)
        compute.wait_stream(self.w.push_stream)
        for _, _, s in peers(self.rank, self.ws):
            self.w.handle.wait_signal(s, PUSH)
        return sum_slots(self.slots, out)


def symmetric_memory_status(group, device: torch.device) -> str:
    """"" when this group can use the copy-engine transport on ``device``, else why not.

    Local facts only (device type, backend, the symmetric-memory module, peer access); the caller
    agrees the answer across ranks, and that they share one host, before acting on it."""
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError) as e:
        return f"the group has no backend ({e})"
    if "nccl" not in str(backend):
        return f"the group's backend is {backend}, not nccl"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return "torch.distributed._symmetric_memory is missing"
    if dist.get_world_size(group) > torch.cuda.device_count():
        return "the group has more ranks than this host has GPUs"
    me = device.index if device.index is not None else torch.cuda.current_device()
    for other in range(torch.cuda.device_count()):
        if other != me and not torch.cuda.can_device_access_peer(me, other):
            return f"cuda:{me} cannot access cuda:{other} as a peer"
    return ""
