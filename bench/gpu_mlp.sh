#!/usr/bin/env bash
# One device call: the test suite (CPU tiers + CUDA tier) and the MLP grid at TP 2 and 4,
# over NVLink and with NCCL_P2P_DISABLE=1 (a PCIe-class path; asynctp left out there).
# Usage (on a 4-GPU machine, from the repo root): bash bench/gpu_mlp.sh OUTDIR
set -uo pipefail
OUT=${1:-bench/results}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -4
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
python3 -m pytest -q tests 2>&1 | tail -40 > "$OUT/pytest.log"; tail -3 "$OUT/pytest.log"
torchrun --nproc-per-node 4 -m overlap_layers.bench --preset llama3-8b llama3-70b --tp 4 2 --naive-k 2 4 \
  --out "$OUT/mlp_nvlink.json" 2>&1 | grep -v "^W1\|Warning\|warn" > "$OUT/bench_nvlink.log"
NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 4 -m overlap_layers.bench --preset llama3-8b llama3-70b --tp 4 2 --naive-k 2 4 \
  --modes serial,naive,auto,compute,comm --out "$OUT/mlp_p2p_disabled.json" 2>&1 \
  | grep -v "^W1\|Warning\|warn" > "$OUT/bench_p2p_disabled.log"
for f in bench_nvlink bench_p2p_disabled; do grep -A100 "^preset" "$OUT/$f.log" || tail -30 "$OUT/$f.log"; done
