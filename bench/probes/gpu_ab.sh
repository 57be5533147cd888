#!/usr/bin/env bash
# Same-call A/B of two versions of the library: runs the per-layer benchmark with the old code and
# the new code alternately (old, new, old, new by default), so clock and power drift between runs
# falls on both sides, then prints each shape's times side by side. Timings from separate device
# calls differ by a few percent on their own; a change of 1-2% needs this.
#
# The old version is a copy of the package, made here (no git history on the device machine):
#   git archive OLD_REV overlap_layers | tar x -C .ab_old    # .ab_old: a git-ignored folder
# then on the device machine (carry .ab_old), from the repo root:
#   bash bench/gpu_ab.sh OUTDIR .ab_old --layer mlp --preset llama3-8b --tp 4 --graphs --modes compute,rank_ce
# ROUNDS (default 2) sets the old/new pairs. The runs' JSONs and logs end up in one OUTDIR/ab.tgz (a device
# call brings back only a few files from $OUT; the table is printed before packing).
# AB_ENV_OLD / AB_ENV_NEW: VAR=value words for one side's runs only, for an A/B of a setting rather than
# of code (pass a copy of the same tree as the old version), e.g. AB_ENV_NEW="CUBLAS_WORKSPACE_CONFIG=:0:0".
set -uo pipefail
OUT=$1; OLD=$(cd "$2" && pwd); shift 2
ROOT=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
NPROC=${NPROC:-4}
for i in $(seq 1 "${ROUNDS:-2}"); do
  for side in old new; do
    dir=$ROOT; [ $side = old ] && dir=$OLD
    side_env=${AB_ENV_NEW:-}; [ $side = old ] && side_env=${AB_ENV_OLD:-}
    # python -m takes the package from the working directory
    # shellcheck disable=SC2086
    (cd "$dir" && env $side_env torchrun --nproc-per-node "$NPROC" -m overlap_layers.bench "$@" --out "$OUT/ab_${side}$i.json") \
      > "$OUT/ab_${side}$i.log" 2>&1 || { echo "$side run $i failed:"; tail -20 "$OUT/ab_${side}$i.log"; exit 1; }
  done
done
python3 - "$OUT" "${ROUNDS:-2}" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows, plans = {}, {}
for side in ("old", "new"):
    for i in range(1, rounds + 1):
        for r in json.load(open(f"{out}/ab_{side}{i}.json"))["records"]:
            key = (r.get("layer", "mlp"), r["preset"], r.get("batch"), r["tokens"], r["pass"], r["mode"])
            rows.setdefault(key, {"old": [], "new": []})[side].append(r["ms"])
            if r["mode"] == "auto":  # what the planner ran: K, or "rank" for rank chunks
                plans.setdefault(key, {"old": [], "new": []})[side].append(
                    "rank" if r.get("decomposition") == "rank" else str(r.get("k")))
print(f"{'shape':58s} {'old ms':>18s} {'new ms':>18s} {'change':>7s}")
for key, v in rows.items():
    o, n = sum(v["old"]) / len(v["old"]), sum(v["new"]) / len(v["new"])
    print(f"{' '.join(map(str, key)):58s} {','.join(f'{x:.3f}' for x in v['old']):>18s} "
          f"{','.join(f'{x:.3f}' for x in v['new']):>18s} {100 * (n / o - 1):+6.1f}%"
          + (f"  plans {','.join(plans[key]['old'])} -> {','.join(plans[key]['new'])}" if key in plans else ""))
PY
(cd "$OUT" && tar czf ab.tgz ab_old*.json ab_old*.log ab_new*.json ab_new*.log && rm -f ab_old*.json ab_old*.log ab_new*.json ab_new*.log)
