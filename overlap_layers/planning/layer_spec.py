"""What a planned layer describes to its planner, declared in one place: :class:`TiledLayer`.

Reference: a planned layer is an ``nn.Module`` that subclasses :class:`TiledLayer`; its
constructor checks its own arguments, calls :meth:`TiledLayer._init_group` (``config``,
``num_tiles``, ``group``, ``world_size``, ``rank``), sets ``hidden_size`` and its parameters, and
ends with :meth:`TiledLayer._init_planner` (its :class:`~.planner.LayerPlanner`, per-call caches,
initial weights, DTensor parameters with ``mesh=``). Its ``forward``, decorated with :func:`~.entry.planned_forward` (``torch.compile`` and
DTensor inputs), reads top-down::

    agreed = self.planner.agree(x, err, errors, "x")      # equal on every rank, or ValueError on every rank
    return self.planner.call(x, agreed, lambda plan, trial, trace, x: self._run(x, plan, ...))

``_run`` is the layer's call under one plan: its tile programs run by the executor through its
autograd Functions.
"""
from __future__ import annotations

import abc
import copy
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import Decomposition, Transport
from ..runtime import resolve_group
from .checks import check_dtype, resolve_config
from .copying import copy_module
from .cross_checks import config_digest, config_table
from .dtensor import Layout, as_dtensor_params
from .plan import TilePlan
from .planner import LayerPlanner


