"""Planning, checking and running the rank-chunk decomposition, for the layers that have one
(``OverlapMLP``, ``OverlapAttention``: sequence parallel, split by source rank; ``OverlapMoE``:
its expert exchange split by source rank, ``layers/moe/ranks.py``).

Reference: a mixin implementing these hooks of :class:`~overlap_layers.planning.layer_spec.TiledLayer`
for the layers that have rank chunks: ``_check_pin``, ``_floor``, ``_after_agreement``,
``_graph_stage``, ``_predicted_timelines`` and ``_rank_candidates``; listed before ``TiledLayer``
among the layer's bases. What it decides is identical on every rank by construction: whether the
copy engine is usable comes from the call's agreement (:meth:`RankChunkPlans._floor`: the minimum
over the ranks of "usable here", whether every rank is on one host, and whether every rank holds
the same symmetric workspace); candidates come from the layer's cost model ([Note: rank-chunk
cost]). A layer mixing it in picks its autograd Function with :meth:`_function`, and its cost
model provides ``rank_pieces``.
"""
from __future__ import annotations

import socket
import warnings
import zlib
from dataclasses import replace
from functools import partial

import torch

from ..config import Decomposition, Transport
from ..runtime.copy_engine_exchange import CopyEngineExchange
from ..runtime.p2p_exchange import PointToPointExchange
from ..runtime.symmetric import held_workspace_bytes, shared_workspace, staged_source, symmetric_memory_status
from ..sim import Candidate


