#!/usr/bin/env bash
# One H200 call (~4 minutes): why the shipped table's mixtral-8x7b [634, 1024] schedule (split 1) times
# 5-7 % slower in the kernels bench at T = 1024 (session 10 calls 3-4) than the tuner measured it. The bench
# twice at T = 1024 with the same schedule as a plain variant (`m128s4-t1-y`) beside `table` and the split-2
# twins, then a short re-tune of that bucket into a copy of the table (its finalists at T = 1024 again).
# Results in $OUT/k.tgz; the summaries last.
export PYTHONUNBUFFERED=1
R=/tmp/k; rm -rf $R; mkdir -p $R
pack() { (cd $R && tar czf "$OUT/k.tgz" .); }
for i in 1 2; do
  timeout -k 5 100 python3 bench/kernels.py --out $R/bench$i --baselines "" --shapes mixtral-8x7b --tokens 1024 \
    --budget-s 80 --tags "table|m128s4-t1(-y)?|m128s4-t1s2(-y)?|m128g32-t1s2-y" > $R/bench$i.log 2>&1
  echo "bench $i rc=$?"; pack
done
cp cache/h200.sqlite $R/copy.sqlite
timeout -k 5 170 python3 -m moetune.cli tune --preset mixtral-8x7b --backend triton --target h200 --tokens 1-1024 \
  --at-tokens 1024 --budget 40s --time-limit 150s --cache $R/copy.sqlite --storage $R/tune.journal \
  --keep-going > $R/tune.log 2>&1
echo "tune rc=$?"; pack
for i in 1 2; do python3 - "$R/bench$i/nvidia-h200-kernels.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sorted((round(r["time_us"], 1), r["variant"]) for r in d["records"]))
PY
done
grep -E "^\s+\[[0-9]+/|winner |final  |split  " $R/tune.log
