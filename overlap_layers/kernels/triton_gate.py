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
