#!/usr/bin/env bash
# One H200 call (~7 minutes): the persistent TMA grouped-GEMM prototype against each large-T cell's table
# schedule (bench/proto_persistent_gemm.py), then one decode step of two presets' real model classes
# (bench/decode_step.py, 4 layers, transformers' experts against moetune's, eager and CUDA graph).
# Results in $OUT/p.tgz; the short tables last.
export PYTHONUNBUFFERED=1
R=/tmp/p; rm -rf $R; mkdir -p $R
pack() { (cd $R && tar czf "$OUT/p.tgz" .); }
timeout -k 5 300 python3 bench/proto_persistent_gemm.py --out $R/proto > $R/proto.log 2>&1
echo "proto rc=$?"; pack
for p in qwen3-30b-a3b mixtral-8x7b; do
  timeout -k 5 100 python3 bench/decode_step.py --preset $p --layers 4 --tokens 1,8,64 --out $R/decode-$p \
    > $R/decode-$p.log 2>&1
  echo "decode step $p rc=$?"; pack; tail -n 7 $R/decode-$p.log
done
grep -A100 "^cell " $R/proto.log
