"""Probe: the per-layer benchmark (same arguments as ``python -m overlap_layers.bench``) with
every GEMM of the process on cuBLASLt and an SM carveout, to see how much NCCL kernels beside
the GEMMs gain when the GEMMs leave SMs free.

Environment: ``PROBE_BLAS`` (``cublaslt`` or ``cublas``: ``torch.backends.cuda.preferred_blas_library``),
``PROBE_CARVEOUT`` (SMs the GEMMs leave free: ``torch._C._set_sm_carveout_experimental``; it
applies to cuBLASLt GEMMs only). Both apply to every mode, the compute-only reference included.

    NCCL_P2P_DISABLE=1 PROBE_BLAS=cublaslt PROBE_CARVEOUT=16 torchrun --nproc-per-node 2 \\
        bench/sm_carveout_probe.py --preset llama3-8b --tp 2 --transport nccl --modes naive,compute
"""
import os

import torch

from overlap_layers.bench.cli import main

if os.environ.get("PROBE_BLAS"):
    torch.backends.cuda.preferred_blas_library(os.environ["PROBE_BLAS"])
if os.environ.get("PROBE_CARVEOUT"):
    torch._C._set_sm_carveout_experimental(int(os.environ["PROBE_CARVEOUT"]))

main()
