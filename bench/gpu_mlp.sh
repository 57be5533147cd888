#!/usr/bin/env bash
# The MLP grid (and with LAYERS=..., the attention's and the block's; llama3-8b, llama3-70b; fwd and
# fwd+bwd; K=1, the naive Ks, the rank-chunk plans
# over NCCL and the copy engine, and auto) at the group sizes TPS, over NVLink ("nvlink") and/or
# with NCCL_P2P_DISABLE=1 ("p2p": a PCIe-class path; asynctp and the copy engine left out, since
# symmetric memory would still use NVLink), then the planner fidelity report and the rows against
# the targets (bench.targets). "nvlink" also runs
# the test suite after its grid (bench/gpu_tests.sh: four shards, about 3 min), since this machine
# is the only place the CUDA paths are tested.
# Usage, from the repo root: bash bench/gpu_mlp.sh OUTDIR [nvlink|p2p|all]
set -uo pipefail
NPROC=${NPROC:-4}       # ranks; TPS: the group sizes of the grid (NPROC=8 TPS=8 on an 8-GPU machine)
TPS=${TPS:-"4 2"}
NAIVE=${NAIVE:-"2 4"}
LAYERS=${LAYERS:-mlp}   # e.g. LAYERS=mlp,attention,block: the same grid for each (one JSON)
EXTRA=${EXTRA:-}        # more bench flags for every run, e.g. EXTRA=--graph-calls (the layers replay their calls)
OUT=${1:-bench/results}
PART=${2:-all}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
GRID="--layer $LAYERS --preset llama3-8b llama3-70b --tp $TPS --naive-k $NAIVE $EXTRA"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -4
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ "$PART" != p2p ]; then
  torchrun --nproc-per-node $NPROC -m overlap_layers.bench $GRID --out "$OUT/mlp_nvlink.json" 2>&1 \
    | grep -v "^W1\|Warning\|warn" > "$OUT/bench_nvlink.log"
  grep -A100 "^layer" "$OUT/bench_nvlink.log" || tail -30 "$OUT/bench_nvlink.log"
  python3 -m overlap_layers.bench.report "$OUT/mlp_nvlink.json" > "$OUT/report_nvlink.md"; tail -5 "$OUT/report_nvlink.md"
  python3 -m overlap_layers.bench.targets "$OUT/mlp_nvlink.json" > "$OUT/targets_nvlink.md"; tail -3 "$OUT/targets_nvlink.md"
  bash bench/gpu_tests.sh "$OUT"
fi
if [ "$PART" != nvlink ]; then
  NCCL_P2P_DISABLE=1 torchrun --nproc-per-node $NPROC -m overlap_layers.bench $GRID \
    --modes serial,naive,auto,rank,compute,comm --transport nccl --out "$OUT/mlp_p2p_disabled.json" 2>&1 \
    | grep -v "^W1\|Warning\|warn" > "$OUT/bench_p2p_disabled.log"
  grep -A100 "^layer" "$OUT/bench_p2p_disabled.log" || tail -30 "$OUT/bench_p2p_disabled.log"
  python3 -m overlap_layers.bench.report "$OUT/mlp_p2p_disabled.json" > "$OUT/report_p2p.md"; tail -5 "$OUT/report_p2p.md"
  python3 -m overlap_layers.bench.targets "$OUT/mlp_p2p_disabled.json" > "$OUT/targets_p2p.md"; tail -3 "$OUT/targets_p2p.md"
fi
