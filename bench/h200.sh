#!/usr/bin/env bash
# What the H200 runs, from the repository root with the wheels of .whl/ carried (bench/README.md, "Reproduce"):
#   bash bench/h200.sh                # the 48-cell kernels table into $OUT/bench
#   bash bench/h200.sh tests          # the GPU kernel tests, log in $OUT/gputests.log
#   bash bench/h200.sh tests-fp8      # the FP8 kernels' and moetune.jax's FFI call's GPU tests, $OUT/gputests-fp8.log
#   bash bench/h200.sh tune-at BUDGET_S T[,T...] PRESET...
#                                     # targeted re-tunes (--at-tokens) into $OUT/t/$TARGET.sqlite, a copy of the
#                                     # shipped table of TARGET (default h200; h100 on an H100) over the buckets of
#                                     # TOKENS (default 1-1024), joined back with moetune merge, a log per preset
#   bash bench/h200.sh revalidate SECONDS PRESET...
#                                     # after a kernel edit that changed the stored winners' sm_90 code: each preset's
#                                     # stale winners re-checked and re-timed beside the defaults, no search, within
#                                     # SECONDS in all, into $OUT/t/h200.sqlite (a copy of the shipped table: join it
#                                     # back with moetune merge, then record the digests), a log per preset
#   bash bench/h200.sh SUITE ARGS...  # python -m bench SUITE ARGS...
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  && export PYTHONPATH=$PWD/.site:$PWD
# the GPU tests in JOBS processes on the one GPU where pytest-xdist is among the wheels (compiling dominates them;
# the FP8 tests hold whole presets' weights, so two at a time)
par=(); fp8par=(); python3 -c "import xdist" 2>/dev/null && par=(-n "${JOBS:-6}") && fp8par=(-n "${JOBS:-2}")
case "${1:-}" in
  "")
    timeout -k 10 -s INT 433 python3 -m bench kernels --out "$OUT/bench" --budget-s 393 ;;
  tests)
    MOETUNE_TEST_GPU=1 python3 -m pytest -q -x -p no:cacheprovider "${par[@]}" \
      tests/codegen/test_triton_{stream_gemv,fused_gemv,grouped_gemm,hybrid,routing,backend,launch}.py \
      tests/runtime/test_cuda_graph.py > "$OUT/gputests.log" 2>&1
    rc=$?; tail -n 2 "$OUT/gputests.log"; exit $rc ;;
  tests-fp8)
    MOETUNE_TEST_GPU=1 python3 -m pytest -q -x -p no:cacheprovider "${fp8par[@]}" \
      tests/codegen/test_triton_fp8_{stream_gemv,grouped_gemm,hybrid}.py tests/jax/test_jax_xla_call.py \
      > "$OUT/gputests-fp8.log" 2>&1
    rc=$?; tail -n 2 "$OUT/gputests-fp8.log"; exit $rc ;;
  tune-at)
    budget=$2; at=$3; shift 3
    tgt=${TARGET:-h200}
    mkdir -p "$OUT/t" && cp "cache/$tgt.sqlite" "$OUT/t/$tgt.sqlite"
    for p in "$@"; do
      log="$OUT/t/$tgt-$p-tune-at${at//,/_}.log"
      python3 -m moetune.cli tune --preset "$p" --backend triton --target "$tgt" --tokens "${TOKENS:-1-1024}" \
        --at-tokens "$at" --budget "${budget}s" --cache "$OUT/t/$tgt.sqlite" > "$log" 2>&1
      echo "$p at $at: rc=$?"; grep -E '^ +\[[0-9]+,[0-9]+\] +[0-9]+ ' "$log"
    done ;;
  revalidate)
    total=$2; shift 2; t0=$(date +%s)
    mkdir -p "$OUT/t" && cp cache/h200.sqlite "$OUT/t/h200.sqlite"
    for p in "$@"; do
      left=$(( total - $(date +%s) + t0 )); [ $left -lt 40 ] && { echo "$p: no time left"; continue; }
      log="$OUT/t/h200-$p-revalidate.log"
      timeout -k 5 $left python3 -m moetune.cli tune --preset "$p" --backend triton --target h200 --tokens 1-4096 \
        --revalidate --cache "$OUT/t/h200.sqlite" --time-limit $(( left - 15 ))s > "$log" 2>&1
      echo "$p revalidate: rc=$?"; tail -n 2 "$log" | cut -c1-200
    done ;;
  *)
    python3 -m bench "$@" ;;
esac
