"""Which tensors the package's Triton kernels take: CUDA tensors where Triton is installed, and
CPU tensors too under Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before the
kernels are defined), where they run on the host, slowly. The interpreter is how CPU-only CI
checks the kernels against their references (``tests/test_triton_interpreted.py``); nothing else
changes where the variable is unset."""
from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # CPU installs: every kernel's torch path
    triton = None

INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_triton(t: torch.Tensor) -> bool:
    """Whether this process's Triton kernels can take ``t``'s device."""
    return triton is not None and (t.is_cuda or (INTERPRETED and t.device.type == "cpu"))


# Below this many elements an elementwise or routing kernel's device time is a few microseconds,
# less than its launch costs the host: Triton's Python launcher takes about as long as five torch
# ops' launches (measured under cProfile on the H200 machine's host, Triton 3.6: docs/measurements.md,
# Host overhead). Calls that small are host-bound, so they take the torch ops instead.
LAUNCH_BOUND_ELEMENTS = 1 << 20


def worth_launching(t: torch.Tensor) -> bool:
    """Whether a kernel over ``t`` pays for its launch's host time (:data:`LAUNCH_BOUND_ELEMENTS`);
    always under the interpreter, which exists to run the kernels."""
    return INTERPRETED or t.numel() >= LAUNCH_BOUND_ELEMENTS
