"""What every planned layer shares: the planning methods (a mixin); the tile plan type is in
``plan.py``, a call's checks in ``checks.py`` and its passes in ``calls.py``.

Reference: a :class:`PlannedLayer` with ``num_tiles="auto"`` runs, for each call, the plan its
:class:`~overlap_layers.planning.plan_cache.PlanCache` holds for the call's key (the layer's shape
bucket, dtype and grad mode): made at the first call for the key by calibrating (CUDA, once per
dtype, or loaded from the calibration cache file), measuring the ops the candidates need,
simulating every candidate (:func:`~overlap_layers.planning.candidates.plan_candidates`) and choosing
under the memory budget (:func:`~overlap_layers.sim.choose`); then verified on the first calls
([Note: first-call verification]).

A layer provides ``_plan_key(shape, dtype, save)`` (a tuple ending in dtype, save),
``_tile_units(shape)`` (what K is capped by), ``_cost_model(key, hw)``, ``_programs(k, save,
regather)``, ``_op_setups(cm, dtype)`` (the non-GEMM ops to measure) and ``_weight`` (a parameter
giving the device), and ends its constructor with :meth:`_init_layer`.
"""
from __future__ import annotations

import functools
import warnings
import weakref
import zlib
from collections import deque
from dataclasses import replace
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakTensorKeyDictionary

from ..config import Decomposition, OverlapConfig, Transport, check_num_tiles, check_positive_int
from ..runtime import StreamPool, shared_agreement
from ..runtime.carveout import carve_passes, carveout_available, default_carveout
from ..runtime.group import first_disagreement
from ..runtime.timing import rank_barrier
from ..sim import analytic_model, choose
from .calibrate import calibrate, measure_gemms, measure_ops
from .calibration_cache import cache_key, cache_path, default_cache_dir, load_agreed, store
from .call_graphs import CallGraphs
from .calls import capturing_graph, in_backward_pass, saved_tensor_hooks_active
from .candidates import plan_candidates
from .compiled import can_compile, compiled_call, register_layer
from .copying import copy_module
from .dtensor import as_dtensor_params, dtensor_forward
from .plan import TilePlan, contenders, plan_of
from .plan_cache import PlanCache
from .tiling import effective_num_tiles
from .trace import TraceJob, write_chrome_trace

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_PLAN_CACHE_SIZE = 32
# How far ahead of the device a verification trial queues each pass with config.cuda_graphs: above the
# host time of one pass of any capturable layer here (at most about 6 ms at TP 4 on H200, the bench's
# ``host`` column: docs/measurements.md, CUDA graphs), and short, since every timed pass of every layer
# waits this long once (about 18 passes per layer and shape).
_PREQUEUE_MS = 10.0


