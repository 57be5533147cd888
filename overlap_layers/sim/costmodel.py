"""The hardware side of the cost model: how long a GEMM, a memory-bound op or a collective takes.

Reference: a GEMM of ``m x n x k`` takes ``gemm_fixed_ms + 2*m*n*k / (gemm_tflops * 1e9)`` ms
unless a measured time is known; a memory-bound op moving ``b`` bytes takes
``launch_ms + b / (mem_gbps * 1e6)`` ms unless a time was measured under the op's key (a string a
layer chooses, e.g. ``"act:swiglu:16384x3584"``); a collective of kind ``c`` over ``b`` bytes (the gathered
output of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce, the input of
an all-to-all) takes ``alpha_ms[c] + b / (gbps[c] * 1e6)`` ms. While an SM-based collective runs,
compute is ``interference`` times slower. Every host launch costs ``launch_ms``.

Numbers come from :func:`analytic_model` (nominal peaks) or from calibration on the device;
either way every rank must hold identical numbers before planning (see [Note: agreement]).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Mapping, Optional, Tuple

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

# The scalar fields of HardwareModel in JSON, each with its lower bound and whether the bound is
# inclusive (a time may be 0, a rate may not; interference is a slowdown, so at least 1).
_JSON_SCALARS = (("gemm_tflops", 0.0, False), ("gemm_fixed_ms", 0.0, True), ("mem_gbps", 0.0, False),
                 ("launch_ms", 0.0, True), ("interference", 1.0, True))
_JSON_FIELDS = frozenset(name for name, _, _ in _JSON_SCALARS) | {"comm", "gemm_measured", "op_measured"}
_GEMM_KEY = re.compile(r"[1-9][0-9]{0,17},[1-9][0-9]{0,17},[1-9][0-9]{0,17}")


@dataclass(frozen=True)
class HardwareModel:
    gemm_tflops: float
    gemm_fixed_ms: float
    mem_gbps: float
    launch_ms: float
    interference: float
    comm: Mapping[str, Tuple[float, float]]  # kind -> (alpha_ms, GB/s)
    gemm_measured: Mapping[Tuple[int, int, int], float] = field(default_factory=dict)
    op_measured: Mapping[str, float] = field(default_factory=dict)  # memory-bound ops by a layer's key

    def gemm_ms(self, m: int, n: int, k: int) -> float:
        got = self.gemm_measured.get((m, n, k))
        if got is not None:
            return got
        return self.gemm_fixed_ms + 2.0 * m * n * k / (self.gemm_tflops * 1e9)

    def mem_ms(self, nbytes: int) -> float:
        return self.launch_ms + nbytes / (self.mem_gbps * 1e6)

    def comm_ms(self, kind: str, nbytes: int) -> float:
        alpha, gbps = self.comm[kind]
        return alpha + nbytes / (gbps * 1e6)

    def op_ms(self, key: str, nbytes: int) -> float:
        """A memory-bound op: its measured time under ``key`` if known, else :meth:`mem_ms`."""
        got = self.op_measured.get(key)
        return got if got is not None else self.mem_ms(nbytes)

    def with_measured(self, gemms: Mapping[Tuple[int, int, int], float] = None,
                      ops: Mapping[str, float] = None) -> "HardwareModel":
        """This model plus measured GEMM times (by shape) and memory-bound op times (by key)."""
        return replace(self, gemm_measured={**self.gemm_measured, **(gemms or {})},
                       op_measured={**self.op_measured, **(ops or {})})

    def as_row(self) -> Tuple[float, ...]:
        """The scalar numbers, in a fixed order (for reducing across ranks)."""
        return (self.gemm_tflops, self.gemm_fixed_ms, self.mem_gbps, self.launch_ms, self.interference,
                *[x for kind in COMM_KINDS for x in self.comm[kind]])

    def to_json(self) -> Dict[str, Any]:
        """This model as plain JSON types; :meth:`from_json` gives an equal model back.

        ``gemm_measured`` keys become ``"m,n,k"`` strings (sorted by shape) and ``comm`` becomes
        ``{kind: [alpha_ms, gbps]}``. Values are not checked here; :meth:`from_json` checks them."""
        out: Dict[str, Any] = {name: float(getattr(self, name)) for name, _, _ in _JSON_SCALARS}
        out["comm"] = {kind: [float(alpha), float(gbps)] for kind, (alpha, gbps) in self.comm.items()}
        out["gemm_measured"] = {f"{int(m)},{int(n)},{int(k)}": float(ms)
                                for (m, n, k), ms in sorted(self.gemm_measured.items())}
        out["op_measured"] = {str(key): float(ms) for key, ms in sorted(self.op_measured.items())}
        return out

    @classmethod
    def from_json(cls, d: Any) -> "HardwareModel":
        """The model that :meth:`to_json` wrote as ``d``; raises ValueError (and nothing else) on
        anything malformed: a missing or unknown field, a value that is not a finite number, a rate
        or time outside its range (rates and measured GEMM times > 0, ``gemm_fixed_ms``,
        ``launch_ms`` and alphas >= 0, ``interference`` >= 1), ``comm`` without exactly the kinds
        of ``COMM_KINDS``, or a ``gemm_measured`` key that is not ``"m,n,k"`` of positive ints."""
        d = _json_object(d, "d")
        missing, unknown = sorted(_JSON_FIELDS - d.keys()), sorted(d.keys() - _JSON_FIELDS)
        if missing or unknown:
            raise ValueError(f"d must have exactly the fields {sorted(_JSON_FIELDS)}; "
                             f"missing {missing}, unknown {unknown}")
        scalars = {name: _json_number(d[name], f"d[{name!r}]", low, inclusive)
                   for name, low, inclusive in _JSON_SCALARS}
        ops = _json_object(d["op_measured"], "d['op_measured']")
        return cls(**scalars, comm=_comm_from_json(d["comm"]),
                   gemm_measured=_gemms_from_json(d["gemm_measured"]),
                   op_measured={key: _json_number(ms, f"d['op_measured'][{key!r:.80}]", 0.0, False)
                                for key, ms in ops.items()})

    @classmethod
    def from_row(cls, row, gemm_measured: Optional[Mapping] = None) -> "HardwareModel":
        row = list(row)
        comm = {kind: (row[5 + 2 * i], row[6 + 2 * i]) for i, kind in enumerate(COMM_KINDS)}
        return cls(*row[:5], comm=comm, gemm_measured=dict(gemm_measured or {}))


def _json_object(value: Any, where: str) -> Dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{where} must be a JSON object (a dict with str keys), got {type(value).__name__}")
    return value


def _json_number(value: Any, where: str, low: float, inclusive: bool) -> float:
    """``value`` as a finite float that is >= ``low`` (``inclusive``) or > ``low``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {type(value).__name__}")
    try:
        x = float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"{where} must be a finite number, got an int of {value.bit_length()} bits") from None
    ok = math.isfinite(x) and (x >= low if inclusive else x > low)
    if not ok:
        raise ValueError(f"{where} must be finite and {'>=' if inclusive else '>'} {low:g}, got {x!r}")
    return x


