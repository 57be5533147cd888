#!/usr/bin/env bash
# The whole test suite on a GPU machine in four parallel pytest processes, split by file: the CUDA
# checks and the graph loops (which use every GPU) in one, the compile tests in another, the rest in
# thirds; then the tests marked ``timing`` (which assert step times) alone on the machine. One process
# needed more than 270 s on 2x H200 (the compile and CUDA tests dominate); four take about 3 min.
#   bash bench/probes/gpu_tests.sh [OUTDIR]     # SUITE_S: each shard's time limit (default 330 s)
# Each shard's log goes to OUTDIR/suite_N.txt; the summary lines are printed at the end.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the graph-loop tests start their own python processes
cuda="tests/test_cuda.py tests/test_heads_kernel.py tests/test_kernel_variants.py tests/test_query_chunks.py tests/test_slot_sum.py tests/test_routing.py tests/test_graph_loops.py"
compile="tests/test_compile.py"
rest=("" "" ""); i=0
for f in tests/test_*.py; do
  case " $cuda $compile " in *" $f "*) continue ;; esac
  rest[$((i % 3))]="${rest[$((i % 3))]} $f"
  i=$((i + 1))
done
j=0
for shard in "$cuda" "$compile" "${rest[@]}"; do
  # shellcheck disable=SC2086
  timeout "${SUITE_S:-330}" python -m pytest -q $shard -m "not timing" -p no:cacheprovider --durations=5 \
    > "$OUT/suite_$j.txt" 2>&1 &
  j=$((j + 1))
done
rc=0
for p in $(jobs -p); do wait "$p" || rc=1; done
timeout "${SUITE_S:-330}" python -m pytest -q tests -m timing -p no:cacheprovider > "$OUT/suite_$j.txt" 2>&1 || rc=1
for j in 0 1 2 3 4 5; do echo "== shard $j"; grep -E "passed|failed|error" "$OUT/suite_$j.txt" | tail -3; done
exit $rc
