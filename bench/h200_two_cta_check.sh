#!/usr/bin/env bash
# One H200 call (~4 minutes): the kernels bench at the large-T cells with the `-t1s2n64` twins (two
# programs per SM: 96 KB shared, ≤ 120 registers) beside the one-program-per-SM `-t1s2` schedules and the
# table's. Results in $OUT/c.tgz; the bench table last.
export PYTHONUNBUFFERED=1
R=/tmp/c; rm -rf $R; mkdir -p $R/bench
pack() { (cd $R && tar czf "$OUT/c.tgz" .); }
left=$((${BENCH_S:-300} - SECONDS))
timeout -k 10 -s INT $left python3 bench/kernels.py --out $R/bench --budget-s $((left - 25)) --baselines "" \
  --shapes ${SHAPES:-mixtral-8x7b,qwen3-30b-a3b} --tokens ${TOKENS:-256,512,1024} \
  --tags "${TAGS:-table|.*-t1s2.*|m128g1-1(-y)?|m64n64-t1}" > $R/bench/run.log 2>&1
echo "bench rc=$? (${left} s left for it)"; pack; tail -n 10 $R/bench/*-kernels.md
