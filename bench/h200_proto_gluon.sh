#!/usr/bin/env bash
# One H200 call (~2 minutes): bench/proto_gluon_gemm.py, the warp-specialised Gluon gate/up GEMM checked
# against torch and timed beside the package's TMA gate/up kernel (one-dot and two-dot) at three large-T
# cells. Results in $OUT/g.tgz; the table last.
export PYTHONUNBUFFERED=1
R=/tmp/g; rm -rf $R; mkdir -p $R
timeout -k 5 ${PROTO_S:-240} python3 bench/proto_gluon_gemm.py --out $R > $R/run.log 2>&1
echo "prototype rc=$?"; (cd $R && tar czf "$OUT/g.tgz" .); tail -n 16 $R/run.log
