"""The rank-chunk exchange over ``isend``/``irecv`` (any backend: NCCL, gloo), one
``batch_isend_irecv`` group per step; its reference and step order: ``runtime/exchange.py``'s
module docstring. On NCCL these are SM kernels like any collective; on CPU it is how the
rank-chunk schedule is tested."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config import Transport
from ..kernels.slot_sum import sum_slots
from .exchange import PushOrder, block_tag, gathered_buffers, keep_own, peers, push_tag, row_blocks


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
        self.gathered = gathered_buffers(self.sources, self.ws)
        keep_own(self.gathered, self.sources, self.rank, keep_gathered)
        x = self.sources[0]
        self.slots = x.new_empty((self.ws, *partial_shape))
        self.own_partial = self.slots[self.rank]
        self.blocks = row_blocks(blocks, x.shape[0])
        self._pull_works, self._push_works, self._keep = {}, [], []
        for i, (a, b) in enumerate(self.blocks):
            for j, q, s in peers(self.rank, self.ws):
                ops = []
                for src, dst in zip(self.sources, self.gathered):
                    ops += [dist.P2POp(dist.isend, src[a:b], self._g[s], group),
                            dist.P2POp(dist.irecv, dst[q, a:b], self._g[q], group)]
                self._pull_works[j, i] = dist.batch_isend_irecv(ops)
        self._order = PushOrder(self.blocks, self.ws, split_last)
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

