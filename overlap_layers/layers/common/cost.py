"""Costs of the MLP's tile programs (the base cost model the other layers specialise).

Per tile with M gathered rows (ws * local rows with sequence parallelism, else local rows),
H hidden, I local fc1 width, F local ffn width, e bytes per element:

=========  ===================================  ====================================
op         time                                 memory allocated (freed after)
=========  ===================================  ====================================
ag / ag_x  collective over M*H*e                xg, M*H*e (fc1 / wgrad1; kept if saved)
fc1        GEMM (M, I, H)                       pre, M*I*e (act; kept for backward)
act        memory M*(I+F)*e                     h, M*F*e (fc2)
fc2        GEMM (M, H, F)                       partial out, M*H*e (wait_rs)
rs / ar    collective over M*H*e
ag_dy      collective over M*H*e                dy gathered, M*H*e (wgrad2)
dgrad2     GEMM (M, F, H)                       dh, M*F*e (act_bwd)
act_bwd    memory M*(2I+2F)*e                   dpre and h, M*(I+F)*e (wgrad1)
dgrad1     GEMM (M, H, I)                       dx gathered, M*H*e (wait_rs_dx)
wgrad2     GEMM (H, F, M);  wgrad1 GEMM (I, H, M)
=========  ===================================  ====================================

"memory b" is ``b`` bytes at the calibrated bandwidth unless the activation (or its backward, which
also returns the activation for wgrad2) was measured for M rows (key :meth:`MLPCostModel.act_key`). A collective's latency is its kind's
alpha; a member of a bucket of two or more also pays a copy of its M*H*e bytes in and out.

The candidates are compared by :func:`~overlap_layers.planning.candidates.plan_candidates`.

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

from typing import Callable, Dict, List, Optional, Set, Tuple

from ...config import Transport
from ...planning.candidates import TILE_CHOICES
from ...planning.tiling import tile_bounds
from ...runtime.exchange import block_tag, push_tag, workspace_bytes
from ...schedule import TileProgram, round_robin
from ...sim import Costs, HardwareModel, Timeline, simulate
from ...sim.simulator import Event, timeline_from_events


class MLPCostModel:
    """Maps the MLP's ops to times and bytes for one input shape."""

    has_rank_chunks = True  # whether the layer runs the rank-chunk plan (subclasses: no)

    def __init__(self, *, rows: int, world_size: int, hidden: int, n_in: int, f_local: int, elt: int,
                 sequence_parallel: bool, model: HardwareModel, activation: str = "swiglu"):
        self.rows, self.ws, self.H, self.I, self.F, self.e = rows, world_size, hidden, n_in, f_local, elt
        self.sp, self.model, self.activation = sequence_parallel, model, activation

    def act_key(self, name: str, m: int) -> str:
        """The measured-op key of the activation (``"act"``) or its backward (``"act_bwd"``)
        over ``m`` rows: ``"act:swiglu:MxI"``."""
        return f"{name}:{self.activation}:{m}x{self.I}"

    def act_ops(self, tile_choices=TILE_CHOICES) -> Dict[str, Tuple[str, int]]:
        """Key -> (name, rows) of every activation op the candidates run (for measuring)."""
        rows = {self.gathered(b - a) for k in tile_choices for a, b in tile_bounds(self.rows, k)}
        rows |= set(self.piece_rows())
        return {self.act_key(name, m): (name, m) for m in rows for name in ("act", "act_bwd")}

    def gathered(self, local_rows: int) -> int:
        return local_rows * (self.ws if self.sp else 1)

    def gemms(self, m: int) -> List[Tuple[int, int, int]]:
        H, I, F = self.H, self.I, self.F
        return [(m, I, H), (m, H, F), (m, F, H), (m, H, I), (H, F, m), (I, H, m)]

    def op_ms(self, m: int, name: str) -> float:
        md, H, I, F, e = self.model, self.H, self.I, self.F, self.e
        table: Dict[str, Callable[[], float]] = {
            "fc1": lambda: md.gemm_ms(m, I, H),
            "act": lambda: md.op_ms(self.act_key("act", m), m * (I + F) * e),
            "fc2": lambda: md.gemm_ms(m, H, F),
            "dgrad2": lambda: md.gemm_ms(m, F, H),
            "act_bwd": lambda: md.op_ms(self.act_key("act_bwd", m), m * (2 * I + 2 * F) * e),
            "dgrad1": lambda: md.gemm_ms(m, H, I),
            "wgrad2": lambda: md.gemm_ms(H, F, m),
            "wgrad1": lambda: md.gemm_ms(I, H, m),
        }
        return table[name]()

    def sizes(self) -> Dict[str, int]:
        """Op name -> elements per gathered row of the buffer it allocates (module table)."""
        H, I, F = self.H, self.I, self.F
        return {"ag": H, "ag_x": H, "fc1": I, "act": F, "fc2": H if self.sp else 0, "ag_dy": H,
                "dgrad2": F, "act_bwd": I + F, "dgrad1": H if self.sp else 0}

    def frees(self, *, save: bool, keep_xg: bool, backward: bool) -> Dict[str, Optional[str]]:
        """Op name -> the op after which its buffer dies (None: kept for backward)."""
        return {"ag": None if keep_xg else "fc1", "fc1": None if save and not backward else "act",
                "act": "fc2", "fc2": "wait_rs", "ag_dy": "wgrad2", "ag_x": "wgrad1", "dgrad2": "act_bwd",
                "act_bwd": "wgrad1", "dgrad1": "wait_rs_dx"}

    def saved_bytes(self, m: int, keep_xg: bool) -> int:
        """Bytes one tile of ``m`` gathered rows keeps for backward."""
        return (m * self.I + (m * self.H if keep_xg else 0)) * self.e

    def grad_bytes(self) -> int:
        return (self.I * self.H + self.F * self.H) * self.e

    def op_bytes(self, m: int, name: str) -> int:
        """Bytes the op ``name`` allocates for a tile of ``m`` gathered rows."""
        return m * self.sizes().get(name, 0) * self.e

    def comm_bytes(self, m: int, name: str) -> int:
        """Bytes a collective of a tile of ``m`` gathered rows moves (its gathered size)."""
        return m * self.H * self.e

    def local_bytes(self) -> int:
        """The layer's local input (alive through the call)."""
        return self.gathered(self.rows) // (self.ws if self.sp else 1) * self.H * self.e

    def costs(self, program: TileProgram, bounds, *, num_streams: int, save: bool, keep_xg: bool,
              backward: bool) -> Costs:
        """The simulator's costs for ``program`` over tiles ``bounds`` (in tile units)."""
        ms = [self.gathered(b - a) for a, b in bounds]

        def compute(tile, op):
            return self.op_ms(ms[tile], op.name)

        def comm(tile, op):
            return self.model.comm_ms(op.collective, self.comm_bytes(ms[tile], op.name))

        def nbytes(tile, op):
            return self.op_bytes(ms[tile], op.name)

        names = {op.name for op in program.ops}
        frees = {p: c for p, c in self.frees(save=save, keep_xg=keep_xg, backward=backward).items()
                 if p in names and (c is None or c in names)}
        local = self.local_bytes()
        if backward:  # saved activations, dx and the weight-gradient accumulators
            base = sum(self.saved_bytes(m, keep_xg) for m in ms) + local + self.grad_bytes()
        else:
            base = local

        def pack(tile, op):  # a bucket member copied into (or out of) the bucket's buffer
            return self.model.mem_ms(2 * self.comm_bytes(ms[tile], op.name))

        return Costs(compute_ms=compute, comm_ms=comm,
                     comm_alpha_ms={kind: alpha for kind, (alpha, _) in self.model.comm.items()},
                     interference=self.model.interference, num_streams=num_streams,
                     launch_ms=self.model.launch_ms, bytes=nbytes, frees=frees, base_bytes=base,
                     bucket_copy_ms=pack)

    def timelines(self, programs, k: int, regather: bool, buckets_fwd: tuple, buckets_bwd: tuple,
                  training: bool) -> Dict[str, Timeline]:
        """The simulated forward (and, when ``training``, backward) timeline of one plan, as the
        planner scored it (one compute stream)."""
        bounds = tile_bounds(self.rows, k)
        fwd_prog, bwd_prog = programs(k, training, regather)
        keep_xg = training and self.sp and not regather
        out = {"forward": simulate(round_robin(fwd_prog, k, buckets=dict(buckets_fwd)),
                                   self.costs(fwd_prog, bounds, num_streams=1, save=training, keep_xg=keep_xg,
                                              backward=False))}
        if training:
            out["backward"] = simulate(round_robin(bwd_prog, k, buckets=dict(buckets_bwd)),
                                       self.costs(bwd_prog, bounds, num_streams=1, save=True, keep_xg=keep_xg,
                                                  backward=True))
        return out

    def row_counts(self, tile_choices=TILE_CHOICES) -> Set[int]:
        """The gathered rows of every tile and rank piece the candidates cost."""
        tiles = {self.gathered(b - a) for k in tile_choices for a, b in tile_bounds(self.rows, k)}
        return tiles | set(self.piece_rows())

    def gemm_shapes(self, tile_choices=TILE_CHOICES) -> Set[Tuple[int, int, int]]:
        return {s for m in self.row_counts(tile_choices) for s in self.gemms(m)}

    # ----------------------------------------------------------------- rank chunks ([Note: rank-chunk cost])
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