class PlannedLayer:
    """Mixin for ``nn.Module`` layers planned per shape bucket (see the module docstring).

    [Note: recompute]
    Under activation checkpointing the forward runs again inside the backward, and must run the
    plan its original forward ran (the saved tensors must match). A forward inside a backward pass
    therefore replays the plan recorded for its input tensor (the checkpoint passes the same
    object; for a DTensor input, the DTensor, not the fresh local view the layer computes on),
    consuming no verification trial and not advancing the plan cache; every rank recomputes in
    the same order, so the agreement gather still matches.
    When the checkpointed region holds more than the layer (a norm before it, a whole decoder
    block), the recomputation feeds the layer a new tensor, so identity cannot find the plan. The
    forwards that run under saved-tensor hooks (what a checkpoint installs) are therefore queued
    per plan key with their plans, until their recomputation: a recomputation the identity lookup
    misses takes the oldest queued plan (one found by identity leaves the queue too). A
    checkpointed forward may take a verification trial only while no other checkpointed forward of
    its key awaits recomputation; otherwise it runs the plan queued last. The queued plans are
    thus all equal, and whichever order the recomputations come in, each gets its forward's plan.
    (A forward under hooks whose recomputation never comes, e.g. activation offloading, keeps its
    entry; later checkpointed forwards of that key then run its plan and take no trials.)

    [Note: CUDA graphs]
    A call can be captured into a CUDA graph (``torch.cuda.graph``, ``make_graphed_callables``,
    a whole training step) once its plan exists: its GEMMs, NCCL collectives, copy-engine copies
    and signal kernels are stream work, and its host work (agreement gather, plan lookup) runs at
    capture only. Capturing is a column of the call's agreement (every rank captures or the call
    raises ValueError on every rank). A captured call neither plans nor times
    (:class:`~overlap_layers.planning.plan_cache.PlanCache`): a shape with no plan raises
    RuntimeError, pending verification pauses until the next eager calls, and the graph keeps the
    plan it captured. The copy-engine workspace keeps every buffer a graph captured
    (``runtime/exchange.py``). ``OverlapMoE``'s calls cannot be captured by the caller: they read
    their all-to-all sizes on the host (with ``config.graph_calls`` its calls without aux loss
    capture a path that does not: [Note: MoE graph calls] in ``layers/moe/device.py``). Replays launch
    no Python, so a plan whose eager calls are host-bound runs at its device time;
    ``config.cuda_graphs`` makes verification compare contenders that way, and
    ``config.graph_calls`` has the layer capture and replay its own calls ([Note: graph calls] in
    ``planning/call_graphs.py``).
    """

    _has_copy_engine = False  # whether config.transport="copy_engine" has a path in this layer
    _graphable = True  # whether config.graph_calls may capture calls (which ones: _graphed_run)
    _plan_streams = 2  # the compute streams of the planner's plans (TilePlan.num_streams)

    # ----------------------------------------------------------------- DTensor parameters (mesh=)
    _local_views: dict = {}  # name -> view of a DTensor parameter; empty (plain parameters) with group=
    # name -> (plain, DTensor local) identities whose backward sums the gradient over the group
    # ([Note: gradients complete in backward] in ``layers/common/grads.py``)
    _grad_sums: dict = {}

    def _local(self, name: str):
        """Parameter ``name`` (or None) as the ``group=`` layout's local tensor the compute uses: the
        parameter itself, or a differentiable local view of its DTensor ([Note: DTensor parameters]
        in ``planning/dtensor.py``), through its gradient's sum where the layer has one."""
        p = getattr(self, name)
        view, sums = self._local_views.get(name), self._grad_sums.get(name)
        if sums is None or p is None:
            return p if view is None else view(p)
        return sums[0](p) if view is None else view(p, reduce=sums[1])

    def _as_dtensors(self, mesh, axis) -> None:
        """With ``mesh=``, hold the parameters as DTensors on the mesh axis (no-op for None)."""
        if mesh is not None:
            as_dtensor_params(self, mesh, axis)

    # ----------------------------------------------------------------- DTensor inputs
    _input_mesh = None  # with mesh=: the mesh axis' 1-D DeviceMesh a DTensor input must be on
    _dtensor_input: bool = False  # True while a call runs on a DTensor input's local tensor

    @staticmethod
    def dtensor_io(forward: Callable) -> Callable:
        """Decorator of a layer's ``forward(self, x, ...)``: a plain ``x`` runs ``forward`` unchanged;
        a DTensor ``x`` runs it on ``x``'s local tensor and returns a DTensor with ``x``'s placements
        ([Note: DTensor inputs] in ``planning/dtensor.py``). While ``torch.compile``
        traces, the call becomes one opaque op ([Note: compiled calls] in .compiled)."""
        @functools.wraps(forward)
        def wrapper(self, x, *args, **kwargs):
            if torch.compiler.is_compiling() and can_compile(self, x):
                extras = self._compiled_extras(*args, **kwargs)
                if extras is not None:
                    return compiled_call(self, x, extras)
            if not isinstance(x, DTensor):
                return forward(self, x, *args, **kwargs)
            return dtensor_forward(self, functools.partial(forward, self), x, *args, **kwargs)
        return wrapper

    def _compiled_extras(self, *args, **kwargs) -> Optional[list]:
        """The call's other arguments as the compiled op's tensor list, or None if it cannot take
        them ([Note: compiled calls]); none by default."""
        return [] if not args and not kwargs else None

    def _compiled_kwargs(self, extras) -> dict:
        """The keyword arguments of ``forward`` from :meth:`_compiled_extras`' list."""
        return {}

    def _init_layer(self, config: OverlapConfig, mesh, axis) -> None:
        """The end of every layer's constructor (``self.group`` set, parameters allocated): the
        launch log, no pinned plan, the per-call state (:meth:`_init_runtime`), the initial weights
        and, with ``mesh=``, the DTensor parameters."""
        if config.transport == Transport.COPY_ENGINE and not self._has_copy_engine:
            warnings.warn(f"{type(self).__name__} has no copy-engine path; config.transport='copy_engine' "
                          f"runs NCCL here", stacklevel=3)
        self.launch_log: Optional[list] = None
        self._pinned: Optional[TilePlan] = None
        self._init_runtime(config)
        self.reset_parameters()
        self._as_dtensors(mesh, axis)

    def _init_runtime(self, config: OverlapConfig) -> None:
        """The per-call state a new layer and a copy start from: streams, the group's agreement,
        the planning state and the layer kind's caches."""
        self._streams = StreamPool()
        self._agreement = shared_agreement(self.group)
        self._init_planning(config)
        self._init_caches()

    def _init_caches(self) -> None:
        """Per-call caches of a layer kind, started by its constructor and by a copy; none by
        default."""

    def __deepcopy__(self, memo: dict):
        """``copy.deepcopy``: [Note: copying a layer] (``planning/copying.py``)."""
        new = copy_module(self, memo, keep=("_pinned",))
        new._init_runtime(new.config)
        return new

    def _graph_stage(self, plan, t: torch.Tensor, role: str) -> Optional[torch.Tensor]:
        """Where a graph of ``plan``'s calls keeps the static tensor standing for ``t`` (``role``:
        "input", "training_input" or "output_grad", :meth:`CallGraphs.run`); None: a tensor of its
        own ([Note: staged input] in ``planning/call_graphs.py``)."""
        return None

    def _graphed_run(self, run: Callable, shape: tuple, dtype: torch.dtype, save: bool) -> Optional[Callable]:
        """What ``config.graph_calls`` captures of a call whose plan is settled (its signature as
        ``run``'s), or None where the call must run eagerly ([Note: graph calls]): ``run`` itself
        by default. From agreed values and the call history only (the agreed ``shape``,
        ``dtype``, ``save``), so every rank takes the same branch."""
        return run

    def _graph_signature(self) -> tuple:
        """What a captured call's signature adds to this rank's inputs' shapes so that it is the
        same on every rank ([Note: graph calls] in ``planning/call_graphs.py``): nothing by default (every
        rank's inputs are agreed equal)."""
        return ()

    def _graph_params(self) -> tuple:
        """Where this rank's parameters and buffers live (a captured call reads them there:
        [Note: graph calls] in ``planning/call_graphs.py``)."""
        return tuple((t.to_local() if isinstance(t, DTensor) else t).data_ptr()
                     for t in (*self.parameters(), *self.buffers()))

    def _call_tensors(self, x: torch.Tensor, names: Sequence[str]):
        """``(x, [parameters])``: ``x`` and the local parameters ``names`` (None stays None) in
        the dtype the call computes in, autocast's on ``x``'s device when it is enabled."""
        params = [self._local(n) for n in names]
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            cdt = torch.get_autocast_dtype(dev)
            x, params = x.to(cdt), [None if p is None else p.to(cdt) for p in params]
        return x, params

    def _init_planning(self, config: OverlapConfig) -> None:
        register_layer(self)  # [Note: compiled calls]
        self._compiled_graphs: dict = {}  # token -> (output, leaves) of a compiled call awaiting backward
        self.plan: Optional[TilePlan] = None
        replayed = config.cuda_graphs or config.graph_calls
        self._plans = PlanCache(self._agreement, size=_PLAN_CACHE_SIZE, verify=config.verify_first_calls,
                                margin=config.margin, prequeue_ms=_PREQUEUE_MS if replayed else 0.0,
                                align=rank_barrier(self.group) if replayed else None)
        self._call_graphs = CallGraphs(self._agreement) if config.graph_calls and self._graphable else None
        self._hw: dict = {}
        self._last_call: Optional[tuple] = None  # (key, units) of the last call
        self._plan_of_input = WeakTensorKeyDictionary()  # input -> its auto plan ([Note: recompute])
        self._checkpointed_plans: dict = {}  # plan key -> plans of checkpointed forwards ([Note: recompute])
        self._replay_key = None  # the caller's input when forward runs on a view of it (a DTensor's local)
        self._trace_to = None  # export_trace(path, measured=True) waiting for the next call

    # ----------------------------------------------------------------- one call
    def pin_plan(self, plan: Optional[TilePlan]) -> None:
        """Use ``plan`` for every call (its tile count is capped by the layer's tile units); None
        unpins. Pin the same plan on every rank: it is checked across ranks at each call."""
        if plan is not None:
            if not isinstance(plan, TilePlan):
                raise ValueError(f"plan={plan!r}; must be a TilePlan (overlap_layers.layers.TilePlan) or None")
            check_num_tiles(plan.num_tiles, "plan.num_tiles")
            check_positive_int(plan.num_streams, "plan.num_streams")
            self._check_pin(plan)
        self._pinned = plan

    def _check_pin(self, plan: TilePlan) -> None:
        """Layer-specific limits of a pinned plan (ValueError); by default batch tiles over NCCL."""
        if plan.decomposition != Decomposition.BATCH or plan.transport != Transport.NCCL:
            raise ValueError(f"plan: {type(self).__name__} runs batch tiles over NCCL only (decomposition='batch', "
                             f"transport='nccl'); got decomposition={plan.decomposition!r}, "
                             f"transport={plan.transport!r}")

    def _fixed_plan(self, shape: tuple) -> Optional[TilePlan]:
        """The pinned plan or a fixed K (capped by the tile units); None when the planner decides."""
        units = self._tile_units(shape)
        if self._pinned is not None:
            k = effective_num_tiles(units, self._pinned.num_tiles)
            if k == self._pinned.num_tiles:
                return self._pinned
            return replace(self._pinned, num_tiles=k, buckets_fwd=(), buckets_bwd=())  # buckets name tiles
        if self.num_tiles == "auto":
            return None
        return TilePlan(effective_num_tiles(units, self.num_tiles), num_streams=self._plan_streams)

    def _agree(self, x, err: int, errors: Mapping[int, str], what: str, *, extra: Sequence[int] = (),
               extra_names: Sequence[str] = (), shape_names=("batch", "seq", "hidden")):
        """The call's agreement ([Note: agreement]): one host gather of (input error ``err``, shape,
        dtype, plan request, grad mode, ``extra``, :meth:`_floor`) from every rank; raises the same
        ValueError on every rank if any rank's input is bad (``errors[code]`` says why, ``what``
        names the arguments) or if the ranks disagree on anything but the floor, whose minimum
        over the ranks becomes ``self._agreed_floor``. Returns ``(shape, dtype, save, fixed plan
        or None)``."""
        floor = self._floor()
        shape = tuple(x.shape) if err == 0 else (0, 0, 0)
        fixed = self._fixed_plan(shape) if err == 0 else TilePlan(1)
        save = torch.is_grad_enabled() and (
            (err == 0 and x.requires_grad) or any(p.requires_grad for p in self.parameters()))
        dtype = x.dtype if err == 0 else None
        if err == 0 and torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        dtype_code = DTYPES.index(dtype) if dtype in DTYPES else -1
        request = fixed.digest() if fixed is not None else 0
        # the last columns: whether x came as a DTensor ([Note: DTensor inputs]), so that a DTensor on
        # some ranks and a plain tensor on others is a ValueError on every rank, not a silent mix;
        # whether the call is being captured into a CUDA graph ([Note: CUDA graphs])
        capturing = err == 0 and capturing_graph(x)
        # then config.graph_calls, and after the floor whether this rank's parameters are the tensors
        # its captured calls read (the minimum counts: [Note: graph calls] in planning/call_graphs.py)
        graphs = self._call_graphs
        kept = graphs.params_kept(self._graph_params()) if graphs is not None else 1
        full = self._agreement.gather((err, *shape, dtype_code, request, int(save), *extra,
                                       int(self._dtensor_input), int(capturing), int(graphs is not None), *floor,
                                       kept))
        if graphs is not None and min(row[-1] for row in full) == 0:
            graphs.moved()  # on every rank that has graphs (config.graph_calls is agreed below)
        full = [row[:-1] for row in full]
        table = [row[:len(row) - len(floor)] for row in full]
        self._set_floor(full, len(floor))
        errs = {r: row[0] for r, row in enumerate(table) if row[0]}
        if errs:
            w = self._weight
            mine = f"; this rank: {errors[err]} (got x {tuple(getattr(x, 'shape', ()))}, " \
                   f"{getattr(x, 'dtype', None)}, {getattr(x, 'device', None)}; hidden_size={self.hidden_size}, " \
                   f"weights {w.dtype} on {w.device})" if err else ""
            raise ValueError(f"{what}: bad input on rank(s) " + ", ".join(
                f"{r} ({errors[e]})" for r, e in errs.items()) + mine)
        names = ("input error", *shape_names, "dtype", "plan request (0 = auto)", "grad mode", *extra_names,
                 "x a DTensor", "capturing a CUDA graph", "config.graph_calls")
        bad = first_disagreement(table, names)
        if bad:
            raise ValueError(f"x: every rank of the group must call the layer alike (shapes, dtype, num_tiles or "
                             f"pinned plan, grad mode{''.join(', ' + n for n in extra_names)}, "
                             f"DTensor or plain x, CUDA-graph capture or not, config.graph_calls); {bad}")
        self._capturing = capturing  # agreed: equal on every rank
        self._after_agreement(capturing)
        return self._agreed_shape(shape, table), dtype, save, fixed

    _dense_when_empty = True  # a call without tokens runs no plan: :meth:`_empty_output`

    def _empty_output(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The output of a call without tokens (its agreed batch or sequence is 0, so on every
        rank), as the dense layer's: an ``x``-shaped empty tensor in the call's ``dtype`` whose
        backward gives ``x`` an empty gradient and each parameter that needs one a zero gradient.
        No plan runs (``plan`` keeps the last call's) and no collective: nothing is exchanged."""
        y = x.to(dtype) * 0
        if torch.is_grad_enabled():
            for name, p in self._parameters.items():
                if p is not None and p.requires_grad:
                    y = y + self._local(name).sum().to(dtype) * 0
        return y

    _agreed_floor: tuple = ()
    _capturing: bool = False  # whether the current call is being captured into a CUDA graph (agreed)
    _plan_budget: Optional[int] = None  # the memory budget the last plan was made under

    def _floor(self) -> tuple:
        """Ints each rank adds to its agreement row whose minimum over the ranks (not equality) is
        what counts, e.g. whether this rank could use a transport; none by default."""
        return ()

    def _after_agreement(self, capturing: bool) -> None:
        """Run on every rank once a call's (or warm-up's) agreement has passed, from agreed values
        only (``self._agreed_floor``; ``capturing``: the call is being captured); nothing by default."""

    def _set_floor(self, table, n: int) -> None:
        self._agreed_floor = tuple(min(col) for col in zip(*(row[len(row) - n:] for row in table))) if n else ()

    def _agreed_shape(self, shape: tuple, table) -> tuple:
        """The shape planning uses: this rank's (equal on every rank once agreed); a layer whose
        ranks hold different token counts derives one from the gathered ``table`` instead."""
        return shape

    def _planned_call(self, x, shape: tuple, dtype: torch.dtype, save: bool, fixed: Optional[TilePlan],
                      run: Callable, inputs: Optional[tuple] = None):
        """Pick the call's plan (fixed, or the planner's and its verification trial), set
        ``self.plan``, and return ``run(plan, trial, trace, *inputs)`` (``inputs``: the call's
        tensors or None, ``x`` first; default ``(x,)``) timed for verification and recorded for
        ``export_trace(measured=True)`` when asked, or replayed from its CUDA graph ([Note: graph
        calls] in ``planning/call_graphs.py``); a call without tokens runs no plan (:meth:`_empty_output`)
        where the layer kind allows. Depends only on agreed values and the call history, so every
        rank takes the same branch."""
        if 0 in shape and self._dense_when_empty:
            return self._empty_output(x, dtype)
        trial = None
        key = self._replay_key if self._replay_key is not None else x
        in_backward = in_backward_pass()
        replay = self._plan_of_input.get(key) if in_backward and isinstance(key, torch.Tensor) else None
        hooked = save and saved_tensor_hooks_active()  # a checkpointed region: [Note: recompute]
        pkey = self._plan_key(shape[:2], dtype, save)
        queue = self._checkpointed_plans.setdefault(pkey, deque()) if hooked else None
        if fixed is not None:
            self.plan = fixed
        elif replay is not None:  # [Note: recompute]
            self.plan = replay
            if queue:
                self._checkpointed_plans[pkey] = deque(e for e in queue if e[1]() is not key)
        elif hooked and in_backward and queue:
            self.plan = queue.popleft()[0]
        elif hooked and queue:  # forwards whose recomputations are pending: all run the same plan
            self.plan = queue[-1][0]
            queue.append((self.plan, weakref.ref(key)))
            self._plan_of_input[key] = self.plan
        else:
            self.plan, trial = self._auto_plan(shape[:2], dtype, save)
            if save:
                self._plan_of_input[key] = self.plan
            if hooked and not in_backward:
                queue.append((self.plan, weakref.ref(key)))
        self._last_call = (pkey, self._tile_units(shape))
        asked = self._take_trace_request()
        trace = TraceJob(asked, x.device) if asked else None
        inputs = (x,) if inputs is None else inputs
        settled = fixed is not None or self._plans.settled(pkey) is not None
        if self._call_graphs is not None and settled and trial is None and trace is None and x.is_cuda \
                and not hooked and not in_backward and not self._capturing:
            graphed = self._graphed_run(run, shape, dtype, save)
            params = [p for p in self.parameters() if p.requires_grad] if save else None
            if graphed is not None and not (params and any(isinstance(p, DTensor) for p in params)):
                plan = self.plan
                key = (pkey, plan, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
                       tuple(None if t is None else (tuple(t.shape), t.dtype, t.requires_grad) for t in inputs),
                       self._graph_signature())
                return self._call_graphs.run(key, inputs, lambda *ins: graphed(plan, None, None, *ins), params,
                                             lambda t, role: self._graph_stage(plan, t, role))
        if self._call_graphs is not None:
            self._call_graphs.last_nbytes = 0  # this call runs eagerly: it keeps no graph memory
        if trial is not None:
            trial.fwd.start()
        y = run(self.plan, trial, trace, *inputs)
        if trial is not None:
            trial.fwd.stop()
        if trace is not None:
            trace.write()
        return y

    def _call_with_positions(self, x, agreed: tuple, position_ids, position_embeddings):
        """:meth:`_planned_call` of an attention layer's ``_run(x, plan, save, position_ids,
        position_embeddings, trial, trace)`` after its agreement ``agreed`` (``(shape, dtype, save,
        fixed)``), with the positions among the call's inputs (a replayed call copies them too)."""
        save = agreed[2]
        return self._planned_call(
            x, *agreed, lambda plan, trial, trace, x, ids, *pe: self._run(x, plan, save, ids, pe or None, trial, trace),
            inputs=(x, position_ids, *(position_embeddings or ())))

    # ----------------------------------------------------------------- planning
    def _auto_plan(self, shape: tuple, dtype: torch.dtype, save: bool, call: bool = True):
        """The planned plan for ``shape`` (K capped to its tile units) and the trial this call
        must time, if any."""
        key, units = self._plan_key(shape, dtype, save), self._tile_units(shape)
        plan, trial = self._plans.get(key, lambda key: self._make_plan(*key),
                                      lambda plan: contenders(plan, self._plan_budget), self._weight.device, call=call,
                                      capturing=call and self._capturing)
        k = effective_num_tiles(units, plan.num_tiles)
        if k != plan.num_tiles:
            plan = replace(plan, num_tiles=k, buckets_fwd=(), buckets_bwd=())
            if trial is not None:
                trial.plan = plan
        return plan, trial

    def settled_plan(self, shape: tuple, dtype: torch.dtype, save: bool) -> Optional[TilePlan]:
        """The planner's verified plan for a call of ``shape`` (K capped to its tile units), or
        None while the shape is new or being verified, or when the layer's plan is fixed or pinned.
        Changes nothing: the fused block (``layers/block/fused.py``) reads it before the call."""
        if self._pinned is not None or self.num_tiles != "auto":
            return None
        plan = self._plans.settled(self._plan_key(shape, dtype, save))
        if plan is None:
            return None
        k = effective_num_tiles(self._tile_units(shape), plan.num_tiles)
        return plan if k == plan.num_tiles else replace(plan, num_tiles=k, buckets_fwd=(), buckets_bwd=())

    @property
    def verifying(self) -> bool:
        """True while the first calls of the last shape bucket still time the planned plan
        against K=1 ([Note: first-call verification])."""
        return self._plans.verifying()

    def warmup(self, shapes, dtype: Optional[torch.dtype] = None, training: bool = True) -> list:
        """Plan ahead for each ``(batch, seq_local)`` in ``shapes`` (and calibrate, on CUDA), as the
        first call for each would; returns the plans. A collective: call it on every rank with the
        same arguments (checked; a mismatch raises ValueError on every rank). No-op (returns [])
        unless ``num_tiles="auto"`` and no plan is pinned. First-call verification still happens
        on the first real calls."""
        # a bad argument raises after the agreement, so that the other ranks (whose requests then
        # differ from this one's) raise too instead of waiting in it
        error, pairs = None, []
        try:
            pairs = [(int(b), int(s)) for b, s, *_ in shapes]
        except (TypeError, ValueError):
            error = f"shapes={shapes!r}; must be a list of (batch, seq_local) pairs"
        if error is None and any(b < 1 or s < 1 for b, s in pairs):
            error = f"shapes={shapes!r}; batch and seq must be positive"
        dtype = self._weight.dtype if dtype is None else dtype
        if error is None and dtype not in DTYPES:
            error = f"dtype={dtype!r}; valid: {DTYPES}"
        request = zlib.crc32(repr((pairs, str(dtype), bool(training), error)).encode())
        floor = self._floor()
        full = self._agreement.gather((request, *floor))
        self._set_floor(full, len(floor))
        if error is not None:
            raise ValueError(error)
        table = [row[0] for row in full]
        if len(set(table)) > 1:
            raise ValueError(f"warmup: every rank must pass the same shapes, dtype and training flag; "
                             f"this rank: shapes={shapes}, dtype={dtype}, training={training}")
        self._after_agreement(False)
        if self._pinned is not None or self.num_tiles != "auto":
            return []
        return [self._auto_plan(p, dtype, bool(training), call=False)[0] for p in pairs]

    # ----------------------------------------------------------------- numbers
    def _measuring(self) -> bool:
        return self._weight.device.type == "cuda" and self.config.measure

    def _cache_file(self, dtype: torch.dtype):
        key = cache_key(device=self._weight.device, world_size=self.world_size, transport="nccl", dtype=dtype)
        return cache_path(self.config.cache_dir or default_cache_dir(), key), key

    def _hardware(self, dtype: torch.dtype):
        """The cost model's numbers for ``dtype``: on CUDA with ``measure``, from the calibration
        cache file if every rank's copy is usable and identical, else calibrated (and stored)."""
        if dtype not in self._hw:
            if self._measuring():
                path, key = self._cache_file(dtype)
                hw = load_agreed(path, key, self._agreement)
                if hw is None:
                    hw = calibrate(self.group, self._weight.device, dtype, self._agreement)
                    store(path, key, hw)
                self._hw[dtype] = hw
            else:
                self._hw[dtype] = analytic_model(self._weight.device.type)
        return self._hw[dtype]

    def _budget(self) -> Optional[int]:
        mb = self.config.memory_budget
        if mb is None or isinstance(mb, int):
            return mb
        if self._weight.device.type != "cuda":
            return None  # a fraction of free memory has no meaning for host memory here
        free = torch.cuda.mem_get_info(self._weight.device)[0]
        return int(self._agreement.min([float(free)])[0] * mb)

    def _rank_candidates(self, cm, batch: list, *, training: bool) -> list:
        """Candidates split by source rank (layers that have them); none by default."""
        return []

    def _measure_missing(self, cm, dtype: torch.dtype):
        """Time the GEMMs and other ops the candidates need that the model lacks (max over
        ranks), add them to the model and the cache file."""
        hw = cm.model
        gemms = cm.gemm_shapes() - set(hw.gemm_measured)
        setups = {key: fn for key, fn in self._op_setups(cm, dtype).items() if key not in hw.op_measured}
        if gemms or setups:
            hw = self._hw[dtype] = hw.with_measured(
                gemms=measure_gemms(gemms, dtype, self._weight.device, self._agreement),
                ops=measure_ops(setups, self._agreement))
            store(*self._cache_file(dtype), hw)
        return hw

    def _make_plan(self, *key) -> TilePlan:
        dtype, save = key[-2], key[-1]
        cm = self._cost_model(key, self._hardware(dtype))
        if self._measuring():
            cm.model = self._measure_missing(cm, dtype)
        candidates = plan_candidates(cm, self._programs, training=save)
        candidates += self._rank_candidates(cm, candidates, training=save)
        copy_engine = Transport.COPY_ENGINE
        if self.config.transport == copy_engine and any(c.transport == copy_engine for c in candidates):
            candidates = [c for c in candidates if c.is_serial or c.transport == Transport.COPY_ENGINE]
        self._plan_budget = self._budget()
        choice = choose(candidates, budget_bytes=self._plan_budget, margin=self.config.margin)
        carveout = self._carveout(cm, save)
        reason = choice.reason
        if any(carveout):
            reason += "; where batch tiles overlap NCCL, GEMMs leave " + " and ".join(
                f"{n} SMs free in the {p}" for n, p in zip(carveout, ("forward", "backward")) if n) + \
                " (communication at least half the compute)"
        return plan_of(choice.candidate, reason=reason, candidates=choice.candidates, carveout=carveout,
                       num_streams=self._plan_streams)

    def _carveout(self, cm, save: bool) -> tuple:
        """``(forward, backward)`` SMs the GEMMs leave free where a plan overlaps NCCL collectives
        with them ([Note: SM carveout]): ``config.sm_carveout`` (None: :func:`default_carveout`) in
        each pass whose serial timeline (the cost model's) has enough communication for it
        (:func:`carve_passes`); 0 in the others. Nothing off CUDA, with ``sm_carveout=0``, or where
        this torch cannot carve SMs out. From the agreed model, so equal on every rank."""
        dev, sms = self._weight.device, self.config.sm_carveout
        if dev.type != "cuda" or sms == 0 or not carveout_available():
            return ()
        total = torch.cuda.get_device_properties(dev).multi_processor_count
        if sms is None:
            sms = default_carveout(total)
        elif sms >= total:
            raise ValueError(f"sm_carveout={sms}: this device has {total} SMs; leave fewer free")
        return carve_passes(self._serial_timelines(cm, save), sms)

    def _serial_timelines(self, cm, save: bool) -> dict:
        """The cost model's K=1 timelines of this layer's passes (forward; backward when ``save``)."""
        return cm.timelines(self._programs, 1, False, (), (), save)

    # ----------------------------------------------------------------- explaining
    def _take_trace_request(self):
        """The path of a pending ``export_trace(measured=True)``, now answered by the caller's
        call (None if none is pending)."""
        path, self._trace_to = self._trace_to, None
        return path

    def export_trace(self, path, measured: bool = False) -> None:
        """Write a Chrome/Perfetto trace JSON of this layer's plan to ``path``.

        ``measured=False``: the timeline the planner predicts for the last call's plan and shape
        (forward, plus backward when that call saved for it), from the numbers the layer planned
        with (calibrated on CUDA, else nominal), on one compute stream as the planner scores it;
        rank-local, no collectives. ``measured=True``: the next call records every op (CUDA
        events, or the host clock on CPU) and writes the measured timeline in the same format after
        its forward, and again after its backward; open both side by side, or draw either with
        :func:`overlap_layers.plot_timeline`. A sublayer of an ``OverlapTransformerBlock`` whose
        next call runs fused writes the fused program's timeline: both sublayers' ops, named
        ``a.*`` (attention) and ``m0.*``, ``m1.*`` (the MLP's tiles in each block tile)."""
        if measured:
            self._trace_to = path
            return
        if self._last_call is None:
            raise ValueError("export_trace(measured=False) needs a plan: call the layer once first")
        key, _ = self._last_call
        dtype, save = key[-2], key[-1]
        hw = self._hw.get(dtype) or analytic_model(self._weight.device.type)
        write_chrome_trace(path, self._predicted_timelines(self._cost_model(key, hw), self.plan, save))

    def _predicted_timelines(self, cm, plan: TilePlan, save: bool) -> dict:
        """The timelines the planner scored ``plan`` by (forward, and backward when ``save``)."""
        return cm.timelines(self._programs, plan.num_tiles, plan.regather, plan.buckets_fwd, plan.buckets_bwd, save)

    def explain(self) -> str:
        """The last call's plan as a text table of the candidates the planner compared."""
        p = self.plan
        if p is None:
            return "no plan yet: the layer plans at its first call"
        lines = [f"plan: K={p.num_tiles} regather={p.regather} buckets={p.buckets} transport={p.transport} "
                 f"decomposition={p.decomposition}",
                 f"reason: {p.reason or 'fixed by num_tiles or pin_plan'}"]
        if p.candidates:
            lines.append(f"{'K':>3} {'regather':>8} {'pred ms':>9} {'exposed ms':>10} {'peak MiB':>9}  buckets")
            for c in sorted(p.candidates, key=lambda c: (c.num_tiles, c.regather)):
                lines.append(f"{c.num_tiles:>3} {str(c.regather):>8} {c.predicted_ms:>9.3f} {c.exposed_comm_ms:>10.3f} "
                             f"{c.peak_bytes / 2**20:>9.1f}  {dict(c.buckets_fwd)} / {dict(c.buckets_bwd)}")
        return "\n".join(lines)
