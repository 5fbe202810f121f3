#!/usr/bin/env bash
# One H200 call (~2 minutes): bench/proto_read_pattern.py, read-only kernels with each addressing pattern of the
# package's down and gate/up kernels (token-mode [KP, BN, BK] tiles, one expert's [BN, BK] tiles, a linear
# stream of the same bytes) on the selected experts' weights, checked against torch's sums, timed with the
# bench's method: whether the down projection's pattern alone streams slower (Session 11 items 1-2).
# Results in $OUT/r.tgz; the table last.
#   CELLS="shape:T,shape:T" bash bench/h200_read_pattern.sh
export PYTHONUNBUFFERED=1
R=/tmp/r; rm -rf $R; mkdir -p $R
timeout -k 5 ${READ_S:-150} python3 bench/proto_read_pattern.py --out $R \
  --cells "${CELLS:-qwen3.5-397b-a17b:1,qwen3-30b-a3b:1,qwen3-30b-a3b:16,deepseek-v3:1}" > $R/run.log 2>&1
echo "read pattern rc=$?"; (cd $R && tar czf "$OUT/r.tgz" .); sed -n '/^cell /,$p' $R/run.log