def _comm_from_json(value: Any) -> Dict[str, Tuple[float, float]]:
    comm = _json_object(value, "d['comm']")
    missing, unknown = sorted(set(COMM_KINDS) - comm.keys()), sorted(comm.keys() - set(COMM_KINDS))
    if missing or unknown:
        raise ValueError(f"d['comm'] must have exactly the kinds {list(COMM_KINDS)}; "
                         f"missing {missing}, unknown {unknown}")
    out = {}
    for kind in COMM_KINDS:
        pair = comm[kind]
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"d['comm'][{kind!r}] must be a list [alpha_ms, gbps], got {type(pair).__name__}"
                             + (f" of length {len(pair)}" if isinstance(pair, (list, tuple)) else ""))
        out[kind] = (_json_number(pair[0], f"d['comm'][{kind!r}][0] (alpha_ms)", 0.0, True),
                     _json_number(pair[1], f"d['comm'][{kind!r}][1] (gbps)", 0.0, False))
    return out


def _gemm_shape(key: str) -> Tuple[int, int, int]:
    """``"m,n,k"`` as a tuple. Only canonical decimals > 0 (no sign, no leading zero, at most 18
    digits) are accepted, so that two keys cannot name the same GEMM."""
    if not _GEMM_KEY.fullmatch(key):
        raise ValueError(f"d['gemm_measured'] keys must be 'm,n,k' of positive integers, got {key!r:.80}")
    m, n, k = (int(p) for p in key.split(","))
    return m, n, k


def _gemms_from_json(value: Any) -> Dict[Tuple[int, int, int], float]:
    gemms = _json_object(value, "d['gemm_measured']")
    return {_gemm_shape(key): _json_number(ms, f"d['gemm_measured'][{key!r:.80}]", 0.0, False)
            for key, ms in gemms.items()}


def analytic_model(device_type: str) -> HardwareModel:
    """Nominal numbers when nothing was measured: a Hopper GPU over NCCL/NVLink, or a CPU with gloo.

    On CUDA the interference factor defaults to 1.3 (NCCL kernels taking SMs from GEMMs), so
    that tiling must win clearly before the planner picks it."""
    if device_type == "cuda":
        return HardwareModel(gemm_tflops=600.0, gemm_fixed_ms=0.01, mem_gbps=2500.0, launch_ms=0.006,
                             interference=1.3,
                             comm={k: (0.02, 120.0) for k in COMM_KINDS})
    return HardwareModel(gemm_tflops=0.05, gemm_fixed_ms=0.01, mem_gbps=10.0, launch_ms=0.01, interference=1.0,
                         comm={k: (0.3, 1.0) for k in COMM_KINDS})
