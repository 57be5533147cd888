"""Layer configuration (a frozen dataclass: identical on every rank by construction)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union


class PlanVariant(str, enum.Enum):
    """A string-valued choice of a plan or config: its members are the strings themselves (equal,
    hashed, formatted and shown as their values, so a plain string works wherever a member does,
    and a plan's ``repr`` and digest read as before)."""

    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__

    @classmethod
    def coerce(cls, value):
        """The member equal to ``value``, or ``value`` unchanged where none is (a check reports it)."""
        for member in cls:
            if value == member.value:
                return member
        return value


class Transport(PlanVariant):
    """How rank-chunk plans exchange rows: ``AUTO`` (``OverlapConfig`` only: the planner may use
    the copy engine where every rank can), ``NCCL`` (send/recv), ``COPY_ENGINE`` (symmetric memory,
    CUDA)."""

    AUTO = "auto"
    NCCL = "nccl"
    COPY_ENGINE = "copy_engine"


class Decomposition(PlanVariant):
    """How a plan splits a call: ``BATCH`` tiles (K batch tiles; K=1 the serial plan) or ``RANK``
    chunks (rows split by source rank)."""

    BATCH = "batch"
    RANK = "rank"


TRANSPORTS = tuple(t.value for t in Transport)


def check_positive_int(value, name: str, none_ok: bool = False) -> None:
    """ValueError unless ``value`` is a positive int (not a bool), or None where ``none_ok``."""
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; must be {'None or ' if none_ok else ''}a positive int")


def check_num_tiles(num_tiles, name: str = "num_tiles") -> Union[int, str]:
    """``num_tiles`` must be a positive int or "auto"."""
    if num_tiles == "auto" or (isinstance(num_tiles, int) and not isinstance(num_tiles, bool)
                               and num_tiles >= 1):
        return num_tiles
    raise ValueError(f"{name}={num_tiles!r}; must be a positive int or \"auto\"")


@dataclass(frozen=True)
class OverlapConfig:
    """How a layer tiles and plans.

    ``num_tiles``: a positive int (fixed K) or ``"auto"`` (the planner simulates candidates at
    the first call for each shape bucket and keeps K=1 unless a plan wins by more than ``margin``).
    ``memory_budget``: bytes, or a fraction in (0, 1] of free device memory (min over the group).
    ``measure``: calibrate on the device (CUDA: collectives, GEMMs and memory-bound ops, the
    GEMM slowdown beside NCCL) instead of nominal numbers. ``verify_first_calls``: the first calls
    for a new shape bucket time the planned plan against K=1 and keep the faster
    ([Note: first-call verification] in ``planning/plan_cache.py``). ``cache_dir``: where calibrations
    persist as JSON (None: ``$XDG_CACHE_HOME/overlap_layers`` or ``~/.cache/overlap_layers``).
    ``transport`` (a :class:`Transport`, or its string): how rank-chunk plans exchange rows
    (``OverlapMLP``, ``OverlapAttention`` with sequence parallelism): "auto" lets the planner use
    the copy engine (symmetric memory, CUDA) where every rank can, "nccl" never uses it,
    "copy_engine" plans only copy-engine plans (or K=1); where it is unavailable, or in a layer
    without that path, a warning says so and NCCL runs. ``cuda_graphs``: the layer's calls will be
    replayed from CUDA graphs, so host time does not count: first-call verification then times each
    contender with the call queued ahead of the device, as a replay runs ([Note: CUDA graphs] in
    ``planning/planner.py``). Every layer but ``OverlapMoE`` can be captured once a call of that
    shape has run eagerly, with or without this flag; it only changes what verification measures.
    ``graph_calls``: the layer captures its own eager calls into CUDA graphs, one per call signature
    once its plan is settled, and replays them, forward and (for a call that saves for backward)
    backward: one launch per pass instead of the plan's ~100, which lets an overlapped plan beat the
    serial one on a slow host; verification then measures as with ``cuda_graphs``. Each kept graph
    holds the call's intermediates (training: its saved activations and gradient buffers too; at
    most 8 signatures per layer). No effect off CUDA, in ``OverlapMoE`` and ``UlyssesAttention``,
    under activation checkpointing, or in calls the caller captures ([Note: graph calls] in
    ``planning/call_graphs.py``). ``sm_carveout``: SMs the GEMMs leave free for NCCL kernels in a
    planned pass that overlaps NCCL collectives and whose communication the model predicts to take
    at least half as long as its compute (CUDA; [Note: SM carveout] in ``runtime/carveout.py``).
    None: an eighth of the device's SMs; 0: never. ``check_inputs``: at every call, compare across
    the ranks the inputs that must be equal on every rank (position ids and RoPE tables; ``x``
    where the layer is not sequence parallel) by fingerprints reduced on the device and gathered,
    and raise ValueError on every rank naming the inputs and the ranks that differ; costs two
    reads of those tensors, a device-to-host copy (a sync on CUDA) and a host gather per call
    ([Note: input checks] in ``planning/cross_checks.py``). Calls captured into CUDA graphs are not
    checked.
    """

    num_tiles: Union[int, str] = "auto"
    memory_budget: Optional[Union[int, float]] = None
    margin: float = 0.03
    transport: Transport = Transport.AUTO
    measure: bool = True
    verify_first_calls: bool = True
    cache_dir: Optional[str] = None
    cuda_graphs: bool = False
    graph_calls: bool = False
    sm_carveout: Optional[int] = None
    check_inputs: bool = False

    def __post_init__(self) -> None:
        check_num_tiles(self.num_tiles, "OverlapConfig.num_tiles")
        mb = self.memory_budget
        if mb is not None:
            if isinstance(mb, bool) or not isinstance(mb, (int, float)):
                raise ValueError(f"memory_budget={mb!r}; must be None, bytes (int > 0) or a fraction in (0, 1]")
            if isinstance(mb, float) and not (0.0 < mb <= 1.0):
                raise ValueError(f"memory_budget={mb!r}; a float means a fraction and must be in (0, 1]")
            if isinstance(mb, int) and mb <= 0:
                raise ValueError(f"memory_budget={mb!r}; bytes must be > 0")
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or not (0 <= self.margin < 1):
            raise ValueError(f"margin={self.margin!r}; must be a number in [0, 1)")
        for name in ("cuda_graphs", "graph_calls", "check_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}; must be True or False")
        sc = self.sm_carveout
        if sc is not None and (isinstance(sc, bool) or not isinstance(sc, int) or sc < 0):
            raise ValueError(f"sm_carveout={sc!r}; must be None (an eighth of the device's SMs), 0 (never) "
                             "or a positive number of SMs")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}; valid: {TRANSPORTS}")
        object.__setattr__(self, "transport", Transport(self.transport))
