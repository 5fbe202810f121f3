#!/usr/bin/env bash
# One H200 call (at most ~8.5 minutes): the fused-down GEMV prototype outside the package (bench/proto_fused_down.py, small T),
# checked against the float32 reference (eager and graph replay) and timed beside the shipped
# stream_gemv and a read-only kernel of the same bytes; results in $OUT/protos.tgz, the table printed last.
# (Earlier prototypes, measured and retired: the TMA grouped GEMM is in the package as GemmParams.tma;
# the persistent one-launch GEMV lost, bench/results/NOTES.md.)
export PYTHONUNBUFFERED=1
R=/tmp/protos; mkdir -p $R
timeout -k 5 300 python3 bench/proto_fused_down.py --out $R > $R/fused-down.log 2>&1; echo "fused-down rc=$?"
# 256-row TMA tiles (bench variants m256n64-t / -ts2) against the best 128-row one, mixtral T = 512 / 1024
timeout -k 5 200 python3 bench/kernels.py --out $R/m256 --baselines "" --shapes mixtral-8x7b --tokens 512,1024 \
  --tags 'm128g32-ts2|m256.*' --budget-s 150 > $R/m256.log 2>&1; echo "m256 rc=$?"
(cd $R && tar czf "$OUT/protos.tgz" .)
tail -n 64 $R/fused-down.log; grep -E "^\| mixtral|best moetune" $R/m256.log
