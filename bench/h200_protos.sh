#!/usr/bin/env bash
# One H200 call: the one-launch GEMV prototype outside the package (bench/proto_persistent.py, small T),
# checked against the float32 reference (eager and graph replay) and timed beside the shipped kernels
# and a read-only kernel of the same bytes; results in $OUT/protos.tgz, the table printed last.
# (The large-T TMA prototype is in the package now: GemmParams.tma.)
export PYTHONUNBUFFERED=1
R=/tmp/protos; mkdir -p $R
timeout -k 5 240 python3 bench/proto_persistent.py --out $R > $R/persistent.log 2>&1; echo "persistent rc=$?"
(cd $R && tar czf "$OUT/protos.tgz" .)
tail -n 32 $R/persistent.log
