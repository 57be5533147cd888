"""Measuring the cost model's numbers on the device (CUDA), identically on every rank.

Reference: every number is a median of timed repeats (CUDA events, after warm-up) taken on
each rank and then max-reduced over the group through the host-side agreement, so every rank
plans from the same numbers ([Note: agreement]). On CPU nothing is measured: the analytic model
is used.

Each repeat is queued behind a sleep kernel and runs the op ``IN_A_ROW`` times in a row
(:func:`~overlap_layers.runtime.timing.device_ms`), so a number is the device's time for the op,
as in a busy stream or a CUDA graph, without the host's launch latency in it (the cost model adds
launch costs itself). The count is a constant: ops that are collectives (or signal round trips)
must run as many times on every rank, so no rank may derive it from its own timings.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Callable, Dict, Hashable, Iterable, Mapping, Tuple

import torch
import torch.distributed as dist

from ..runtime.collectives import all_gather_single, reduce_scatter_single
from ..runtime.group import Agreement
from ..runtime.timing import beside_ms, device_ms
from ..sim import COMM_KINDS, HardwareModel, analytic_model


def measure_ops(setups: Mapping[Hashable, Callable[[], Callable[[], object]]], agreement: Agreement
                ) -> Dict[Hashable, float]:
    """ms of each op, max over ranks. ``setups[key]()`` allocates the op's inputs and returns the
    callable to time (inputs are freed before the next key). Keys are sorted by their repr so
    every rank reduces the same vector; every rank must pass the same keys."""
    keys = sorted(setups, key=repr)
    return dict(zip(keys, agreement.max([device_ms(setups[k]()) for k in keys])))


def measure_gemms(shapes: Iterable[Tuple[int, int, int]], dtype, device, agreement: Agreement
                  ) -> Dict[Tuple[int, int, int], float]:
    """ms of ``A[m,k] @ B[k,n]`` per shape, max over ranks."""
    def setup(m, n, k):
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        return lambda: torch.mm(a, b)
    return measure_ops({s: (lambda s=s: setup(*s)) for s in set(shapes)}, agreement)


def calibrate(group, device, dtype, agreement: Agreement) -> HardwareModel:
    """Collective alpha/beta from two sizes per kind, and the GEMM slowdown beside an all-gather."""
    base = analytic_model("cuda")
    ws = dist.get_world_size(group)
    elt = torch.tensor([], dtype=dtype).element_size()
    small, large = 1 << 18, 1 << 24  # elements of the full (gathered) buffer
    rows = []
    for kind in COMM_KINDS:
        times = []
        for n in (small, large):
            full = torch.randn((n // 64) // ws * ws, 64, dtype=dtype, device=device)
            part = full[: full.shape[0] // ws].clone()
            if kind == "all_gather":
                fn = lambda full=full, part=part: all_gather_single(full, part, group=group)  # noqa: E731
            elif kind == "reduce_scatter":
                fn = lambda full=full, part=part: reduce_scatter_single(part, full, group=group)  # noqa: E731
            elif kind == "all_reduce":
                fn = lambda full=full: dist.all_reduce(full, group=group)  # noqa: E731
            else:
                fn = lambda full=full: dist.all_to_all_single(torch.empty_like(full), full, group=group)  # noqa: E731
            times.append((full.numel() * elt, device_ms(fn)))
        (b0, t0), (b1, t1) = times
        gbps = (b1 - b0) / max(t1 - t0, 1e-6) / 1e6
        alpha = max(t0 - b0 / (gbps * 1e6), 0.001)
        rows += [alpha, gbps]
    # Interference: a GEMM timed alone, then while all-gathers run from a side stream.
    a = torch.randn(8192, 4096, dtype=dtype, device=device)
    b = torch.randn(4096, 4096, dtype=dtype, device=device)
    full = torch.empty(ws * 4096, 4096, dtype=dtype, device=device)
    part = full[:4096].clone()
    alone = device_ms(lambda: [torch.mm(a, b) for _ in range(8)])
    samples = beside_ms(lambda: [torch.mm(a, b) for _ in range(8)],
                        lambda: [all_gather_single(full, part, group=group, async_op=True) for _ in range(4)], device)
    together = statistics.median(samples[1:])
    flops = 2 * 8192 * 4096 * 4096 * 8
    tflops = flops / (alone * 1e9)
    nums = agreement.max([alone, together, -tflops] + rows)
    alone, together, tflops = nums[0], nums[1], -nums[2]
    comm = {kind: (nums[3 + 2 * i], nums[4 + 2 * i]) for i, kind in enumerate(COMM_KINDS)}
    # Slowdown of compute while comm runs, bounded: the overlap measured is partial.
    interference = min(max(together / alone, 1.0), 3.0)
    return replace(base, gemm_tflops=tflops, interference=interference, comm=comm)
