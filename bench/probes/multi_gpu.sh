#!/usr/bin/env bash
# The multi-GPU proof in one device call per machine kind: the whole-model training step (every
# variant side by side) and the per-layer grid (the reference mode, one graph treatment for every
# mode), over NVLink and with NCCL_P2P_DISABLE=1, then the GPU tests. Results go to OUTDIR under
# their stable names (bench/results/README.md); copy the ones to keep into bench/results/.
#   bash bench/probes/multi_gpu.sh OUTDIR [GPUS]    # GPUS: 4 (default) or 2
#   DRY=1 bash bench/probes/multi_gpu.sh OUTDIR 2   # on CPU: the same commands, 2 gloo ranks, tiny shapes
# Each step's time limit is STEP_S (default 300 s); a step that fails or runs out is reported and
# the script goes on, so one call yields every result it can.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/out}}; N=${2:-4}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
STEP_S=${STEP_S:-300}
day=$(date -u +%F)
if [ "${DRY:-0}" = 1 ]; then
  launch=(python -m)                      # the modules start N gloo ranks themselves (--nprocs)
  ranks=(--nprocs "$N"); small=(--preset tiny --steps 1 --warmup 1); grid=(--preset tiny --iters 1 --repeats 1)
  kind="cpux$N"
else
  launch=(torchrun --standalone --nproc-per-node "$N" -m)
  ranks=(); small=(--batch 2 --seq 8192 --steps 10 --warmup 5 --no-progress); grid=()
  kind="h200x$N"
fi

step() {  # step NAME command...: run with the time limit, report how it ended
  local name=$1; shift
  timeout "$STEP_S" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? ($(tail -1 "$OUT/$name.log" | cut -c1-120))"
}

for link in nvlink p2poff; do
  if [ "$link" = p2poff ]; then export NCCL_P2P_DISABLE=1; transport=(--transport nccl); else
    unset NCCL_P2P_DISABLE; transport=(); fi
  # 1. whole models: TP=N (the torchtitan-style model with SP), every variant, llama3-8b dims (2 layers)
  # and llama3-70b dims (1 layer); MoE models with EP=N (in a dry run every preset is tiny)
  step "model_dense_$link" "${launch[@]}" overlap_layers.bench.model "${ranks[@]}" --model titan llama \
    --layers 2 "${small[@]}" --out "$OUT/model_titan-llama_tp${N}_${link}_${kind}_${day}.json"
  step "model_70b_$link" "${launch[@]}" overlap_layers.bench.model "${ranks[@]}" --model titan llama \
    --preset llama3-70b --layers 1 "${small[@]}" --out "$OUT/model_titan-llama-70b_tp${N}_${link}_${kind}_${day}.json"
  step "model_moe_$link" "${launch[@]}" overlap_layers.bench.model "${ranks[@]}" --model qwen3_moe mixtral \
    --layers 2 "${small[@]}" --out "$OUT/model_qwen3-moe-mixtral_tp${N}_${link}_${kind}_${day}.json"
  if [ "$N" -ge 4 ] && [ "$link" = nvlink ]; then  # FSDP2 2-D: dp=2 x tp=N/2
    step "model_fsdp_$link" "${launch[@]}" overlap_layers.bench.model "${ranks[@]}" --model llama --layers 2 \
      --dp 2 "${small[@]}" --out "$OUT/model_llama_dp2tp$((N / 2))_${link}_${kind}_${day}.json"
  fi
  # 2. the per-layer grid: every mode (the reference included), the layers' graph calls and the
  # reference replayed alike, fwd+bwd
  step "layers_$link" "${launch[@]}" overlap_layers.bench "${ranks[@]}" --layer mlp attention moe \
    "${grid[@]}" --tp "$N" --passes fwdbwd "${transport[@]}" $([ "${DRY:-0}" = 1 ] || echo --graph-calls) \
    --out "$OUT/mlp_attention_moe_tp${N}_${link}_fwdbwd_graph_calls_${kind}_${day}.json"
done
unset NCCL_P2P_DISABLE
# 3. the GPU tests (skipped in a dry run: CI runs them on CPU)
if [ "${DRY:-0}" != 1 ]; then bash bench/probes/gpu_tests.sh "$OUT"; fi
