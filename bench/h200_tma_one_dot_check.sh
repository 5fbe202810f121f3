#!/usr/bin/env bash
# One H200 call (~5 minutes): the GPU kernel tests of the TMA one-dot gate/up (GemmParams(tma=True,
# one_dot=True)) and of the combine, then the kernels bench at the large-T cells with the `-t1` / `-t1s2`
# twins beside the table's schedule and the TMA / one-dot variants that win there now. Results in
# $OUT/t.tgz; the bench table last.
export PYTHONUNBUFFERED=1
R=/tmp/t; rm -rf $R; mkdir -p $R/bench
pack() { (cd $R && tar czf "$OUT/t.tgz" .); }
MOETUNE_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_triton_kernels.py \
  -k "bf16 or tma or one_dot or y_half" > $R/gputests.log 2>&1
echo "gpu tests rc=$?"; tail -n 3 $R/gputests.log; pack
left=$((560 - SECONDS))
timeout -k 10 -s INT $left python3 bench/kernels.py --out $R/bench --budget-s $((left - 25)) --baselines "" \
  --shapes ${SHAPES:-mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,qwen3.5-397b-a17b} --tokens ${TOKENS:-512,1024} \
  --tags "${TAGS:-table|.*-t1.*|m128.*-ts2(-y)?|m128g1-1(-y)?|m64n64(-t)?(-y)?}" > $R/bench/run.log 2>&1
echo "bench rc=$? (${left} s left for it)"; pack; tail -n 14 $R/bench/*-kernels.md
