#!/usr/bin/env bash
# One H200 call (after the wheels install line of ../shared/device/wheels.sh): re-tune qwen3-30b-a3b,
# the CUDA-graph test, TPE vs an exhaustive grid on three buckets (the same capped space) and two
# workers on one study. Each step is tarred into $OUT as it ends.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R/tune $R/grid
pack() { (cd $R && tar czf "$OUT/$1.tgz" "$1"); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/tune/device.txt
timeout -k 5 -s INT 95 python3 -m moetune.cli tune --preset qwen3-30b-a3b --backend triton --target h200 \
  --tokens 1-1024 --budget 50s --cache cache/h200.sqlite --keep-going > $R/tune/tune.log 2>&1; echo "tune rc=$?"
cp cache/h200.sqlite $R/tune/h200.sqlite; python3 -m moetune.cli show cache/h200.sqlite > $R/tune/show.txt 2>&1
tail -n 16 $R/tune/tune.log; pack tune
MOETUNE_TEST_GPU=1 timeout 45 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_cuda_graph.py > $R/tune/graph.log 2>&1
echo "graph rc=$?"; tail -n 3 $R/tune/graph.log; pack tune
timeout -k 10 -s INT 105 python3 bench/grid_vs_tpe.py --mode both --preset qwen3-30b-a3b --backend triton --target h200 \
  --tokens 1-1024 --at 1,14,165 --space-cap 16 --batch 4 --patience 6 --tpe-budget 6 --grid-budget 12 \
  --worker-tokens 1-1 --worker-budget 10s --start-s 20 --out $R/grid > $R/grid/run.log 2>&1; echo "grid rc=$?"
tail -n 25 $R/grid/run.log; pack grid
