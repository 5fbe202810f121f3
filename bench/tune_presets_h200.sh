#!/usr/bin/env bash
# On the GPU machine: `moetune tune` of more presets into the shipped table cache/h200.sqlite (which
# already holds qwen3-30b-a3b from bench/tune_h200.sh); logs and the table land in $OUT.
#   bash bench/tune_presets_h200.sh BUDGET PRESET...
export PYTHONUNBUFFERED=1
budget=$1; shift
out=${OUT:-out}; mkdir -p "$out"
for preset in "$@"; do
  timeout -k 5 -s INT 150 python3 -m moetune.cli tune --preset "$preset" --backend triton --target h200 \
    --tokens 1-1024 --budget "$budget" --cache cache/h200.sqlite --keep-going > "$out/tune-$preset.log" 2>&1
  echo "$preset rc=$?"; tail -n 3 "$out/tune-$preset.log"
  cp cache/h200.sqlite "$out/h200.sqlite"
done
python3 -m moetune.cli show cache/h200.sqlite > "$out/show.txt" 2>&1; cat "$out/show.txt"
