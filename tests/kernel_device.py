"""Where the Triton kernel tests run: on CUDA where Triton is installed, else on the CPU under
Triton's interpreter (``test_triton_interpreted.py`` runs them so in CPU-only CI), else nowhere."""
import pytest
import torch

from overlap_layers.kernels import triton_gate

if triton_gate.triton is not None and torch.cuda.is_available():
    DEVICE = torch.device("cuda")
elif triton_gate.INTERPRETED:
    DEVICE = torch.device("cpu")
else:
    DEVICE = None

needs_triton = pytest.mark.skipif(DEVICE is None, reason="needs CUDA and Triton, or Triton's interpreter "
                                                         "(TRITON_INTERPRET=1)")
