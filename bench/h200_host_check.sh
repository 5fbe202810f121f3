#!/usr/bin/env bash
# One H200 call after a change to how the Triton kernels are launched (moetune/codegen/triton/launch.py):
# the GPU tests of the launch path and the bf16 kernel tests, then the eager host time per experts call
# (bench/host_overhead.py, direct launches against Triton's own dispatch in the same run, cProfile of the
# dispatcher) at T = 1 and 64, then the kernels bench's eager column on a few cells, then one decode step of
# two presets' real model classes (bench/decode_step.py, 4 layers). Results in $OUT/h.tgz.
export PYTHONUNBUFFERED=1
R=/tmp/h; rm -rf $R; mkdir -p $R
pack() { (cd $R && tar czf "$OUT/h.tgz" .); }
MOETUNE_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/codegen/test_triton_launch.py \
  tests/codegen/test_triton_kernels.py -k "launch or hook or graph or bf16_on_gpu or weights_it_is_handed" \
  > $R/gputests.log 2>&1
echo "gpu tests rc=$?"; tail -n 3 $R/gputests.log; pack
for t in 1 64; do
  timeout 150 python3 bench/host_overhead.py --tokens $t --rounds 11 --profile 2000 --out $R/T$t > $R/T$t.log 2>&1
  echo "host overhead T=$t rc=$?"; sed -n 1,24p $R/T$t.log; pack
done
timeout 120 python3 bench/kernels.py --out $R/bench --baselines "" --shapes qwen3-30b-a3b,mixtral-8x7b \
  --tokens 1,4,64 --tags 'table' > $R/bench.log 2>&1
echo "bench rc=$?"; pack; grep -E "^\| [a-z]" $R/bench/*-kernels.md
for p in qwen3-30b-a3b mixtral-8x7b; do
  timeout 150 python3 bench/decode_step.py --preset $p --layers 4 --tokens 1,8,64 --out $R/decode-$p \
    > $R/decode-$p.log 2>&1
  echo "decode step $p rc=$?"; pack; tail -n 6 $R/decode-$p.log
done
