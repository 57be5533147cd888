"""Where the Triton kernel tests run: on CUDA where Triton is installed, else on the CPU under
Triton's interpreter (``test_triton_interpreted.py`` runs them so in CPU-only CI), else nowhere,
with a skip reason that says what is missing and where they run instead."""
import pytest
import torch

from overlap_layers.kernels import triton_gate

if triton_gate.triton is not None and torch.cuda.is_available():
    DEVICE = torch.device("cuda")
elif triton_gate.INTERPRETED:
    DEVICE = torch.device("cpu")
else:
    DEVICE = None

#: Why a kernel test skips here (``DEVICE`` is None): what this process lacks, and where it runs.
SKIP_REASON = ("needs Triton for the CUDA device" if torch.cuda.is_available() else "needs a CUDA device with Triton") \
    + " (runs under Triton's interpreter in tests/test_triton_interpreted.py)"

needs_triton = pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
