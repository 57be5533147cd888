"""Costs of the rank-chunk plans (``layers/common/rank_chunks.py``, the attention's and the MoE's
rank chunks): the half of a layer's cost model that the tile simulator does not cost.

[Note: rank-chunk cost]
A rank-chunk plan (``layers/common/rank_chunks.py``; the attention's in ``layers/attention/rank_chunks.py``) is costed by a
recurrence, not the tile simulator: its pieces (:meth:`MLPCostModel.rank_pieces`: for the MLP
forward own first half, ws-1 peer chunks, own second half, backward own rows then the peers'; for
the attention, per batch tile, the projections around the tile's core) run back to back on the
compute stream; the pulls (of every source) run back to back on their own stream, block by block
(one block, or one per batch tile: a block's share of the chunk's copy time), steps 1..ws-1 in
each, and a piece that needs one starts at ``max(compute free, its pull done)``; pushes run on a
third stream, each after its piece's compute but its tail (the weight gradients a backward piece
launches after its push); the sum of the slots (``(ws+1)*T*H*e`` bytes) runs after the last piece
and the last push, except that over the copy engine rows are summed on a second stream right
after the last push (``early_sum_rows``): the MLP's backward all of them, beside the last piece's
tail; its forward the own first half's, beside the own second half, the rest after it; the
attention's backward all of them once its last own piece has written its rows too (before that
piece's tail, its weight gradients, which run beside the sum). A halved last push (the
attention's: [Note: halved last push] in ``runtime/exchange.py``) is two pieces, each pushing its
share of the rows. A
transfer of ``b`` bytes is the measured peer copy (``"peer_copy:b"``) over the copy engine, or a
send/recv estimated as an all-gather step (``all_gather`` of ``ws*b`` bytes over ws-1 steps)
over NCCL, which also slows every piece by the interference factor. The copy engine adds the
copies of the sources into the symmetric buffer (on the pull stream, beside the first piece) and
one signal round trip (``"signal"``) before the first pull and after the last push. Peak memory:
the serial plan's, plus the partial slots (``ws*T*H*e``; in the persistent symmetric workspace
for the copy engine, with the sources), minus the activation of ws-1 chunks (a piece holds ``h``
for its own ``T`` rows, the serial layer for all ``ws*T``).
"""
from __future__ import annotations

from typing import List, Tuple

from ...config import Transport
from ...runtime.exchange import block_tag, push_tag, workspace_bytes
from ...sim import Timeline
from ...sim.simulator import Event, timeline_from_events


