"""The hardware side of the cost model: how long a GEMM, a memory-bound op or a collective takes.

Reference: a GEMM of ``m x n x k`` takes ``gemm_fixed_ms + 2*m*n*k / (gemm_tflops * 1e9)`` ms
unless a measured time is known; a memory-bound op moving ``b`` bytes takes
``launch_ms + b / (mem_gbps * 1e6)`` ms; a collective of kind ``c`` over ``b`` bytes (the gathered
output of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce, the input of
an all-to-all) takes ``alpha_ms[c] + b / (gbps[c] * 1e6)`` ms. While an SM-based collective runs,
compute is ``interference`` times slower. Every host launch costs ``launch_ms``.

Numbers come from :func:`analytic_model` (nominal peaks) or from calibration on the device;
either way every rank must hold identical numbers before planning (see [Note: agreement]).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Tuple

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class HardwareModel:
    gemm_tflops: float
    gemm_fixed_ms: float
    mem_gbps: float
    launch_ms: float
    interference: float
    comm: Mapping[str, Tuple[float, float]]  # kind -> (alpha_ms, GB/s)
    gemm_measured: Mapping[Tuple[int, int, int], float] = field(default_factory=dict)

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

    def with_gemms(self, measured: Mapping[Tuple[int, int, int], float]) -> "HardwareModel":
        merged: Dict[Tuple[int, int, int], float] = dict(self.gemm_measured)
        merged.update(measured)
        return replace(self, gemm_measured=merged)

    def as_row(self) -> Tuple[float, ...]:
        """The scalar numbers, in a fixed order (for reducing across ranks)."""
        return (self.gemm_tflops, self.gemm_fixed_ms, self.mem_gbps, self.launch_ms, self.interference,
                *[x for kind in COMM_KINDS for x in self.comm[kind]])

    @classmethod
    def from_row(cls, row, gemm_measured: Optional[Mapping] = None) -> "HardwareModel":
        row = list(row)
        comm = {kind: (row[5 + 2 * i], row[6 + 2 * i]) for i, kind in enumerate(COMM_KINDS)}
        return cls(*row[:5], comm=comm, gemm_measured=dict(gemm_measured or {}))


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
