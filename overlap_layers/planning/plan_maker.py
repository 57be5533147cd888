"""How a layer's planner makes the plan of a new shape bucket: the hardware numbers (calibrated on
CUDA, or loaded from the calibration cache; nominal elsewhere), the ops the candidates need
measured, every candidate simulated (:func:`~overlap_layers.planning.candidates.plan_candidates`
and the layer's ``_rank_candidates``), the fastest chosen under the memory budget
(:func:`~overlap_layers.sim.choose`), and the SM carveout of its passes ([Note: SM carveout]).

Reference: every number a plan is made from is identical on every rank (calibrations and
measurements are max-reduced over the group, the free memory min-reduced), so every rank makes
the same plan; the plan cache checks that ([Note: first-call verification]).
"""
from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Optional

import torch

from ..config import Transport
from ..runtime.carveout import carve_passes, carveout_available, default_carveout
from ..sim import analytic_model, choose
from .calibrate import calibrate, measure_gemms, measure_ops
from .calibration_cache import cache_key, cache_path, default_cache_dir, load_agreed, store
from .candidates import plan_candidates
from .plan import TilePlan, plan_of


class PlanMaker:
    """The numbers and the choice behind a layer's plans (module docstring); ``hw`` holds the
    hardware model per dtype once made, ``plan_budget`` the memory budget of the last plan."""

    def __init__(self, layer, agreement) -> None:
        self._layer = weakref.ref(layer)  # the layer owns its planner, which owns this
        self.agreement = agreement
        self.hw: dict = {}
        self.plan_budget: Optional[int] = None

    @property
    def layer(self):
        return self._layer()

    @property
    def config(self):
        """The layer's ``OverlapConfig``."""
        return self.layer.config

    def measuring(self) -> bool:
        return self.layer._weight.device.type == "cuda" and self.config.measure

    def cache_file(self, dtype: torch.dtype):
        layer = self.layer
        key = cache_key(device=layer._weight.device, world_size=layer.world_size, transport="nccl", dtype=dtype)
        return cache_path(self.config.cache_dir or default_cache_dir(), key), key

    def hardware(self, dtype: torch.dtype):
        """The cost model's numbers for ``dtype``: on CUDA with ``measure``, from the calibration
        cache file if every rank's copy is usable and identical, else calibrated (and stored)."""
        if dtype not in self.hw:
            layer = self.layer
            if self.measuring():
                path, key = self.cache_file(dtype)
                hw = load_agreed(path, key, self.agreement)
                if hw is None:
                    hw = calibrate(layer.group, layer._weight.device, dtype, self.agreement)
                    store(path, key, hw)
                self.hw[dtype] = hw
            else:
                self.hw[dtype] = analytic_model(layer._weight.device.type)
        return self.hw[dtype]

    def budget(self) -> Optional[int]:
        """``config.memory_budget`` in bytes (a fraction: of the group's least free device memory)."""
        mb = self.config.memory_budget
        if mb is None or isinstance(mb, int):
            return mb
        device = self.layer._weight.device
        if device.type != "cuda":
            return None  # a fraction of free memory has no meaning for host memory here
        free = torch.cuda.mem_get_info(device)[0]
        return int(self.agreement.min([float(free)])[0] * mb)

    def measure_missing(self, cm, dtype: torch.dtype):
        """Time the GEMMs and other ops the candidates need that the model lacks (max over
        ranks), add them to the model and the cache file."""
        hw, layer = cm.model, self.layer
        gemms = cm.gemm_shapes() - set(hw.gemm_measured)
        setups = {key: fn for key, fn in layer._op_setups(cm, dtype).items() if key not in hw.op_measured}
        if gemms or setups:
            hw = self.hw[dtype] = hw.with_measured(
                gemms=measure_gemms(gemms, dtype, layer._weight.device, self.agreement),
                ops=measure_ops(setups, self.agreement))
            store(*self.cache_file(dtype), hw)
        return hw

    def plain_ms(self, key: tuple, dtype: torch.dtype, save: bool) -> Optional[float]:
        """The plain serial call's device time at plan key ``key`` (forward, and backward when
        ``save``), measured once per shape and kept in the model and its cache file; None where
        the layer has no plain call ([Note: one rank's prediction]).

        [Note: one rank's prediction]
        Reference: at world size 1 the plan is the serial one and its call is the plain torch ops
        of ``layers/common/plain_tp.py`` (MLP, attention) or ``layers/moe/plain.py`` (MoE), with
        nothing to overlap, so its time is the sum of its kernels' times. The simulator's sum of
        modelled ops misses what the plain call runs beside its GEMMs and the tiled core: RoPE
        and head layouts, the MoE's routing, sort, gathers and weighted combine, the GEMMs'
        transposed layouts in backward (measured on one H200: -16% for llama3-8b attention, -29%
        for qwen3-30b-a3b's MoE). So the planner times the plain call itself, on random inputs
        of the key's shape and the layer's own weights (forward; with ``save`` forward and the
        backward into the input and every weight, by ``torch.autograd.grad``, so no ``.grad`` is
        touched), as every measured op: a median of repeats queued behind a sleep kernel, the
        device's time without the host's (``planning/calibrate.py``). That is the serial plan's
        ``predicted_ms``; the simulated timeline (``export_trace``) keeps the per-op model."""
        layer = self.layer
        spec = layer._plain_call(key)
        if spec is None:
            return None
        op = f"plain:{type(layer).__name__}:{key[:-2]}:{layer._config_fields()}:{'fwdbwd' if save else 'fwd'}"
        hw = self.hw[dtype]
        if op not in hw.op_measured:
            shape, call = spec
            hw = self.hw[dtype] = hw.with_measured(ops=measure_ops({op: lambda: _pass(call, shape, dtype, save, layer)},
                                                                   self.agreement))
            store(*self.cache_file(dtype), hw)
        return hw.op_measured[op]

    def make_plan(self, *key) -> TilePlan:
        """The plan of plan key ``key`` (the layer's ``_plan_key``: ending in dtype, save)."""
        layer = self.layer
        dtype, save = key[-2], key[-1]
        cm = layer._cost_model(key, self.hardware(dtype))
        if self.measuring():
            cm.model = self.measure_missing(cm, dtype)
        candidates = plan_candidates(cm, layer._programs, training=save)
        candidates += layer._rank_candidates(cm, candidates, training=save)
        if layer.world_size == 1:  # nothing to hide: the serial plan, with the model's prediction
            candidates = [c for c in candidates if c.is_serial]
            measured = self.plain_ms(key, dtype, save) if self.measuring() else None
            if measured is not None:  # [Note: one rank's prediction]
                candidates = [replace(c, predicted_ms=measured, exposed_comm_ms=0.0) for c in candidates]
        copy_engine = Transport.COPY_ENGINE
        if self.config.transport == copy_engine and any(c.transport == copy_engine for c in candidates):
            candidates = [c for c in candidates if c.is_serial or c.transport == Transport.COPY_ENGINE]
        self.plan_budget = self.budget()
        choice = choose(candidates, budget_bytes=self.plan_budget, margin=self.config.margin)
        carveout = self.carveout(cm, save)
        reason = choice.reason
        if any(carveout):
            reason += "; where batch tiles overlap NCCL, GEMMs leave " + " and ".join(
                f"{n} SMs free in the {p}" for n, p in zip(carveout, ("forward", "backward")) if n) + \
                " (communication at least half the compute)"
        return plan_of(choice.candidate, reason=reason, candidates=choice.candidates, carveout=carveout,
                       num_streams=layer._plan_streams)

    def carveout(self, cm, save: bool) -> tuple:
        """``(forward, backward)`` SMs the GEMMs leave free where a plan overlaps NCCL collectives
        with them ([Note: SM carveout]): ``config.sm_carveout`` (None: :func:`default_carveout`) in
        each pass whose serial timeline (the cost model's) has enough communication for it
        (:func:`carve_passes`); 0 in the others. Nothing off CUDA, with ``sm_carveout=0``, or where
        this torch cannot carve SMs out. From the agreed model, so equal on every rank."""
        dev, sms = self.layer._weight.device, self.config.sm_carveout
        if dev.type != "cuda" or sms == 0 or not carveout_available():
            return ()
        total = torch.cuda.get_device_properties(dev).multi_processor_count
        if sms is None:
            sms = default_carveout(total)
        elif sms >= total:
            raise ValueError(f"sm_carveout={sms}: this device has {total} SMs; leave fewer free")
        return carve_passes(self.serial_timelines(cm, save), sms)

    def serial_timelines(self, cm, save: bool) -> dict:
        """The cost model's K=1 timelines of the layer's passes (forward; backward when ``save``)."""
        return cm.timelines(self.layer._programs, 1, False, (), (), save)


def _pass(call, shape: tuple, dtype: torch.dtype, save: bool, layer):
    """The callable :meth:`PlanMaker.plain_ms` times: ``call`` on a random ``x`` of ``shape``,
    and with ``save`` its backward into ``x`` and the layer's trainable parameters."""
    x = torch.randn(shape, dtype=dtype, device=layer._weight.device)
    if not save:
        def forward():
            with torch.no_grad():
                call(x)
        return forward
    x.requires_grad_()
    params = [p for p in layer.parameters() if p.requires_grad]
    dy = torch.randn(shape, dtype=dtype, device=x.device)

    def forward_backward():
        with torch.enable_grad():
            torch.autograd.grad(call(x), [x, *params], dy, allow_unused=True)
    return forward_backward
