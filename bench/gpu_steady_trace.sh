#!/usr/bin/env bash
# Steady-state traces of the llama3-70b MLP fwd+bwd at TP 4 (rank chunks over the copy engine,
# naive K=2, compute-only) with 12 calls per trace, while nvidia-smi samples SM clocks and power
# every 100 ms: tells apart the two guesses for why rank_ce ran 23.2 ms per call over 3 profiled
# calls and 27.9 in the timed loop (bench/results/tp4_grid_h200x4_2026-11-26.md).
# Usage, from the repo root on a 4-GPU machine: bash bench/gpu_steady_trace.sh OUTDIR
set -uo pipefail
OUT=${1:-bench/results}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu --format=csv -lms 100 > "$OUT/clocks.csv" &
SMI=$!
torchrun --nproc-per-node 4 -m overlap_layers.bench --preset llama3-70b --tokens 16384 --tp 4 --passes fwdbwd \
  --naive-k 2 --modes naive,rank_ce,compute,comm --profile /tmp/steady --profile-calls 12 \
  --out "$OUT/mlp_steady.json" 2>&1 | grep -v "^W1\|Warning\|warn" | grep -A12 "^layer"
kill $SMI
tar czf "$OUT/steady_traces.tgz" -C /tmp steady
