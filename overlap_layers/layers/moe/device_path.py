"""Which calls of an :class:`~overlap_layers.layers.moe.layer.OverlapMoE` run the device path
([Note: MoE graph calls] in ``layers/moe/device.py``) and how: the race that picks it per
signature, the rows its buffers hold, its exchanges, and the call itself (:class:`DevicePath`,
the layer's component).

Reference: a call takes the device path only where ``config.graph_calls`` is set, the call has
no aux loss, every rank has symmetric memory and grouped GEMMs take the operands, and the race
has picked it for the call's signature or is timing it; its result is the eager call's
(``layers/moe/device.py``), or, where a count overflowed its slots, it is dropped and the call
made again with larger slots ([Note: MoE slot rows]).

[Note: MoE graph calls: the race]
At the first calls of a signature whose plan is settled, the layer times both: ``ROUNDS + 1``
eager calls, then ``ROUNDS + 1`` calls of the device path (the first captures), each from an event
recorded before its first launch to one after its output (the eager call's host syncs and
launches included: its GPU idles while the host launches), the first of each not counted. No
call waits for its events (a wait would leave the GPU idle at the next call's start, which the
eager call's launches would then pay and a replay would not); the last one's read waits. The
group's slowest rank's best time of each (one host gather, at the same call on every rank) picks
the path for every later call of the signature; a graph that lost is dropped. With many small
experts (qwen3-30b-a3b) the device path wins the forward; with few large ones (mixtral-8x7b) the
eager call does. A training
call is timed to the end of its backward (hooks on the parameters' gradients, removed when they
have fired, or at the layer's next call if its backward never came): the eager backward's host
time is what the device path saves there. The device path wins only if it is also within the
layer's ``memory_budget`` (when one is set): the largest rank's graph memory must fit it; and
only if its deciding call replayed a graph (where a capture failed, its calls ran eagerly, and
such a race could be won by noise with no graph kept). Once it wins, the
layer lets go of the symmetric workspace of its eager copy-engine calls (the group's "exchange"
workspace, for qwen3-30b-a3b at EP 4 256 MiB): freed where no other layer of the group holds it,
and grown again, a collective at the same call on every rank, by the next eager call that needs
it (a rank that kept it alive longer makes every rank release theirs first:
``RankChunkPlans._after_agreement``).

[Note: MoE slot rows]
A graph's buffers have fixed sizes, and a source may send a rank every row it has (``rows``,
:func:`~.ranks.rows_bound`): with every part's buffers at that bound, qwen3-30b-a3b's training graphs
would keep about four times what an even routing fills. So the
buffers hold ``slot`` rows (:func:`slot_rows`: the largest count of rows one rank sent another at
an earlier call of the signature, and 1/8 more; at first an even routing's count, ``rows / ws``;
never fewer than the exchange's largest region), and a count past them is found after the call:

* the call clamps each source's grouped-GEMM offsets to the slot (the copies already stop at
  their buffers' ends: ``copy_rows_by_table``), so no kernel reads or writes past a buffer;
* right after the exchange's counts it copies the largest count of its table (which every rank
  holds whole: the same on every rank) into pinned host memory and records an event (``external``,
  so that a replay records it too: :func:`~overlap_layers.runtime.streams.peak_event`);
* where the slots hold fewer than ``rows``, the layer waits for that event after the call is
  launched (the first few hundred microseconds of it: the device path's only wait) and reads the
  count; past the slots, the result is dropped, the signature's slots raised to that count, its
  graph dropped, and the call made again (captured anew: every rank alike, from the same count).
  The slots only grow, by more than 1/8 each time, and never past ``rows``, where nothing is read.

A result past its slots is never returned: the count that decides is exact, and the call that
returns ran with slots that hold it. The backward reuses the forward's offsets and slots.

The count is read right after the count exchange, not at the end of the forward: waiting for the
whole forward would keep the host from running ahead to launch the backward. Measured (memory
and time against buffers at the bound): see docs/measurements.md (MoE, slot rows).
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from ...kernels import triton_gate
from ...runtime.device_all_to_all import DeviceCountAllToAll, region_caps
from ...runtime.symmetric import shared_workspace
from ...runtime.streams import peak_event
from ...runtime.timing import EventClock
from .device import experts_by_source
from .ranks import rows_bound

ROUNDS = 2  # timed calls of each path in the race
MAX_SIGNATURES = 64  # races kept per layer
SLOT_STEPS = 64  # [Note: MoE slot rows]: slot sizes are multiples of rows / SLOT_STEPS
SLOT_HEADROOM = 8  # ... of at least the peak and 1/8 more


class DevicePathRace:
    """[Note: MoE graph calls: the race]: per signature, whether its calls run the device path.
    :meth:`choose` at a call says which path it runs (and starts timing it while racing),
    :meth:`finish` after the call stops the timing and, after the last timed call, decides."""

    def __init__(self, agreement, clock=EventClock) -> None:
        self._agreement = agreement
        self._clock = clock
        self._races: dict = {}  # signature -> {"eager": [span], "device": [span], "choice": None | bool}
        self._timing = None  # (the race, its list, the clock's start) of the call being timed

    @property
    def timing(self) -> bool:
        """Whether a call is being timed (:meth:`finish` not yet called for it)."""
        return self._timing is not None

    def choose(self, signature) -> bool:
        race = self._races.get(signature)
        if race is None:
            if len(self._races) >= MAX_SIGNATURES:  # the oldest is raced again if it comes back
                self._races.pop(next(iter(self._races)))
            race = self._races[signature] = {"eager": [], "device": [], "choice": None}
        if race["choice"] is not None:
            return race["choice"]
        device = len(race["eager"]) > ROUNDS
        self._timing = (race, race["device" if device else "eager"], self._clock.start())
        return device

    def finish(self, nbytes: int = 0, budget: Optional[Callable[[], Optional[int]]] = None) -> Optional[bool]:
        """End the timing of the call (if timed; its graph kept ``nbytes``, 0 where the call ran
        eagerly); returns the choice made at it, if any (the device path lost: False), else None.
        The device path wins only if its deciding call replayed a graph on every rank, it is
        faster and, where ``budget()`` gives bytes (the layer's memory budget), its graph's memory
        on the group's largest rank fits them."""
        if self._timing is None:
            return None
        race, spans, start = self._timing
        self._timing = None
        spans.append(self._clock.stop(start))
        if len(race["device"]) <= ROUNDS:
            return None
        mine = tuple(round(min(self._clock.read(s) for s in race[path][1:]) * 1e3) for path in ("eager", "device"))
        rows = self._agreement.gather((*mine, int(nbytes)))
        eager_us, device_us, most = (max(r[i] for r in rows) for i in range(3))
        limit = budget() if budget is not None else None
        replayed = min(r[2] for r in rows) > 0  # else its capture failed, and it timed eager calls
        race["choice"] = replayed and device_us < eager_us and (limit is None or most <= limit)
        return race["choice"]


def slot_rows(rows: int, least: int, peak: int) -> int:
    """[Note: MoE slot rows]: the rows of each part's buffers for calls whose largest count of
    rows one rank sends another is ``peak``: that and 1/``SLOT_HEADROOM`` more, rounded up to a
    multiple of ``rows / SLOT_STEPS``, at least ``least`` (the exchange's largest region, which a
    pull copies whole) and at most ``rows`` (the bound of every count)."""
    if not 0 <= least <= rows or peak < 0:
        raise ValueError(f"slot_rows(rows={rows}, least={least}, peak={peak}); valid: 0 <= least <= rows, peak >= 0")
    unit = max(1, rows // SLOT_STEPS)
    want = peak + peak // SLOT_HEADROOM
    return min(rows, max(least, -(-want // unit) * unit))


class DevicePath:
    """An ``OverlapMoE``'s device path: ``race`` (:class:`DevicePathRace`), ``needs`` (per race
    signature, the largest count the slots must hold; none: an even routing's), ``call`` (the
    device-path call being made: its signature, slot rows and send rows), ``peak`` (the host
    tensor its calls copy their peak count into, and the event they record after it),
    ``group_shapes`` (every rank's (batch, seq) in the current call: the graphs' signature),
    ``workspace`` (the group's "device_counts" workspace, once the path runs), ``exchanges``."""

    def __init__(self, layer) -> None:
        self._layer = weakref.ref(layer)  # the layer owns this
        self.workspace = None
        self.exchanges: dict = {}  # (rows, hidden, dtype) -> DeviceCountAllToAll
        self.race = DevicePathRace(layer.planner.agreement)
        self.needs: dict = {}
        self.call: Optional[tuple] = None
        self.peak: Optional[tuple] = None
        self.group_shapes: tuple = ()
        self.race_hooks = (None, 0, [])  # a timed training call's gradient hooks (its key, graph bytes, handles)

    @property
    def layer(self):
        return self._layer()

    def graphed_run(self, run, shape: tuple, dtype: torch.dtype, save: bool):
        """The layer's ``_graphed_run``: a call without aux loss, where every rank has symmetric
        memory and the grouped GEMM takes the operands, captures :meth:`run` (with autograd:
        [Note: MoE training graphs]) where the race has picked it or is timing it; any other call
        runs eagerly (None)."""
        layer = self.layer
        if layer.aux_loss_coef > 0 or layer._weight.device.type != "cuda" or triton_gate.triton is None \
                or not layer._grouped_for(dtype) or not layer._copy_engine_available():
            return None
        signature = (self.group_shapes, dtype, save)
        if not self.race.choose(signature):
            return None
        rows = rows_bound(shape[1], layer.top_k)
        need = self.needs.get(signature, rows // layer.world_size)  # at first: an even routing's count
        slot = self.slot(rows, need)
        self.call = (signature, slot, rows)
        if self.peak is not None:
            self.peak[0].zero_()  # a call that does not reach the device path reads 0 (no copy in flight)
        return lambda plan, trial, trace, x: self.run(x, shape[1], slot)

    def signature(self) -> tuple:
        """The layer's ``_graph_signature``: ranks with other token counts capture alike ([Note: MoE
        graph calls]); the slot rows ([Note: MoE slot rows])."""
        return self.group_shapes, self.call[1] if self.call is not None else None

    def overflowed(self) -> bool:
        """[Note: MoE slot rows]: whether the call just made by the device path had a count past
        its slots (its result is not the reference; the same on every rank: the peak is read from
        the table every rank holds), which raises its signature's need to that count and drops its
        graph. Reads the peak on the host only where the slots hold fewer than the bound of rows."""
        call, self.call = self.call, None
        if call is None:
            return False
        signature, slot, rows = call
        if slot >= rows:
            return False
        layer = self.layer
        peak, event = self.peak
        if event is not None:
            event.synchronize()  # the call's exchange has its counts: the host waits for that much of it
        elif layer._weight.device.type == "cuda":  # no event a graph records: the whole call
            torch.cuda.current_stream(layer._weight.device).synchronize()
        peak = int(peak)
        if peak <= slot:
            return False
        self.needs[signature] = peak
        if layer.planner.call_graphs is not None:
            layer.planner.call_graphs.forget_last()
        return True

    def slot(self, rows: int, need: int) -> int:
        """[Note: MoE slot rows]: the slot rows of a call with ``rows`` send rows whose slots must
        hold ``need`` (at least the exchange's largest region)."""
        layer = self.layer
        return slot_rows(rows, max(region_caps(layer.world_size, rows, layer.num_local_experts).values(), default=0),
                         need)

    def exchange(self, rows: int, dtype: torch.dtype, device: torch.device) -> DeviceCountAllToAll:
        """The exchange for ``rows`` send rows of ``dtype`` (made outside a capture: the graph's
        first run makes it), made anew when its workspace grew since."""
        layer = self.layer
        if self.workspace is None:
            self.workspace = shared_workspace(layer.group, device, "device_counts")
        key = (rows, layer.hidden_size, dtype)
        ex = self.exchanges.get(key)
        if ex is None or ex._handle is not self.workspace.handle:
            if len(self.exchanges) >= 8:
                self.exchanges.clear()
            ex = self.exchanges[key] = DeviceCountAllToAll(self.workspace, rows, layer.hidden_size, dtype,
                                                           groups=layer.num_local_experts)
        return ex

    def run(self, x: torch.Tensor, max_tokens: int, slot: Optional[int] = None) -> torch.Tensor:
        """One call by :func:`~.device.experts_by_source` ([Note: MoE graph calls]);
        ``max_tokens``: the group's largest token count this call; ``slot``: the rows of each part's
        buffers (:meth:`slot`, [Note: MoE slot rows]; None: the bound of rows), with fewer than the
        bound its peak count written into ``peak``."""
        layer = self.layer
        B, S, H = x.shape
        x, (w_in, w_out) = layer._call_tensors(x, ("w_in", "w_out"))
        x_TH = x.reshape(B * S, H)
        with torch.autocast(x.device.type, enabled=False):
            exchange = self.exchange(rows_bound(max_tokens, layer.top_k), x_TH.dtype, x.device)
            if slot is not None and self.peak is None:  # made by a first call, outside a capture
                cuda = x.device.type == "cuda"
                self.peak = (torch.zeros((), dtype=torch.int32, pin_memory=cuda), peak_event() if cuda else None)
            # the weights' gradients wait for no replay's copy where they reach the parameters as they are
            graphs = layer.planner.call_graphs
            defer = graphs.defer if graphs is not None and w_in is layer.w_in and w_out is layer.w_out else None
            y = experts_by_source(layer, x_TH, w_in, w_out, exchange, lambda: layer._shared_expert(x_TH), slot,
                                  self.peak if slot is not None and slot < exchange.rows else None, defer)
        return y.view(B, S, H)

    # ----------------------------------------------------------------- the race's timing of a call
    def begin_call(self) -> None:
        """Before a layer call: an earlier call's backward that never came ends its timing here."""
        self.end_race_hooks()
        self.call = None

    def end_call(self, x: torch.Tensor, save: bool) -> None:
        """After a layer call's forward: a training call is timed to the end of its backward (hooks
        on the gradients, [Note: MoE graph calls: the race]), any other call's timing ends here."""
        layer = self.layer
        graphs = layer.planner.call_graphs
        watched = ([p for p in layer.parameters() if p.requires_grad] or ([x] if x.requires_grad else [])) \
            if save and self.race.timing else []  # listed only while a call is timed
        if not watched:
            self.race_done(None, graphs.last_nbytes if graphs is not None else 0)
            return
        left = [len(watched)]

        def done(*_) -> None:  # as each gradient is made; the last ends the timing
            left[0] -= 1
            if not left[0]:
                self.end_race_hooks()
        self.race_hooks = (graphs.last_key, graphs.last_nbytes, [
            t.register_post_accumulate_grad_hook(done) if t.is_leaf else t.register_hook(done) for t in watched])

    def race_done(self, key, nbytes: int) -> None:
        """End the race's timing of a call (whose graph kept ``nbytes``); drop its signature's graph
        (``key``; None: the last call's) if the device path lost, else, if it won, the layer's hold
        on the eager calls' symmetric workspace ([Note: MoE graph calls: the race])."""
        layer = self.layer
        choice = self.race.finish(nbytes, layer.planner.maker.budget)
        if choice is False:
            layer.planner.call_graphs.forget_last(key)
        elif choice:
            layer._workspace = None  # RankChunkPlans' hold, grown again by the next eager call that needs it

    def end_race_hooks(self) -> None:
        """Where a timed training call's gradient hooks are still set: remove them (a hook on the
        parameters would outlive the backward it waits for) and end that call's timing."""
        key, nbytes, hooks = self.race_hooks
        if hooks:
            for h in hooks:
                h.remove()
            self.race_hooks = (None, 0, [])
            self.race_done(key, nbytes)