class RankChunkCost:
    """The rank-chunk costs of a cost model ([Note: rank-chunk cost]), the MLP's pieces by default;
    the model provides ``rows``, ``ws``, ``H``, ``F``, ``e``, ``sp``, ``model`` (the hardware
    model) and ``op_ms(m, name)``."""

    has_rank_chunks = True  # whether the layer runs the rank-chunk plan (subclasses: no)

    def chunk_rows(self) -> int:
        """Rows of one rank's chunk (its local rows)."""
        return self.rows

    def piece_rows(self) -> Tuple[int, ...]:
        """Row counts of the rank-chunk pieces (local rows, the own halves); none without SP."""
        T = self.chunk_rows()
        if not (self.has_rank_chunks and self.sp and self.ws > 1):
            return ()
        return tuple(sorted({T, T // 2, T - T // 2} - {0}))

    def chunk_bytes(self) -> int:
        return self.chunk_rows() * self.H * self.e

    def rank_tiles(self) -> Tuple[int, ...]:
        """Batch tile counts of the rank-chunk candidates (the MLP's run all rows at once)."""
        return (1,)

    def rank_blocks(self, tiles: int) -> List[Tuple[int, int]]:
        """The exchange's row blocks of a rank-chunk plan with ``tiles`` tiles, in chunk units."""
        return [(0, self.chunk_rows())]

    def transfer_ms(self, transport: str, nbytes: int) -> float:
        md = self.model
        if transport == Transport.COPY_ENGINE:
            return md.op_ms(f"peer_copy:{nbytes}", nbytes)
        return md.comm_ms("all_gather", self.ws * nbytes) / (self.ws - 1)

    def rank_pieces(self, backward: bool, tiles: int = 1,
                    transport: Transport = Transport.COPY_ENGINE
                    ) -> List[Tuple[str, str, float, int, int, int, float, float]]:
        """``(name, tag, compute ms, pull step, push step, block, tail ms, pushed share)`` of the
        MLP's pieces in launch order (step 0: no transfer; one block; the tail: the piece's compute
        after its push, the weight gradients; the share of its block's rows that it pushes, 1 but
        for a halved last push's halves, the attention's): forward own first half, the peers'
        chunks (pulled, then pushed), own second half; backward own rows whole, then the peers',
        then the weight gradients over every gathered row (``layers/common/rank_chunks.py``). The pieces do not
        depend on ``transport`` (the attention's may)."""
        T = self.chunk_rows()
        if backward:
            dgrad = sum(self.op_ms(T, op) for op in ("dgrad2", "act_bwd", "dgrad1"))
            wgrads = sum(self.op_ms(self.ws * T, op) for op in ("wgrad2", "wgrad1"))
            return [("bwd", str(j) if j else "own", dgrad, j, j, 0, 0.0, 1.0) for j in range(self.ws)] + \
                [("wgrad", "all", wgrads, 0, 0, 0, wgrads, 1.0)]
        half = T // 2

        def ms(m):
            return sum(self.op_ms(m, op) for op in ("fc1", "act", "fc2"))
        out = [("fwd", "own[:h]", ms(half), 0, 0, 0, 0.0, 1.0)] if half else []
        out += [("fwd", str(j), ms(T), j, j, 0, 0.0, 1.0) for j in range(1, self.ws)]
        return out + [("fwd", "own[h:]" if half else "own", ms(T - half), 0, 0, 0, 0.0, 1.0)]

    def to_symmetric_ms(self, sources: int) -> float:
        """The copies of the sources into the symmetric buffer (copy engine)."""
        return sources * self.model.mem_ms(2 * self.chunk_bytes())

    def final_op(self) -> Tuple[str, float]:
        """(name, ms) of what ``finish`` computes after the last push: the sum of the partial
        slots (``(ws+1)*T*H*e`` bytes)."""
        return "sum", self.model.mem_ms((self.ws + 1) * self.chunk_bytes())

    def early_sum_rows(self, backward: bool, transport: str) -> int:
        """Rows of the slots summed beside the compute after the last push (``reduce_early``,
        over the copy engine): backward all (beside the last piece's weight gradients), forward
        the own first half's (beside the own second half)."""
        if transport != Transport.COPY_ENGINE:
            return 0
        T = self.chunk_rows()
        return T if backward else T // 2

    def early_sum_waits_own(self, backward: bool) -> bool:
        """Whether the early sum also waits for the last own piece (less its tail): no, the
        MLP's early rows are written by its first piece."""
        return False

    def rank_chunk_timeline(self, *, backward: bool, transport: str, sources: int, tiles: int = 1) -> Timeline:
        """The predicted timeline of one rank-chunk pass ([Note: rank-chunk cost]): the pieces
        and the copies into / the sum of the symmetric buffer on ``compute0``, transfers on
        ``comm`` (a signal's wait delays the first pull and the sum)."""
        md, ws, chunk = self.model, self.ws, self.chunk_bytes()
        ce = transport == Transport.COPY_ENGINE
        slow = 1.0 if ce else md.interference
        signal = md.op_ms("signal", 0) if ce else 0.0
        events = []

        def add(name, tag, stream, start, ms):
            events.append(Event(name, tag, stream, start, start + ms))
            return start + ms

        blocks = self.rank_blocks(tiles)
        units = blocks[-1][1]

        def transfer(i):  # one block of a chunk
            return self.transfer_ms(transport, chunk) * (blocks[i][1] - blocks[i][0]) / units

        t = md.launch_ms
        copy_ms = self.to_symmetric_ms(sources) if ce else 0.0
        done = (add("to_symmetric", 0, "comm", 0.0, copy_ms) if copy_ms else 0.0) + signal
        pulled = {(0, i): t for i in range(len(blocks))}
        for i in range(len(blocks)):
            for j in range(1, ws):
                done = pulled[j, i] = add("pull", block_tag(i, j, len(blocks)), "comm", done, sources * transfer(i))
        pushed = own = 0.0
        halves = 0  # pushes of a halved last push so far
        for name, tag_, ms, pull, push, i, tail, share in self.rank_pieces(backward, tiles, transport):
            t = add(name, tag_, "compute0", max(t, pulled[pull, i]), ms * slow)
            if push:
                half, halves = (None, halves) if share == 1.0 else (halves, halves + 1)
                pushed = add("push", push_tag(i, push, len(blocks), half), "comm", max(pushed, t - tail * slow),
                             transfer(i) * share)
            elif not pull:
                own = t - tail * slow  # this own piece's rows are written
        rows, early, (final, sum_ms) = self.chunk_rows(), self.early_sum_rows(backward, transport), self.final_op()
        start = max(pushed + signal, own if self.early_sum_waits_own(backward) else 0.0)
        summed = add("sum", "early", "compute1", start, sum_ms * early / rows) if early else pushed + signal
        if early < rows:
            add(final, 0, "compute0", max(t, summed), sum_ms * (rows - early) / rows)
        return timeline_from_events(events, ["compute0", "compute1", "comm"] if early else ["compute0", "comm"])

    def rank_chunk_ms(self, *, backward: bool, transport: str, sources: int, tiles: int = 1) -> Tuple[float, float]:
        """(predicted ms, exposed communication ms) of one rank-chunk pass."""
        tl = self.rank_chunk_timeline(backward=backward, transport=transport, sources=sources, tiles=tiles)
        return tl.makespan_ms, tl.exposed_comm_ms

    def rank_slot_bytes(self, transport: str, sources: int) -> int:
        """Bytes of a rank-chunk plan's exchange buffers: over the copy engine the symmetric
        workspace (the sources and the partial slots), else the partial slots."""
        chunk = (self.chunk_rows(), self.H)
        if transport == Transport.COPY_ENGINE:
            return workspace_bytes(self.ws, [chunk] * sources, chunk, self.e)
        return self.ws * self.chunk_bytes()

    def rank_chunk_peak(self, serial_peak: int, slot_bytes: int) -> int:
        """Predicted peak bytes of the rank-chunk plan ([Note: rank-chunk cost])."""
        return serial_peak + slot_bytes - (self.ws - 1) * self.chunk_rows() * self.F * self.e
