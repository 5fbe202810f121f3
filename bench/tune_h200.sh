#!/usr/bin/env bash
# On the GPU machine: the CUDA-graph test of a compiled decode step, then `moetune tune` of a preset
# with the triton backend into cache/h200.sqlite (`--resume`: buckets whose entry is current for its
# kind's kernel sources are kept, the stale and missing ones tuned); logs and the table go to $OUT.
#   bash bench/tune_h200.sh [PRESET] [BUDGET] [TIME_LIMIT]   (TIME_LIMIT: no bucket starts that would pass it)
set -o pipefail
preset=${1:-qwen3-30b-a3b}
budget=${2:-5m}
limit=${3:-60m}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"
MOETUNE_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_cuda_graph.py 2>&1 | tee "$out/cuda_graph_test.log"
python3 -m moetune.cli tune --preset "$preset" --backend triton --target h200 --tokens 1-1024 \
  --budget "$budget" --time-limit "$limit" --cache cache/h200.sqlite --keep-going --resume 2>&1 | tee "$out/tune-$preset.log"
cp cache/h200.sqlite "$out/h200.sqlite"
python3 -m moetune.cli show cache/h200.sqlite 2>&1 | tee "$out/show.txt"