class TiledLayer(abc.ABC):
    """The hooks a planned layer provides to its :class:`~.planner.LayerPlanner` (and to the
    DTensor, compile and CUDA-graph machinery of ``planning/``), and the public planning methods
    it gets, which delegate to ``self.planner``.

    The hooks carry one underscore, as ``nn.Module._load_from_state_dict`` does: they are the
    layer's contract with that machinery, not a user API. The abstract ones every layer
    provides; the others have defaults that a layer overrides where it differs.

    Hooks: ``_weight``, ``_plan_key``, ``_tile_units``, ``_cost_model``, ``_programs``,
    ``_op_setups``, ``reset_parameters``, ``_dtensor_layouts``, ``_dtensor_input_placements``,
    ``_config_fields`` (abstract); ``_check_pin``, ``_rank_candidates``, ``_predicted_timelines``,
    ``_floor``, ``_after_agreement``, ``_agreed_shape``, ``_empty_output``, ``_graphed_run``,
    ``_graph_signature``, ``_graph_stage``, ``_compiled_extras``, ``_compiled_kwargs``,
    ``_init_caches`` and the class attributes below (defaults)."""

    _has_copy_engine = False  # whether config.transport="copy_engine" has a path in this layer
    _graphable = True  # whether config.graph_calls may capture calls (which ones: _graphed_run)
    _plan_streams = 2  # the compute streams of the planner's plans (TilePlan.num_streams)
    _dense_when_empty = True  # a call without tokens runs no plan: _empty_output
    _local_views: dict = {}  # name -> view of a DTensor parameter (as_dtensor_params); empty with group=
    # name -> (plain, DTensor local) identities whose backward sums the gradient over the group
    # ([Note: gradients complete in backward] in ``layers/common/grads.py``)
    _grad_sums: dict = {}
    _input_mesh = None  # with mesh=: the mesh axis' 1-D DeviceMesh a DTensor input must be on
    # ((name, value), ...) of a module around the layer that every rank must share too (a block's norms)
    _config_context: tuple = ()

    # ----------------------------------------------------------------- what the planner plans
    @property
    @abc.abstractmethod
    def _weight(self) -> torch.Tensor:
        """A parameter whose device and dtype are the layer's (calibration, budget, warm-up)."""

    @abc.abstractmethod
    def _plan_key(self, shape: tuple, dtype: torch.dtype, save: bool) -> tuple:
        """The plan cache's key of a call of agreed ``(batch, seq)`` ``shape``: a tuple ending in
        ``dtype, save`` (a shape bucket: calls of one key share a plan)."""

    @abc.abstractmethod
    def _tile_units(self, shape: tuple) -> int:
        """What K is capped by for a call of ``shape`` (rows, batch, heads...)."""

    @abc.abstractmethod
    def _cost_model(self, key: tuple, hw):
        """The cost model (``layers/common/cost.py``'s kind) of plan key ``key`` on hardware
        model ``hw``: the per-op costs the simulator scores the candidates with."""

    @abc.abstractmethod
    def _programs(self, k: int, save: bool, regather: bool) -> tuple:
        """``(forward, backward)`` :class:`~overlap_layers.schedule.TileProgram` of one tile at
        K=``k`` (structure only: the simulator reads their ops, it runs nothing)."""

    @abc.abstractmethod
    def _op_setups(self, cm, dtype: torch.dtype) -> dict:
        """The non-GEMM ops to measure on the device (CUDA, ``config.measure``): op key -> a
        setup returning the callable to time."""

    def _plain_call(self, key: tuple):
        """At world size 1: ``(x_shape, call)``, the plain serial call (``call(x) -> y`` of
        ``x``'s shape) at plan key ``key``, which the planner times as the serial plan's prediction
        ([Note: one rank's prediction] in ``planning/plan_maker.py``); None: the simulator's
        prediction stands."""
        return None

    @abc.abstractmethod
    def reset_parameters(self) -> None:
        """Initialise the parameters (the ``group=`` layout), the same on every rank."""

    @abc.abstractmethod
    def _dtensor_layouts(self) -> Dict[str, Layout]:
        """Each parameter's DTensor form with ``mesh=`` ([Note: DTensor parameters])."""

    @abc.abstractmethod
    def _dtensor_input_placements(self) -> tuple:
        """The placements a DTensor ``x`` may have ([Note: DTensor inputs])."""

    @abc.abstractmethod
    def _config_fields(self) -> tuple:
        """``((name, value), ...)``: the layer's own construction arguments that every rank must
        share (sizes, activation, bias, sequence parallelism...); :meth:`_config_table` adds the
        rest ([Note: layer config] in ``planning/cross_checks.py``)."""

    def _check_pin(self, plan: TilePlan) -> None:
        """The layer's limits of a pinned plan (ValueError); by default batch tiles over NCCL."""
        if plan.decomposition != Decomposition.BATCH or plan.transport != Transport.NCCL:
            raise ValueError(f"plan: {type(self).__name__} runs batch tiles over NCCL only (decomposition='batch', "
                             f"transport='nccl'); got decomposition={plan.decomposition!r}, "
                             f"transport={plan.transport!r}")

    def _rank_candidates(self, cm, batch: list, *, training: bool) -> list:
        """Candidates split by source rank, beside the batch-tile ``batch``; none by default."""
        return []

    def _predicted_timelines(self, cm, plan: TilePlan, save: bool) -> dict:
        """The timelines the planner scored ``plan`` by (forward, and backward when ``save``)."""
        return cm.timelines(self._programs, plan.num_tiles, plan.regather, plan.buckets_fwd, plan.buckets_bwd, save)

    # ----------------------------------------------------------------- the agreement
    def _config_table(self) -> tuple:
        """``((name, value), ...)`` every rank must share ([Note: layer config] in
        ``planning/cross_checks.py``): the class, :meth:`_config_fields`, the weights' dtype,
        ``num_tiles``, the ``config`` fields but ``cache_dir``, and ``_config_context``."""
        return config_table(self, self._config_fields())

    def _config_digest(self) -> int:
        """The digest of :meth:`_config_table` that the call's agreement compares (kept by the
        planner for the next call whose table is equal: its repr costs more than the comparison)."""
        table, last = self._config_table(), self.planner.config_digest
        if last is None or last[0] != table:
            last = self.planner.config_digest = (table, config_digest(table))
        return last[1]

    def _floor(self) -> tuple:
        """Ints this rank adds to its agreement row whose minimum over the ranks (not equality)
        is what counts, e.g. whether this rank could use a transport; none by default."""
        return ()

    def _after_agreement(self, floor: tuple, capturing: bool) -> None:
        """Run on every rank once a call's (or warm-up's) agreement has passed, from agreed values
        only (``floor``: the minimum of :meth:`_floor` over the ranks; ``capturing``: the call is
        being captured); nothing by default."""

    def _agreed_shape(self, shape: tuple, table) -> tuple:
        """The shape planning uses: this rank's (equal on every rank once agreed); a layer whose
        ranks hold different token counts derives one from the gathered ``table`` instead."""
        return shape

    # ----------------------------------------------------------------- calls
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

    def _graphed_run(self, run, shape: tuple, dtype: torch.dtype, save: bool):
        """What ``config.graph_calls`` captures of a call whose plan is settled (its signature as
        ``run``'s), or None where the call must run eagerly ([Note: graph calls]): ``run`` itself
        by default. From agreed values and the call history only, so every rank takes the same
        branch."""
        return run

    def _graph_signature(self) -> tuple:
        """What a captured call's signature adds to this rank's inputs' shapes so that it is the
        same on every rank ([Note: graph calls]): nothing by default (every rank's inputs are
        agreed equal)."""
        return ()

    def _graph_stage(self, plan: TilePlan, t: torch.Tensor, role: str) -> Optional[torch.Tensor]:
        """Where a graph of ``plan``'s calls keeps the static tensor standing for ``t`` (``role``:
        "input", "training_input" or "output_grad"); None: a tensor of its own ([Note: staged
        input] in ``planning/call_graphs.py``)."""
        return None

    def _compiled_extras(self, *args, **kwargs) -> Optional[list]:
        """The call's other arguments as the compiled op's tensor list, or None if it cannot take
        them ([Note: compiled calls]); none by default."""
        return [] if not args and not kwargs else None

    def _compiled_kwargs(self, extras) -> dict:
        """The keyword arguments of ``forward`` from :meth:`_compiled_extras`' list."""
        return {}

    def _init_caches(self) -> None:
        """Per-call caches of a layer kind, started by its constructor and by a copy; none by
        default."""

    # ----------------------------------------------------------------- the constructor's start and end
    def _init_group(self, config, num_tiles, dtype, group, mesh, axis) -> int:
        """Sets ``config`` and ``num_tiles`` (from ``config=`` and ``num_tiles=``), checks ``dtype=``,
        sets ``group`` (from ``group=`` or ``mesh=`` + ``axis=``), ``world_size`` and ``rank``;
        returns the group's size. ValueError on a bad argument."""
        self.config, self.num_tiles = resolve_config(config, num_tiles)
        check_dtype(dtype)
        self.group = resolve_group(group, mesh, axis)
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        return self.world_size

    def _init_planner(self, mesh, axis) -> None:
        """The constructor's end, once the parameters exist: the layer's planner, its per-call
        caches, initial weights, and with ``mesh=`` its parameters as DTensors."""
        self.launch_log: Optional[list] = None
        self.planner = LayerPlanner(self, self.config)  # plans, agrees and runs each call: planning/planner.py
        self._init_caches()
        self.reset_parameters()
        self._as_dtensors(mesh, axis)

    # ----------------------------------------------------------------- parameters as the compute reads them
    def _local(self, name: str):
        """Parameter ``name`` (or None) as the ``group=`` layout's local tensor the compute uses: the
        parameter itself, or a differentiable local view of its DTensor ([Note: DTensor parameters]),
        through its gradient's sum where the layer has one. Read from ``_parameters`` (where
        ``functional_call`` and the DTensor hooks put their stand-ins too), a dict lookup instead of
        ``nn.Module.__getattr__``'s fallback: every call reads every parameter. Without grad mode
        no sum (nothing records a gradient) and a DTensor's local tensor itself (:func:`local`)."""
        p = self._parameters.get(name)
        view, sums = self._local_views.get(name), self._grad_sums.get(name)
        if sums is None or p is None or not torch.is_grad_enabled():
            return p if view is None else view(p)
        return sums[0](p) if view is None else view(p, reduce=sums[1])

    def _locals_without_grad(self, names: Sequence[str]) -> list:
        """:meth:`_local` of each of ``names`` where grad mode is off, in one pass (a decoding
        step's call reads every parameter: [Note: direct calls] in ``planning/planner.py``)."""
        params, views, out = self._parameters, self._local_views, []
        for name in names:
            p = params.get(name)
            view = None if p is None else views.get(name)
            out.append(p if view is None else view(p))
        return out

    def _call_tensors(self, x: torch.Tensor, names: Sequence[str]):
        """``(x, [parameters])``: ``x`` and the local parameters ``names`` (None stays None) in
        the dtype the call computes in, autocast's on ``x``'s device when it is enabled."""
        params = [self._local(n) for n in names] if torch.is_grad_enabled() else self._locals_without_grad(names)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            cdt = torch.get_autocast_dtype(dev)
            x, params = x.to(cdt), [None if p is None else p.to(cdt) for p in params]
        return x, params

    def _as_dtensors(self, mesh, axis) -> None:
        """With ``mesh=``, hold the parameters as DTensors on the mesh axis (no-op for None)."""
        if mesh is not None:
            as_dtensor_params(self, mesh, axis)

    def __deepcopy__(self, memo: dict):
        """``copy.deepcopy``: [Note: copying a layer] (``planning/copying.py``): a new planner,
        keeping the pinned plan."""
        new = copy_module(self, memo, fresh=("planner",))
        new.planner = LayerPlanner(new, new.config, pinned=copy.deepcopy(self.planner.pinned, memo), warn=False)
        new._init_caches()
        return new

    # ----------------------------------------------------------------- the public planning methods
    @property
    def plan(self) -> Optional[TilePlan]:
        """The plan the last call ran (None before the first call)."""
        return self.planner.plan

    @plan.setter
    def plan(self, plan: Optional[TilePlan]) -> None:
        self.planner.plan = plan

    @property
    def verifying(self) -> bool:
        """True while the first calls of the last shape bucket still time the planned plan
        against K=1 ([Note: first-call verification])."""
        return self.planner.verifying

    def settled_plan(self, shape: tuple, dtype: torch.dtype, save: bool) -> Optional[TilePlan]:
        """The planner's verified plan for a call of ``shape`` (K capped to its tile units), or
        None while the shape is new or being verified, or when the layer's plan is fixed or pinned.
        Changes nothing: the fused block (``layers/block/fused.py``) reads it before the call."""
        return self.planner.settled_plan(shape, dtype, save)

    def pin_plan(self, plan: Optional[TilePlan]) -> None:
        """Use ``plan`` for every call (its tile count is capped by the layer's tile units); None
        unpins. Pin the same plan on every rank: it is checked across ranks at each call."""
        self.planner.pin(plan)

    def warmup(self, shapes, dtype: Optional[torch.dtype] = None, training: bool = True) -> list:
        """Plan ahead for each ``(batch, seq_local)`` in ``shapes`` (and calibrate, on CUDA), as the
        first call for each would; returns the plans. A collective: call it on every rank with the
        same arguments (checked; a mismatch raises ValueError on every rank). No-op (returns [])
        unless ``num_tiles="auto"`` and no plan is pinned. First-call verification still happens
        on the first real calls."""
        return self.planner.warmup(shapes, dtype, training)

    def explain(self) -> str:
        """The last call's plan as a text table of the candidates the planner compared."""
        return self.planner.explain()

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
        self.planner.export_trace(path, measured)
