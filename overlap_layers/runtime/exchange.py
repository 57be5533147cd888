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

* :class:`~.copy_engine_exchange.CopyEngineExchange` (CUDA, ``torch.distributed._symmetric_memory``,
  the group's workspace of ``runtime/symmetric.py``): sources are copied
  into this rank's symmetric buffer, peers pull them with device-to-device copies over NVLink
  ("Memcpy PtoP": the copy engines, no SMs), partials are copied into the owner's buffer; a pull
  and a push each wait for peer signals instead of a barrier ([Note: exchange signals]).
* :class:`~.p2p_exchange.PointToPointExchange` (any backend with ``isend``/``irecv``: NCCL, gloo): one
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

import math
from typing import List, Optional, Sequence, Tuple

import torch

from .symmetric import aligned

PULL, PUSH = 0, 1  # signal channels ([Note: exchange signals])


def peers(rank: int, world_size: int) -> List[Tuple[int, int, int]]:
    """``(j, q, s)`` per step: receive from ``q = rank + j``, send to ``s = rank - j`` (mod ws)."""
    return [(j, (rank + j) % world_size, (rank - j) % world_size) for j in range(1, world_size)]


def row_blocks(blocks: Optional[Sequence[Tuple[int, int]]], rows: int) -> List[Tuple[int, int]]:
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


def push_step(n: int, world_size: int) -> Tuple[int, int]:
    """``(step, block)`` of the n-th push: block by block, steps 1..ws-1 in each."""
    return n % (world_size - 1) + 1, n // (world_size - 1)


class PushOrder:
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
        want = (*push_step(n, self.ws), None if self.split is None or n < last else self.n - last)
        assert (j, block, half) == want, f"push (step, block, half) {(j, block, half)}; the next one is {want}"
        self.n += 1
        a, b = self.blocks[block]
        return (a, b) if half is None else (a, self.split) if half == 0 else (self.split, b)

    @property
    def done(self) -> bool:
        return self.n == self.total


def gathered_buffers(sources: Sequence[torch.Tensor], world_size: int) -> List[torch.Tensor]:
    """``[ws, T, ...]`` receive buffers per source (row block ``rank`` stays unwritten unless
    :func:`keep_own` fills it)."""
    return [s.new_empty((world_size, *s.shape)) for s in sources]


def keep_own(gathered: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], rank: int,
              keep: Sequence[bool]) -> None:
    """Copy each source into row block ``rank`` of its receive buffer where ``keep`` says so (the
    caller keeps the whole gathered tensor), on the current stream."""
    for i, (g, s) in enumerate(zip(gathered, sources)):
        if i < len(keep) and keep[i]:
            g[rank].copy_(s)


def workspace_bytes(world_size: int, source_shapes: Sequence[Tuple[int, ...]], partial_shape: Tuple[int, ...],
                    elt: int) -> int:
    """Symmetric bytes one exchange needs: its sources and ``world_size`` partial slots."""
    return sum(aligned(math.prod(s) * elt) for s in source_shapes) + world_size * math.prod(partial_shape) * elt


