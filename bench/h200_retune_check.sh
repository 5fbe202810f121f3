#!/usr/bin/env bash
# One H200 call (at most ~9.5 minutes): re-tune the buckets holding the given cells (seeds, local search,
# edge timing; `moetune tune --at-tokens`, each study's trials kept in an Optuna journal), then time the
# table's new choice (variant `table`) beside the variants that were best there.
# Results in $OUT/retune.tgz (the table, the tuning logs and journals, the bench JSON/markdown); a short
# table last.
#   bash bench/h200_retune_check.sh [BUDGET_PER_PRESET] [PRESET:T,T,... ...]
# The default cells: the one-row buckets where grouped GEMM became a candidate (session 5) and the
# mixtral-8x7b cells whose table choice trailed the best variant in session 4 and were not re-tuned.
export PYTHONUNBUFFERED=1
budget=${1:-60s}
shift || true
cells=("$@")
[ ${#cells[@]} -gt 0 ] || cells=(deepseek-v3:8,16 qwen3.5-397b-a17b:8,16 mixtral-8x7b:2,16,32 qwen3-30b-a3b:8)
R=/tmp/retune; mkdir -p $R
cp cache/h200.sqlite $R/before.sqlite  # the bench times its entries too, as variant `table-before`
pack() { cp cache/h200.sqlite $R/h200.sqlite; (cd $R && tar czf "$OUT/retune.tgz" .); }
tune_s=${TUNE_S:-420}  # the tuning's part of the call, split over the cells; NO_BENCH=1: no bench after it
share=$((tune_s / ${#cells[@]}))
for cell in "${cells[@]}"; do
  p=${cell%%:*}
  left=$((tune_s + 30 - SECONDS)); [ $left -gt 60 ] || break
  lim=$(( share < left - 30 ? share : left - 30 ))
  timeout -k 5 -s INT $((lim + 30)) python3 -m moetune.cli tune --preset "$p" --backend triton --target h200 \
    --tokens 1-1024 --at-tokens "${cell#*:}" --budget "$budget" --time-limit "${lim}s" \
    --cache cache/h200.sqlite --storage "$R/$p.journal" --keep-going > "$R/tune-$p.log" 2>&1
  echo "$p at ${cell#*:}: rc=$?"; grep -E "^\s+\[[0-9]+/|winner |final  |split  " "$R/tune-$p.log"; pack
done
[ -z "$NO_BENCH" ] || exit 0
tags=${TAGS:-'table|g16|ga|gb|gd|m16|m16-t|m64n64|m64n64-t'}  # TAGS=REGEX: other bench variants
for cell in "${cells[@]}"; do
  left=$((570 - SECONDS)); [ $left -gt 30 ] || break
  timeout -k 10 -s INT $left python3 bench/kernels.py --out $R/bench-${cell%%:*} --baselines "" \
    --budget-s $((left - 20)) --shapes ${cell%%:*} --tokens ${cell#*:} --tags "$tags" \
    --table-before $R/before.sqlite ${BENCH_ARGS} >> $R/bench.log 2>&1
  echo "bench ${cell}: rc=$? (${left} s left)"; pack
done
for j in $R/bench-*/*-kernels.json; do python3 bench/kernels.py --render "$j" | grep -E "^\| [a-z]|^\`table"; done
