#!/usr/bin/env bash
# The MLP grid at TP 2 and 4 (llama3-8b, llama3-70b; fwd and fwd+bwd; K=1,2,4 and auto) on a
# 4-GPU machine, over NVLink ("nvlink") and/or with NCCL_P2P_DISABLE=1 ("p2p": a PCIe-class path,
# asynctp left out), then the planner fidelity report. "nvlink" also runs the test suite first
# (CPU tiers + CUDA tier), since this machine is the only place the CUDA paths are tested.
# Usage, from the repo root: bash bench/gpu_mlp.sh OUTDIR [nvlink|p2p|all]
set -uo pipefail
NPROC=${NPROC:-4}       # ranks; TPS: the group sizes of the grid (NPROC=8 TPS=8 on an 8-GPU machine)
TPS=${TPS:-"4 2"}
OUT=${1:-bench/results}
PART=${2:-all}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
GRID="--preset llama3-8b llama3-70b --tp $TPS --naive-k 2 4"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -4
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ "$PART" != p2p ]; then
  python3 -m pytest -q tests 2>&1 | tail -40 > "$OUT/pytest.log"; tail -3 "$OUT/pytest.log"
  torchrun --nproc-per-node $NPROC -m overlap_layers.bench $GRID --out "$OUT/mlp_nvlink.json" 2>&1 \
    | grep -v "^W1\|Warning\|warn" > "$OUT/bench_nvlink.log"
  grep -A100 "^preset" "$OUT/bench_nvlink.log" || tail -30 "$OUT/bench_nvlink.log"
  python3 -m overlap_layers.bench.report "$OUT/mlp_nvlink.json" | tee "$OUT/report_nvlink.md" | tail -5
fi
if [ "$PART" != nvlink ]; then
  NCCL_P2P_DISABLE=1 torchrun --nproc-per-node $NPROC -m overlap_layers.bench $GRID \
    --modes serial,naive,auto,compute,comm --out "$OUT/mlp_p2p_disabled.json" 2>&1 \
    | grep -v "^W1\|Warning\|warn" > "$OUT/bench_p2p_disabled.log"
  grep -A100 "^preset" "$OUT/bench_p2p_disabled.log" || tail -30 "$OUT/bench_p2p_disabled.log"
  python3 -m overlap_layers.bench.report "$OUT/mlp_p2p_disabled.json" | tee "$OUT/report_p2p.md" | tail -5
fi
