#!/usr/bin/env bash
# The MoE grid on a 4-GPU machine: mixtral-8x7b and qwen3-30b-a3b, 8192 tokens per rank, EP 4 and
# 2, forward and forward+backward, serial / naive (K=2, 4) / auto / compute-only / comm-only, then
# the same at EP 4 with skewed routing. Runs the test suite first (CPU tiers + CUDA tier, which
# holds the MoE numerics on CUDA).
# Usage, from the repo root: bash bench/gpu_moe.sh OUTDIR [tests|notests]
set -uo pipefail
NPROC=${NPROC:-4}       # ranks; TPS: the group sizes of the grid (NPROC=8 TPS=8 on an 8-GPU machine)
TPS=${TPS:-"4 2"}
OUT=${1:-bench/results}
TESTS=${2:-tests}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
MOE="--layer moe --preset mixtral-8x7b qwen3-30b-a3b --naive-k 2 4 --modes serial,naive,auto,compute,comm"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -4
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ "$TESTS" = tests ]; then
  bash bench/gpu_tests.sh "$OUT"
fi
bench() {  # name, extra args
  local name=$1; shift
  torchrun --nproc-per-node $NPROC -m overlap_layers.bench "$@" --out "$OUT/$name.json" 2>&1 \
    | grep -v "^W1\|Warning\|warn" > "$OUT/bench_$name.log"
  grep -A100 "^layer" "$OUT/bench_$name.log" || tail -30 "$OUT/bench_$name.log"
}
bench moe_nvlink $MOE --tp $TPS
bench moe_skew_nvlink $MOE --tp ${TPS%% *} --skew
for f in moe_nvlink moe_skew_nvlink; do
  python3 -m overlap_layers.bench.report "$OUT/$f.json" > "$OUT/report_$f.md" 2>&1; tail -4 "$OUT/report_$f.md"
  python3 -m overlap_layers.bench.targets "$OUT/$f.json" > "$OUT/targets_$f.md" 2>&1; tail -3 "$OUT/targets_$f.md"
done
