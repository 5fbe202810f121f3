#!/usr/bin/env bash
# One H200 call after a change under moetune/codegen/triton: the GPU kernel tests, a re-tune of the
# shipped table (bench/tune_h200.sh: CUDA-graph test, `moetune tune`), then the 48-cell kernel bench;
# bench/host_overhead.py (eager host time per experts call) after the tests.
# Everything lands in $OUT/r.tgz (tune/, bench/, host/, gputests.log). The steps share one 580 s clock (the
# device's limit is 600 s): the tuner stops between buckets at its time limit (`--resume` continues it),
# and the bench gets what is left.
#   bash bench/h200_run.sh [PRESET] [TUNE_BUDGET] [TUNE_LIMIT_S]
export PYTHONUNBUFFERED=1
preset=${1:-qwen3-30b-a3b}
R=/tmp/r; mkdir -p $R/tune $R/bench $R/host
pack() { (cd $R && tar czf "$OUT/r.tgz" .); }
MOETUNE_TEST_GPU=1 timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/codegen/test_triton_kernels.py \
  -k "bf16_on_gpu or one_expert_every_row or odd_sizes" > $R/gputests.log 2>&1
echo "gpu tests rc=$?"; tail -n 2 $R/gputests.log; pack
for t in 1 64; do   # eager host time per experts call (GEMV bucket, GEMM bucket)
  timeout 60 python3 bench/host_overhead.py --tokens $t --out $R/host/T$t > $R/host/T$t.log 2>&1
  echo "host overhead T=$t rc=$?"; tail -n 17 $R/host/T$t.log
done
limit=${3:-170}
OUT=$R/tune timeout -k 5 -s INT $((limit + 40)) bash bench/tune_h200.sh "$preset" "${2:-120s}" "${limit}s" \
  > $R/tune/run.log 2>&1
echo "tune rc=$?"; tail -n 16 $R/tune/run.log; pack
left=$((580 - SECONDS))
timeout -k 10 -s INT $left python3 bench/kernels.py --out $R/bench --budget-s $((left - 45)) > $R/bench/run.log 2>&1
echo "bench rc=$? (${left} s left for it)"; pack; tail -n 52 $R/bench/*-kernels.md
