#!/usr/bin/env bash
# One H200 call: the two prototypes outside the package (bench/proto_persistent.py for small T,
# bench/proto_tma_gemm.py for large T), each checked against the float32 reference (eager and graph
# replay) and timed beside the shipped kernels; results in $OUT/protos.tgz, tables printed last.
export PYTHONUNBUFFERED=1
R=/tmp/protos; mkdir -p $R
timeout -k 5 240 python3 bench/proto_persistent.py --out $R > $R/persistent.log 2>&1; echo "persistent rc=$?"
timeout -k 5 300 python3 bench/proto_tma_gemm.py --out $R > $R/tma.log 2>&1; echo "tma rc=$?"
(cd $R && tar czf "$OUT/protos.tgz" .)
tail -n 32 $R/persistent.log; tail -n 30 $R/tma.log
