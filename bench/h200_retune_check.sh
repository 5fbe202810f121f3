#!/usr/bin/env bash
# One H200 call (at most ~9.5 minutes): re-tune the buckets whose shipped-table choice trailed the bench's
# best variant in session 4 (bench/results/NOTES.md, "Session 4", item 5), with the tuner's seeds and
# edge timing, then time the table's new choice (variant `table`) beside the variants that were best there.
# Results in $OUT/retune.tgz (the table, the tuning logs, the bench JSON/markdown); a short table last.
#   bash bench/h200_retune_check.sh [BUDGET_PER_PRESET]
export PYTHONUNBUFFERED=1
budget=${1:-150s}
R=/tmp/retune; mkdir -p $R
pack() { cp cache/h200.sqlite $R/h200.sqlite; (cd $R && tar czf "$OUT/retune.tgz" .); }
retune() {  # PRESET TOKENS TIME_LIMIT_S
  timeout -k 5 -s INT $(($3 + 60)) python3 -m moetune.cli tune --preset "$1" --backend triton --target h200 \
    --tokens 1-1024 --at-tokens "$2" --budget "$budget" --time-limit "${3}s" --cache cache/h200.sqlite \
    --keep-going > "$R/tune-$1.log" 2>&1
  echo "$1 at $2: rc=$?"; grep -E "^\s+\[[0-9]+/" "$R/tune-$1.log"; pack
}
retune mixtral-8x7b 256,512,1024 200
retune deepseek-v3 8,16 100
retune qwen3.5-397b-a17b 16 60
tags='table|m16|m16-t|g16|m128g1-1|m128g32-ts2|m128s4-ts2|m64n64|m64n64-t'
for cell in mixtral-8x7b:256,512,1024 deepseek-v3:8,16 qwen3.5-397b-a17b:16; do
  left=$((570 - SECONDS)); [ $left -gt 40 ] || break
  timeout -k 10 -s INT $left python3 bench/kernels.py --out $R/bench-${cell%%:*} --baselines "" \
    --budget-s $((left - 30)) --shapes ${cell%%:*} --tokens ${cell#*:} --tags "$tags" >> $R/bench.log 2>&1
  echo "bench ${cell}: rc=$? (${left} s left)"; pack
done
for j in $R/bench-*/*-kernels.json; do python3 bench/kernels.py --render "$j" | grep -E "^\| |^\`table"; done
