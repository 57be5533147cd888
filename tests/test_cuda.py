"""Tier 3: CUDA paths (streams, events, NCCL), run on the GPU machine; skipped without GPUs."""
import os

import pytest
import torch

from pool import torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices (the CUDA tier: NCCL, streams, the copy engine)")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_cuda_worker(nprocs):
    if torch.cuda.device_count() < nprocs:
        pytest.skip(f"needs {nprocs} CUDA devices")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = torchrun(nprocs, [os.path.join(here, "cuda_worker.py")], env=env, timeout=600)
    print(proc.stdout[-5000:], proc.stderr[-5000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
