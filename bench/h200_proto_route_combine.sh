#!/usr/bin/env bash
# One H200 call (~2 minutes): bench/proto_route_combine.py (the combine with its k row loads together, the
# routing in one launch with a grid barrier) checked against torch and timed beside the package's kernels
# at five large-T cells; a hang of the grid barrier is cut by timeout. Then ncu's time per kernel of the
# same runs. Results in $OUT/p.tgz; the table last.
export PYTHONUNBUFFERED=1
R=/tmp/p; rm -rf $R; mkdir -p $R
pack() { (cd $R && tar czf "$OUT/p.tgz" .); }
timeout -k 5 120 python3 bench/proto_route_combine.py --out $R > $R/run.log 2>&1
echo "prototypes rc=$?"; pack
timeout -k 5 150 ncu --clock-control none --csv -k regex:"combine|route" \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread \
  python3 bench/proto_route_combine.py --reps 3 > $R/ncu.csv 2> $R/ncu.err
echo "ncu rc=$?"; pack
tail -n 30 $R/run.log
