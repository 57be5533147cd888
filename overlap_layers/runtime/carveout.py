"""GEMMs that leave SMs free for the NCCL kernels beside them.

[Note: SM carveout]
NCCL collectives are kernels: beside a GEMM that fills every SM they get SMs only as the GEMM's
blocks retire, and a collective whose kernel runs long (a slow link: NCCL over host memory with
``NCCL_P2P_DISABLE=1``) then runs much slower than alone. GEMMs that leave some SMs free
(cuBLASLt's SM count target, which PyTorch sets from ``torch._C._set_sm_carveout_experimental``;
the plain cuBLAS path ignores it) each run somewhat slower, but the collectives beside them run
at their own speed, which pays where communication is a large share of the pass (over host
memory) and costs where NCCL's kernels are short (NVLink) or communication is a small share.
Measured: see docs/measurements.md (P2P off, SM carveout).

So a planned layer carves SMs out only in a pass whose communication is predicted to take at
least :data:`COMM_SHARE` of its compute (the cost model's serial timeline of that pass), only while it
overlaps NCCL collectives with its GEMMs (K > 1 batch tiles), and only for that pass's GEMMs
(:func:`gemm_sm_carveout`: cuBLASLt and the carveout set for the pass, both restored after).
It changes no collective. The attention core (cuDNN) and other non-GEMM kernels ignore it.
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch

COMM_SHARE = 0.5  # a pass carves where its communication is at least this share of its compute


def carveout_available() -> bool:
    """Whether this torch can make its GEMMs leave SMs free."""
    return hasattr(torch._C, "_set_sm_carveout_experimental") and hasattr(torch.backends.cuda, "preferred_blas_library")


def default_carveout(device_sms: int) -> int:
    """The SMs a GEMM beside slow NCCL collectives leaves free by default, of a device's
    ``device_sms``: an eighth (16 of 132 on H100/H200, the best of 8, 16 and 32 there: see
    docs/measurements.md, P2P off)."""
    return device_sms // 8


def carve_passes(timelines: Mapping, sms: int) -> tuple:
    """``(forward, backward)`` SMs to leave free from the serial ``timelines`` of a plan's passes
    (``{"forward": Timeline, "backward": Timeline}``, the backward optional): ``sms`` in a pass
    whose comm stream is busy at least :data:`COMM_SHARE` as long as its compute streams together,
    0 in the others; ``()`` where no pass is."""
    out = []
    for name in ("forward", "backward"):
        busy = timelines[name].stream_busy_ms if name in timelines else {}
        comm = sum(ms for stream, ms in busy.items() if stream == "comm")
        compute = sum(ms for stream, ms in busy.items() if stream != "comm")
        out.append(sms if comm >= COMM_SHARE * compute > 0 else 0)
    return tuple(out) if any(out) else ()


def gemm_sm_carveout(sms: int):
    """A context within which GEMMs go through cuBLASLt and leave ``sms`` SMs free (0: no change,
    and nothing to enter on the call's path); both settings are process-wide in PyTorch and are
    restored on exit. (PyTorch prints a one-time line calling the carveout experimental.)"""
    return _carved(sms) if sms else contextlib.nullcontext()


@contextlib.contextmanager
def _carved(sms: int):
    blas, before = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(sms)
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)
        torch.backends.cuda.preferred_blas_library(blas)
