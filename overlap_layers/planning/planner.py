"""A layer's planner: the object every planned layer creates at the end of its constructor
(``TiledLayer._init_planner``: ``self.planner = LayerPlanner(self, config)``) and asks, at each
call, to agree with the other ranks, to pick the plan and to run the call under it.

Reference: for a layer ``L`` (a :class:`~overlap_layers.planning.layer_spec.TiledLayer`, whose
hooks the planner calls) with ``num_tiles="auto"``, each call runs the plan the planner's
:class:`~overlap_layers.planning.plan_cache.PlanCache` holds for the call's plan key (the layer's
shape bucket, dtype and grad mode): made at the first call for the key by the
:class:`~overlap_layers.planning.plan_maker.PlanMaker` (calibrate, measure, simulate every
candidate, choose under the memory budget), then verified on the first calls ([Note: first-call
verification]). A pinned plan or a fixed K runs as it is. A call is::

    agreed = L.planner.agree(x, err, errors, what)      # one host gather; equal on every rank
    y = L.planner.call(x, agreed, run)                  # run(plan, trial, trace, *inputs)

where ``run`` is the layer's own pass under a plan. Everything the planner decides depends only
on agreed values and the call history, so every rank takes the same branch.

[Note: CUDA graphs]
A call can be captured into a CUDA graph (``torch.cuda.graph``, ``make_graphed_callables``,
a whole training step) once its plan exists: its GEMMs, NCCL collectives, copy-engine copies
and signal kernels are stream work, and its host work (agreement gather, plan lookup) runs at
capture only. Capturing is a column of the call's agreement (every rank captures or the call
raises ValueError on every rank). A captured call neither plans nor times
(:class:`~overlap_layers.planning.plan_cache.PlanCache`): a shape with no plan raises
RuntimeError, pending verification pauses until the next eager calls, and the graph keeps the
plan it captured. The copy-engine workspace keeps every buffer a graph captured
(``runtime/symmetric.py``). ``OverlapMoE``'s calls cannot be captured by the caller: they read
their all-to-all sizes on the host (with ``config.graph_calls`` its calls without aux loss
capture a path that does not: [Note: MoE graph calls] in ``layers/moe/device.py``). Replays launch
no Python, so a plan whose eager calls are host-bound runs at its device time;
``config.cuda_graphs`` makes verification compare contenders that way, and
``config.graph_calls`` has the layer capture and replay its own calls ([Note: graph calls] in
``planning/call_graphs.py``).

[Note: direct calls]
A decoding step calls each layer with a handful of new tokens and no autograd. Such a call runs
the serial plan as plain torch ops ([Note: plain serial calls] in ``layers/common/plain_tp.py``)
and asks the planner for nothing: no plan key, no plan-cache lookup, no verification trial. It is
a *direct call* (:meth:`LayerPlanner.direct_key`) when grad mode is off, ``x`` (or a DTensor
``x``'s local tensor) is a ``torch.Tensor`` ``[batch, seq, hidden]`` of at most :data:`DIRECT_ROWS`
rows (batch * seq), autocast is off on its device, it is not being captured into a CUDA graph,
and the layer plans automatically (``num_tiles="auto"``, no pinned plan) with neither
``config.check_inputs`` nor ``config.graph_calls``, nor a pending ``export_trace(measured=True)``
or ``launch_log``; an attention's planned call only without a mask (a causal mask's values are
checked at every call), its ``attend`` under any. All of these are the same on every rank once a
call's agreement has passed, or are columns of its row.

Why the serial plan: at so few rows a projection is bound by reading its weights (a GEMM of M
rows does about M flops per weight byte in bf16, below every GPU's ridge point of 150-300), and K
tiles read the weights K times to hide a collective of ``rows * hidden`` elements: overlap cannot
pay. Agreement: the first direct call of a signature (:meth:`direct_key`: the input's shape, dtype
and device and the layer's other call arguments' forms) makes the layer's full agreement, its
input checks and gather included; later calls whose signature equals the last agreed one skip it
and the checks (:meth:`direct_known`). This is [Note: agreement once per call signature] in
``planning/call_agreement.py`` with a key that costs less to make: every other column of the row
is fixed by the conditions above, so two calls of one signature have one row, and the same
induction holds (a rank whose input changed while its peers' did not waits in the gather).
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
import zlib
from dataclasses import replace
from typing import Callable, Mapping, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor

from ..config import OverlapConfig, Transport, check_num_tiles, check_positive_int
from ..runtime import StreamPool, shared_agreement
from ..runtime.timing import rank_barrier
from ..sim import analytic_model
from .call_agreement import DTYPES, Agreed, agree, floor_of
from .call_graphs import CallGraphs
from .calls import capturing_graph, in_backward_pass, saved_tensor_hooks_active
from .compiled import register_layer
from .plan import TilePlan, contenders, explain
from .plan_cache import PlanCache
from .plan_maker import PlanMaker
from .recompute import RecomputePlans
from .tiling import effective_num_tiles
from .trace import TraceJob, write_chrome_trace

PLAN_CACHE_SIZE = 32  # plan keys per layer (LRU)
# How far ahead of the device a verification trial queues each pass with config.cuda_graphs: above the
# host time of one pass of any capturable layer here (at most about 6 ms at TP 4 on H200, the bench's
# ``host`` column: docs/measurements.md, CUDA graphs), and short, since every timed pass of every layer
# waits this long once (about 18 passes per layer and shape).
PREQUEUE_MS = 10.0
#: The most rows (batch * seq on this rank) of a direct call ([Note: direct calls]).
DIRECT_ROWS = 64
#: What a direct call runs ([Note: direct calls]).
DIRECT_PLAN = TilePlan(1, num_streams=1, reason=f"direct call: no grad, at most {DIRECT_ROWS} rows "
                                                   f"([Note: direct calls] in planning/planner.py)")


class LayerPlanner:
    """The planning, agreement and call machinery of one layer (module docstring).

    State: ``agreement`` (the group's host gather), ``streams`` (the layer's compute streams),
    ``plans`` (the plan cache), ``maker`` (its :class:`PlanMaker`: hardware numbers, budget),
    ``call_graphs`` (with ``config.graph_calls``, else None), ``pinned``, ``plan`` (the last
    call's), ``agreed_floor`` and ``capturing`` (from the last agreement), ``recompute``
    ([Note: recompute]), ``compiled_graphs`` ([Note: compiled calls]), ``index``, ``name`` and
    ``calls`` (what :meth:`describe` says), ``checks_inputs`` and ``config_digest``
    (``planning/cross_checks.py``)."""

    def __init__(self, layer, config: OverlapConfig, *, pinned: Optional[TilePlan] = None,
                 warn: bool = True) -> None:
        if warn and config.transport == Transport.COPY_ENGINE and not layer._has_copy_engine:
            warnings.warn(f"{type(layer).__name__} has no copy-engine path; config.transport='copy_engine' "
                          f"runs NCCL here", stacklevel=3)
        self._layer = weakref.ref(layer)  # the layer owns its planner: no reference cycle
        self.agreement = shared_agreement(layer.group)
        self.index = self.agreement.new_layer()  # among the group's layers made on this rank
        self.name: Optional[str] = None  # the layer's module name, where known (save_plans, load_plans)
        self.calls = 0  # the layer's calls so far (agreements asked)
        self.config_digest: Optional[tuple] = None  # (config table, its digest) last computed (TiledLayer)
        # config.check_inputs: every call gathers ([Note: input checks] in planning/cross_checks.py)
        self.checks_inputs = config.check_inputs and layer.world_size > 1
        self.streams = StreamPool()
        self.compiled_key = register_layer(layer)  # [Note: compiled calls]
        self.compiled_graphs: dict = {}  # token -> (output, leaves) of a compiled call awaiting backward
        replayed = config.cuda_graphs or config.graph_calls
        me = weakref.ref(self)  # the plan cache's gathers describe the layer: no reference cycle either
        self.plans = PlanCache(self.agreement, size=PLAN_CACHE_SIZE, verify=config.verify_first_calls,
                               margin=config.margin, prequeue_ms=PREQUEUE_MS if replayed else 0.0,
                               align=rank_barrier(layer.group) if replayed else None, who=lambda: me().describe())
        self.call_graphs = CallGraphs(self.agreement) if config.graph_calls and layer._graphable else None
        self.maker = PlanMaker(layer, self.agreement)
        self.recompute = RecomputePlans()
        self.pinned = pinned
        self.plan: Optional[TilePlan] = None  # the last call's
        self.last_call: Optional[tuple] = None  # (plan key, tile units) of the last call
        self.trace_to = None  # export_trace(path, measured=True) waiting for the next call
        self.agreed_floor: tuple = ()  # the minimum over the ranks of the layer's floor, last agreed
        self.capturing = False  # whether the current call is being captured into a CUDA graph (agreed)
        self.dtensor_input = False  # True while a call runs on a DTensor input's local tensor
        self._agreed_call: Optional[tuple] = None  # (row, Agreed) of the last agreed call
        self._fixed: Optional[TilePlan] = None  # the last fixed K's plan (a call reuses it)
        self._steady: Optional[tuple] = None  # (Agreed, plan) of a settled eager call: call()'s shortcut
        self._direct_agreed: Optional[tuple] = None  # the signature of the last agreed direct call

    @property
    def layer(self):
        return self._layer()

    def describe(self) -> str:
        """The layer and its call, as the agreement's errors name them: its class, its module name
        where known, its index among the group's layers made on this rank, and the call count."""
        name = f" {self.name!r}" if self.name else ""
        return f"{type(self.layer).__name__}{name} (layer {self.index} of its group on this rank), call {self.calls}"

    # ----------------------------------------------------------------- one call
    def agree(self, x, err: int, errors: Mapping[int, str], what: str, *, extra: Sequence[int] = (),
              extra_names: Sequence[str] = (), shape_names=("batch", "seq", "hidden"),
              replicated: Sequence[Tuple[str, Optional[torch.Tensor]]] = ()) -> Agreed:
        """The call's agreement (:func:`~overlap_layers.planning.call_agreement.agree`, which runs the
        layer's ``_after_agreement`` where it agreed anew): equal on every rank, or the same
        ValueError on every rank. ``replicated``: the inputs every rank must hold equal, by name
        (None where absent; the same names at every call), compared with ``config.check_inputs``."""
        return agree(self.layer, self, x, err, errors, what, extra=extra, extra_names=extra_names,
                     shape_names=shape_names, replicated=replicated)

    def known_agreement(self, row: tuple) -> Optional[Agreed]:
        """The last agreed call's :class:`Agreed` if its row was ``row`` and the last call ran
        neither a plan that exchanges over the copy engine nor directly ([Note: direct calls]: the
        plan of the agreed call is then not known), else None ([Note: agreement once per call
        signature])."""
        known = self._agreed_call
        if known is None or known[0] != row or self.plan is DIRECT_PLAN or (
                self.plan is not None and self.plan.transport == Transport.COPY_ENGINE):
            return None
        return known[1]

    def direct_key(self, x, *extra) -> Optional[tuple]:
        """The signature of a direct call on ``x`` (its shape, dtype and device, whether it came as
        a DTensor, then ``extra``: the forms of the call's other arguments), or None where the call
        is not direct ([Note: direct calls])."""
        if torch.is_grad_enabled() or type(x) is not torch.Tensor or x.dim() != 3 or self.pinned is not None \
                or self.checks_inputs or self.call_graphs is not None or self.trace_to is not None:
            return None
        shape, device = x.shape, x.device
        if shape[0] * shape[1] > DIRECT_ROWS or torch.is_autocast_enabled(device.type) or capturing_graph(x):
            return None
        layer = self._layer()
        if layer.num_tiles != "auto" or layer.launch_log is not None:
            return None
        return (shape, x.dtype, device, self.dtensor_input, *extra)

    def direct_known(self, key: Optional[tuple]) -> bool:
        """Whether direct call ``key`` (:meth:`direct_key`) repeats the last agreed direct call's
        signature, so that it runs with no agreement; counted in ``calls`` and its plan set."""
        if key is None or key != self._direct_agreed:
            return False
        self.calls += 1
        self.plan = DIRECT_PLAN
        return True

    def direct_agreed(self, key: tuple) -> TilePlan:
        """Record direct call ``key``'s agreement (made by the caller just before); returns the
        plan it runs."""
        self._direct_agreed = key
        self.plan = DIRECT_PLAN
        return DIRECT_PLAN

    def remember_agreement(self, row: tuple, agreed: Agreed) -> None:
        """Keep ``agreed`` for the next call whose row is ``row``."""
        self._agreed_call = (row, agreed)

    def call(self, x, agreed: Agreed, run: Callable, inputs: Optional[tuple] = None):
        """The call after its agreement ``agreed``: pick its plan (fixed, recorded for a
        recomputation, or the planner's and its verification trial), set ``plan``, and return
        ``run(plan, trial, trace, *inputs)`` (``inputs``: the call's tensors, ``x`` first; default
        ``(x,)``) timed for verification and recorded for ``export_trace(measured=True)`` when
        asked, or replayed from its CUDA graph ([Note: graph calls] in ``planning/call_graphs.py``).
        A call without tokens runs no plan (the layer's ``_empty_output``) where the layer allows.

        A call whose agreement is the last call's (the same object: reused,
        [Note: agreement once per call signature]) runs that call's plan straight away where that
        plan was settled and the call neither recomputes nor runs under saved-tensor hooks nor
        answers a trace request: nothing else it would look up can differ."""
        steady = self._steady
        if steady is not None and steady[0] is agreed and self.trace_to is None and not in_backward_pass() \
                and not saved_tensor_hooks_active():
            self.plan = steady[1]
            return run(steady[1], None, None, *((x,) if inputs is None else inputs))
        self._steady = None
        layer = self.layer
        shape, dtype, save, fixed = agreed
        if 0 in shape and layer._dense_when_empty:
            return layer._empty_output(x, dtype)
        pkey = layer._plan_key(shape[:2], dtype, save)
        chosen = self.recompute.choose(x, pkey, save, fixed, lambda: self.auto_plan(shape[:2], dtype, save))
        self.plan, trial = chosen.plan, chosen.trial
        self.last_call = (pkey, layer._tile_units(shape))
        # a checkpointed call leaves a trace request to the next other call: its recomputation
        # must run the path its forward ran ([Note: plain serial calls] in layers/common/plain_tp.py)
        asked = None if chosen.hooked or chosen.in_backward else self.take_trace_request()
        trace = TraceJob(asked, x.device) if asked else None
        inputs = (x,) if inputs is None else inputs
        settled = fixed is not None or self.plans.settled(pkey) is not None
        if self.call_graphs is not None and settled and trial is None and trace is None and x.is_cuda \
                and not chosen.hooked and not chosen.in_backward and not self.capturing:
            graphed = layer._graphed_run(run, shape, dtype, save)
            params = [p for p in layer.parameters() if p.requires_grad] if save else None
            if graphed is not None:
                return self._replay(pkey, graphed, inputs, params)
        if self.call_graphs is not None:
            self.call_graphs.last_nbytes = 0  # this call runs eagerly: it keeps no graph memory
        elif settled and trial is None and trace is None and not chosen.hooked and not chosen.in_backward:
            self._steady = (agreed, self.plan)
        if trial is not None:
            trial.fwd.start()
        y = run(self.plan, trial, trace, *inputs)
        if trial is not None:
            trial.fwd.stop()
        if trace is not None:
            trace.write()
        return y

    def _replay(self, pkey, graphed: Callable, inputs: tuple, params: Optional[list]):
        """The call by its CUDA graph: captured at the first call of its signature, replayed after."""
        layer, plan = self.layer, self.plan
        key = (pkey, plan, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
               tuple(None if t is None else (tuple(t.shape), t.dtype, t.requires_grad) for t in inputs),
               layer._graph_signature())
        return self.call_graphs.run(key, inputs, lambda *ins: graphed(plan, None, None, *ins), params,
                                    lambda t, role: layer._graph_stage(plan, t, role))

    def graph_params(self) -> tuple:
        """Where the layer's parameters and buffers live on this rank (a captured call reads them
        there: [Note: graph calls] in ``planning/call_graphs.py``)."""
        layer = self.layer
        return tuple((t.to_local() if isinstance(t, DTensor) else t).data_ptr()
                     for t in (*layer.parameters(), *layer.buffers()))

    @contextlib.contextmanager
    def dtensor_call(self, x: DTensor):
        """While a call runs on DTensor ``x``'s local tensor: an agreement column says so
        ([Note: DTensor inputs]) and a recomputation finds its plan by ``x`` ([Note: recompute])."""
        self.dtensor_input, self.recompute.replay_key = True, x
        try:
            yield
        finally:
            self.dtensor_input, self.recompute.replay_key = False, None

    # ----------------------------------------------------------------- plans
    def fixed_plan(self, shape: tuple) -> Optional[TilePlan]:
        """The pinned plan or a fixed K (capped by the tile units); None when the planner decides."""
        layer = self.layer
        units = layer._tile_units(shape)
        if self.pinned is not None:
            k = effective_num_tiles(units, self.pinned.num_tiles)
            if k == self.pinned.num_tiles:
                return self.pinned
            return replace(self.pinned, num_tiles=k, buckets_fwd=(), buckets_bwd=())  # buckets name tiles
        if layer.num_tiles == "auto":
            return None
        k = effective_num_tiles(units, layer.num_tiles)
        if self._fixed is None or self._fixed.num_tiles != k or self._fixed.num_streams != layer._plan_streams:
            self._fixed = TilePlan(k, num_streams=layer._plan_streams)
        return self._fixed

    def make_plan(self, *key) -> TilePlan:
        """The plan of a new plan key (:meth:`PlanMaker.make_plan`)."""
        return self.maker.make_plan(*key)

    def auto_plan(self, shape: tuple, dtype: torch.dtype, save: bool, call: bool = True):
        """The planned plan for ``shape`` (K capped to its tile units) and the trial this call
        must time, if any (``call=False``: planning ahead, no trial)."""
        layer = self.layer
        key, units = layer._plan_key(shape, dtype, save), layer._tile_units(shape)
        plan, trial = self.plans.get(key, lambda key: self.make_plan(*key),
                                     lambda plan: contenders(plan, self.maker.plan_budget), layer._weight.device,
                                     call=call, capturing=call and self.capturing)
        k = effective_num_tiles(units, plan.num_tiles)
        if k != plan.num_tiles:
            plan = replace(plan, num_tiles=k, buckets_fwd=(), buckets_bwd=())
            if trial is not None:
                trial.plan = plan
        return plan, trial

    def settled_plan(self, shape: tuple, dtype: torch.dtype, save: bool) -> Optional[TilePlan]:
        """The verified plan for a call of ``shape`` (K capped to its tile units), or None while
        the shape is new or being verified, or when the layer's plan is fixed or pinned. Changes
        nothing."""
        layer = self.layer
        if self.pinned is not None or layer.num_tiles != "auto":
            return None
        plan = self.plans.settled(layer._plan_key(shape, dtype, save))
        if plan is None:
            return None
        k = effective_num_tiles(layer._tile_units(shape), plan.num_tiles)
        return plan if k == plan.num_tiles else replace(plan, num_tiles=k, buckets_fwd=(), buckets_bwd=())

    @property
    def verifying(self) -> bool:
        """Whether the first calls of the last plan key still time its contenders."""
        return self.plans.verifying()

    def pin(self, plan: Optional[TilePlan]) -> None:
        """``layer.pin_plan``: checks ``plan`` (and the layer's own limits, ``_check_pin``)."""
        if plan is not None:
            if not isinstance(plan, TilePlan):
                raise ValueError(f"plan={plan!r}; must be a TilePlan (overlap_layers.layers.TilePlan) or None")
            check_num_tiles(plan.num_tiles, "plan.num_tiles")
            check_positive_int(plan.num_streams, "plan.num_streams")
            self.layer._check_pin(plan)
        self.pinned = plan

    def warmup(self, shapes, dtype: Optional[torch.dtype] = None, training: bool = True) -> list:
        """``layer.warmup``: plan ahead for each ``(batch, seq_local)``, agreed across the ranks."""
        layer = self.layer
        # a bad argument raises after the agreement, so that the other ranks (whose requests then
        # differ from this one's) raise too instead of waiting in it
        error, pairs = None, []
        try:
            pairs = [(int(b), int(s)) for b, s, *_ in shapes]
        except (TypeError, ValueError):
            error = f"shapes={shapes!r}; must be a list of (batch, seq_local) pairs"
        if error is None and any(b < 1 or s < 1 for b, s in pairs):
            error = f"shapes={shapes!r}; batch and seq must be positive"
        dtype = layer._weight.dtype if dtype is None else dtype
        if error is None and dtype not in DTYPES:
            error = f"dtype={dtype!r}; valid: {DTYPES}"
        request = zlib.crc32(repr((pairs, str(dtype), bool(training), error)).encode())
        floor = layer._floor()
        full = self.agreement.gather((request, *floor), who=lambda: f"{self.describe()}, warm-up")
        self.agreed_floor = floor_of(full, len(floor))
        if error is not None:
            raise ValueError(error)
        if len({row[0] for row in full}) > 1:
            raise ValueError(f"warmup: every rank must pass the same shapes, dtype and training flag; "
                             f"this rank: shapes={shapes}, dtype={dtype}, training={training}")
        layer._after_agreement(self.agreed_floor, False)
        if self.pinned is not None or layer.num_tiles != "auto":
            return []
        return [self.auto_plan(p, dtype, bool(training), call=False)[0] for p in pairs]

    # ----------------------------------------------------------------- explaining
    def explain(self) -> str:
        """``layer.explain()``: the last call's plan and the candidates it was chosen from."""
        return explain(self.plan)

    def take_trace_request(self):
        """The path of a pending ``export_trace(measured=True)``, now answered by the caller's
        call (None if none is pending)."""
        path, self.trace_to = self.trace_to, None
        return path

    def export_trace(self, path, measured: bool = False) -> None:
        """``layer.export_trace``: the predicted timeline of the last call's plan now, or the
        measured one of the next call (``measured=True``)."""
        if measured:
            self.trace_to = path
            return
        if self.last_call is None:
            raise ValueError("export_trace(measured=False) needs a plan: call the layer once first")
        layer = self.layer
        key, _ = self.last_call
        dtype, save = key[-2], key[-1]
        hw = self.maker.hw.get(dtype) or analytic_model(layer._weight.device.type)
        write_chrome_trace(path, layer._predicted_timelines(layer._cost_model(key, hw), self.plan, save))