class RankChunkPlans:
    """Mixin: the rank-chunk plan's checks, transports, exchanges, candidates and timelines."""

    _has_copy_engine = True
    _rank_tiles = False  # whether rank chunks run inside batch tiles (the attention's)
    _planned_send_recv = False  # whether the planner offers rank chunks over send/recv (the MoE's)
    _copy_engine = None  # "" or why this rank cannot use the copy engine (asked once)
    _warned_copy_engine = False
    _host_id = 0  # crc32 of this host's name, learnt with _copy_engine
    _workspace = None  # the group's SymmetricWorkspace, once a copy-engine plan runs or is measured
    _workspace_purposes = ("exchange",)  # the shared_workspace purposes the layer's exchanges use
    # the exchange classes of a rank-chunk call, copy engine and send/recv (the MoE's: all-to-alls)
    _exchanges = (CopyEngineExchange, PointToPointExchange)

    @property
    def _source_split(self) -> bool:
        """Whether this layer's rows can be split by source rank (the MLP's and attention's: with
        sequence parallelism)."""
        return self.sequence_parallel

    def _check_pin(self, plan) -> None:
        if plan.decomposition not in (Decomposition.BATCH, Decomposition.RANK):
            raise ValueError(f"plan.decomposition={plan.decomposition!r}; valid: 'batch', 'rank'")
        if plan.transport not in (Transport.NCCL, Transport.COPY_ENGINE):
            raise ValueError(f"plan.transport={plan.transport!r}; valid: 'nccl', 'copy_engine'")
        if plan.decomposition == Decomposition.RANK and not self._source_split:
            raise ValueError("plan.decomposition='rank' needs sequence_parallel=True (it splits the gathered "
                             "rows by source rank)")
        if plan.transport == Transport.COPY_ENGINE and plan.decomposition != Decomposition.RANK:
            raise ValueError("plan.transport='copy_engine' needs plan.decomposition='rank'")
        if plan.decomposition == Decomposition.RANK and plan.num_tiles > 1 and not self._rank_tiles:
            raise ValueError(f"plan.num_tiles={plan.num_tiles} with plan.decomposition='rank': "
                             f"{type(self).__name__} runs rank chunks on all rows at once here (num_tiles=1); "
                             "batch tiles of rank chunks are the attention's")

    def _floor(self) -> tuple:
        """(copy engine usable here, host id, -host id, then per workspace purpose of the layer
        the bytes held and their negation): the agreed minimum of the first says whether every
        rank can use it, the next two whether all ranks share one host, each pair after them
        whether all hold the same workspace of that purpose."""
        if self.world_size == 1:  # nothing to exchange: no transport, host or workspace to agree on
            return (0, 0, 0, *(0, 0) * len(self._workspace_purposes))
        ok = self._copy_engine_here()  # asks once, and learns the host with it
        held = [held_workspace_bytes(self.group, self._weight.device, p) for p in self._workspace_purposes]
        return (ok, self._host_id, -self._host_id, *(v for h in held for v in (h, -h)))

    def _after_agreement(self, floor: tuple, capturing: bool) -> None:
        """Ranks holding different symmetric workspaces of a purpose (some kept the workspace of
        freed layers alive longer than others) all release theirs here, so that the next exchange
        grows it on every rank alike; decided from agreed values only."""
        for i, purpose in enumerate(self._workspace_purposes):
            if floor[3 + 2 * i] == -floor[4 + 2 * i]:
                continue
            if capturing:
                raise RuntimeError("the ranks hold different symmetric workspaces (layers freed on some ranks only); "
                                   "releasing them synchronises, which CUDA-graph capture forbids: run one eager "
                                   "call before capturing")
            shared_workspace(self.group, self._weight.device, purpose).release()

    def _copy_engine_here(self) -> int:
        """1 if this rank could use the copy-engine transport (asked once; the call's agreement
        takes the minimum over the ranks), else 0."""
        if self._copy_engine is None:
            self._copy_engine = "" if self.config.transport == Transport.NCCL else \
                symmetric_memory_status(self.group, self._weight.device)
            self._host_id = zlib.crc32(socket.gethostname().encode())
        return int(self._copy_engine == "")

    def _copy_engine_available(self, asked: bool = False) -> bool:
        """Whether every rank can use the copy-engine transport (from this call's agreement).
        Warns once with the reason when not, on CUDA or when it was asked for (``config.transport``,
        or a pinned plan: ``asked``)."""
        floor = self.planner.agreed_floor
        one_host = bool(floor) and floor[1] == -floor[2]
        ok = self.config.transport != Transport.NCCL and bool(floor) and bool(floor[0]) and one_host
        if not ok and not self._warned_copy_engine and (asked or self.config.transport != Transport.NCCL and (
                self.config.transport == Transport.COPY_ENGINE or self._weight.device.type == "cuda")):
            self._warned_copy_engine = True
            why = ("config.transport='nccl'" if self.config.transport == Transport.NCCL else self._copy_engine
                   or ("the group spans several hosts" if not one_host else "on another rank"))
            warnings.warn(f"overlap_layers: copy-engine transport unavailable ({why}); using NCCL", stacklevel=2)
        return ok

    def _rank_transports(self) -> tuple:
        """The transports the planner tries for rank chunks (none without SP or with one rank):
        the copy engine where every rank has it (not with ``config.transport="nccl"``), else
        NCCL send/recv where ``_planned_send_recv``. The MLP's and attention's rank chunks over
        send/recv run only when pinned: their batch tiles' all-gathers and reduce-scatters are
        NCCL's ring kernels, faster than its send/recv (rank chunks over send/recv do not beat
        batch tiles or K=1 over NVLink, nor batch tiles for the attention with P2P disabled:
        docs/measurements.md, MLP and Attention). The MoE's all-to-all is send/recv in
        NCCL, so its rank chunks move the same bytes the same way as its batch tiles."""
        if not self._source_split or self.world_size < 2:
            return ()
        if self.config.transport != Transport.NCCL and self._copy_engine_available():
            return (Transport.COPY_ENGINE,)
        return (Transport.NCCL,) if self._planned_send_recv else ()

    def _function(self, plan, call, device: torch.device, tiled, ranked):
        """The autograd Function that runs ``plan``: ``tiled`` for batch tiles, else ``ranked``,
        with ``call.plan`` and ``call.exchange`` set by :meth:`_rank_run`."""
        if plan.decomposition != Decomposition.RANK:
            return tiled
        call.plan, call.exchange = self._rank_run(plan, device)
        return ranked

    def _rank_run(self, plan, device: torch.device):
        """``(plan, exchange factory)`` of a rank-chunk call: a copy-engine plan where the copy
        engine is unavailable runs (and shows in ``self.plan``) over send/recv instead. The
        factory takes ``(sources, partial_shape, keep, recorder)``."""
        if plan.transport == Transport.COPY_ENGINE and self._copy_engine_available(asked=True):
            if self._workspace is None:
                self._workspace = shared_workspace(self.group, device)
            return plan, partial(self._exchanges[0], self._workspace)
        if plan.transport != Transport.NCCL:
            plan = self.planner.plan = replace(plan, transport=Transport.NCCL)
        return plan, partial(self._exchanges[1], self.group)

    def _graph_stage(self, plan, t: torch.Tensor, role: str):
        """A copy-engine rank-chunk call's input, or its output gradient, in the place of the
        first source of the pass's exchange ([Note: staged input] in ``planning/call_graphs.py``): the
        MLP's and attention's forward exchange starts from the input, their backward's from the
        output gradient; a training call's input only where its backward reads the saved own
        rows instead (:meth:`_backward_reads_input`). Where the call copies no other tensor of
        ``t``'s dtype (no autocast cast) and the workspace is large enough; else None."""
        if plan.decomposition != Decomposition.RANK or plan.transport != Transport.COPY_ENGINE \
                or self._workspace is None or t.dtype != self._weight.dtype \
                or torch.is_autocast_enabled(t.device.type) \
                or role == "training_input" and self._backward_reads_input(plan):
            return None
        return staged_source(self._workspace, t)

    def _backward_reads_input(self, plan) -> bool:
        """Whether a rank-chunk training call's backward reads its input tensor (re-gathered, or
        per piece), rather than the own rows it kept in the gathered buffer."""
        return True

    def _predicted_timelines(self, cm, plan, save: bool) -> dict:
        if plan.decomposition != Decomposition.RANK:
            return super()._predicted_timelines(cm, plan, save)
        k = plan.num_tiles
        out = {"forward": cm.rank_chunk_timeline(backward=False, transport=plan.transport, sources=1, tiles=k)}
        if save:
            out["backward"] = cm.rank_chunk_timeline(backward=True, transport=plan.transport,
                                                     sources=2 if plan.regather else 1, tiles=k)
        return out

    def _copy_engine_setups(self, cm) -> dict:
        """Timed ops of the copy-engine cost, when the planner will use it: a peer copy of one
        chunk, a signal round trip."""
        if Transport.COPY_ENGINE not in self._rank_transports():
            return {}
        dev = self._weight.device
        ws_obj = self._workspace = self._workspace or shared_workspace(self.group, dev)
        peer = (self.rank + 1) % self.world_size
        nbytes = cm.chunk_bytes()

        def copy():
            ws_obj.reserve(nbytes)
            src = ws_obj.view(peer, (nbytes,), torch.uint8, 0)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            return lambda: dst.copy_(src)

        def signal():
            ws_obj.reserve(1)
            send_to, recv_from = (self.rank - 1) % self.world_size, peer

            def round_trip():
                ws_obj.handle.put_signal(send_to, 0)
                ws_obj.handle.wait_signal(recv_from, 0)
            return round_trip

        return {f"peer_copy:{nbytes}": copy, "signal": signal}

    def _rank_candidates(self, cm, batch: list, *, training: bool) -> list:
        """One candidate per transport and backward strategy ([Note: rank-chunk cost])."""
        out = []
        for transport in self._rank_transports():
            for regather in ((False, True) if training else (False,)):
                base = next((c for c in batch if c.num_tiles == 1 and c.regather == regather
                             and not c.buckets_fwd and not c.buckets_bwd), None)
                if base is None:
                    continue
                peak = cm.rank_chunk_peak(base.peak_bytes, cm.rank_slot_bytes(transport, 2 if regather else 1))
                for k in cm.rank_tiles():
                    ms, exposed = cm.rank_chunk_ms(backward=False, transport=transport, sources=1, tiles=k)
                    if training:
                        b_ms, b_exposed = cm.rank_chunk_ms(backward=True, transport=transport,
                                                           sources=2 if regather else 1, tiles=k)
                        ms, exposed = ms + b_ms, exposed + b_exposed
                    out.append(Candidate(k, regather, (), (), ms, exposed, peak, decomposition=Decomposition.RANK,
                                         transport=transport))
        return out
