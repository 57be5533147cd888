"""The rank-chunk exchange over symmetric memory and the copy engines (CUDA); its reference and
step order: ``runtime/exchange.py``'s module docstring. Sources are copied into this rank's
symmetric buffer (``runtime/symmetric.py``), peers pull them with device-to-device copies over
NVLink ("Memcpy PtoP": the copy engines, no SMs), partials are copied into the owner's buffer; a
pull and a push each wait for peer signals instead of a barrier ([Note: exchange signals])."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..config import Transport
from ..kernels.slot_sum import sum_slots
from .exchange import PULL, PUSH, PushOrder, block_tag, gathered_buffers, keep_own, peers, push_tag, row_blocks, \
    workspace_bytes
from .symmetric import SymmetricWorkspace, aligned


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
        self.gathered = gathered_buffers(self.sources, self.ws)
        self.blocks = row_blocks(blocks, self.sources[0].shape[0])
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
            keep_own(self.gathered, self.sources, self.rank, keep_gathered)
            self._kept = torch.cuda.Event()  # finish() joins it: the caller may read every gathered row after
            self._kept.record(w.pull_stream)
        self._order = PushOrder(self.blocks, self.ws, split_last)
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

