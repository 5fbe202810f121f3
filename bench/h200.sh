#!/usr/bin/env bash
# What the H200 runs, from the repository root with the wheels of .whl/ carried (bench/README.md, "Reproduce"):
#   bash bench/h200.sh                # the 48-cell kernels table into $OUT/bench
#   bash bench/h200.sh tests          # the GPU kernel tests, log in $OUT/gputests.log
#   bash bench/h200.sh SUITE ARGS...  # python -m bench SUITE ARGS...
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  && export PYTHONPATH=$PWD/.site:$PWD
case "${1:-}" in
  "")
    timeout -k 10 -s INT 433 python3 -m bench kernels --out "$OUT/bench" --budget-s 393 ;;
  tests)
    MOETUNE_TEST_GPU=1 python3 -m pytest -q -x -p no:cacheprovider \
      tests/codegen/test_triton_{stream_gemv,grouped_gemm,hybrid,routing,backend,launch}.py \
      tests/runtime/test_cuda_graph.py > "$OUT/gputests.log" 2>&1
    rc=$?; tail -n 2 "$OUT/gputests.log"; exit $rc ;;
  *)
    python3 -m bench "$@" ;;
esac
