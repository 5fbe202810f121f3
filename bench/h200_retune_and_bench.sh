#!/usr/bin/env bash
# One H200 call (~9 minutes): the GPU kernel tests, a short re-tune of the given cells' buckets into
# cache/h200.sqlite (bench/h200_retune_check.sh with TUNE_S seconds, default 240), then the full 48-cell
# kernels bench on the new table with the rest of the call. Results in $OUT/f.tgz; the bench table last.
#   bash bench/h200_retune_and_bench.sh [BUDGET_PER_BUCKET] [PRESET:T,T,... ...]
export PYTHONUNBUFFERED=1
R=/tmp/f; rm -rf $R /tmp/retune; mkdir -p $R
pack() { cp cache/h200.sqlite $R/h200.sqlite; (cd $R && tar czf "$OUT/f.tgz" .); }
MOETUNE_TEST_GPU=1 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_triton_kernels.py \
  -k y_half > $R/gputests.log 2>&1
echo "gpu tests rc=$?"; tail -n 2 $R/gputests.log; pack
OUT=$R TUNE_S=${TUNE_S:-240} NO_BENCH=1 bash bench/h200_retune_check.sh "$@"  # logs, journals: $R/retune.tgz
pack
left=$((575 - SECONDS))
mkdir -p $R/bench; timeout -k 10 -s INT $left python3 bench/kernels.py --out $R/bench --budget-s $((left - 25)) \
  > $R/bench/run.log 2>&1
echo "bench rc=$? (${left} s left for it)"; pack; tail -n 52 $R/bench/*-kernels.md

