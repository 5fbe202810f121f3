#!/usr/bin/env bash
# One H200 call (~2 minutes): bench/proto_small_t.py, the whole block at qwen3-30b-a3b T = $TOKENS (1,2) in one
# persistent Gluon launch (down weights streamed into shared memory during gate/up, a grid barrier between),
# checked against the float32 reference on 8 fresh routings and in graph replay, timed with the bench's method
# beside the shipped table's schedule, for each of $CONFIGS (parse_config). A hang of the grid barrier is cut by
# timeout. Results in $OUT/s.tgz.
export PYTHONUNBUFFERED=1
R=/tmp/s; rm -rf $R; mkdir -p $R
timeout -k 5 ${PROTO_S:-200} python3 bench/proto_small_t.py --out $R --tokens ${TOKENS:-1,2} --configs ${CONFIGS:-8x12LRHBD,8x12LR} > $R/run.log 2>&1
echo "prototype rc=$?"; (cd $R && tar czf "$OUT/s.tgz" .); tail -n 12 $R/run.log
if [ -n "$LAUNCH_COST" ]; then  # the launch's own cost with 16 / 112 / 224 KB of shared memory
  timeout -k 5 60 python3 bench/proto_launch_cost.py --out $R > $R/launch.log 2>&1
  echo "launch cost rc=$?"; (cd $R && tar czf "$OUT/s.tgz" .); tail -n 8 $R/launch.log
fi
