#!/usr/bin/env bash
# On the GPU machine: `moetune tune --resume` of more presets into the shipped table cache/h200.sqlite
# (buckets already current there are kept, so a cut-off run can be continued); logs and the table land
# in $OUT.  BUDGET bounds each preset's search loop; TIMEOUT_S its whole run (`--time-limit`: no bucket
# starts that would pass it, so the tuner stops between buckets; `timeout` 60 s later is the safety net).
#   bash bench/tune_presets_h200.sh BUDGET TIMEOUT_S PRESET...
# With AT=256,512,1024 in the environment: re-tune only the buckets holding those token counts, current
# or not (`--at-tokens` instead of `--resume`; each bucket's study starts from its stored winner).
export PYTHONUNBUFFERED=1
budget=$1; limit=$2; shift 2
# With REVALIDATE=1: stale buckets re-check and re-time their stored winner beside the defaults, no search.
which=(--resume); [ -n "${REVALIDATE:-}" ] && which=(--revalidate); [ -n "${AT:-}" ] && which=(--at-tokens "$AT")
out=${OUT:-out}; mkdir -p "$out"
for preset in "$@"; do
  timeout -k 5 -s INT $((limit + 60)) python3 -m moetune.cli tune --preset "$preset" --backend triton \
    --target h200 --tokens 1-1024 --budget "$budget" --time-limit "${limit}s" --cache cache/h200.sqlite \
    --keep-going "${which[@]}" > "$out/tune-$preset.log" 2>&1
  echo "$preset rc=$?"; grep -E "^\s+\[[0-9]+/" "$out/tune-$preset.log" | tail -n 6
  cp cache/h200.sqlite "$out/h200.sqlite"
done
python3 -m moetune.cli show cache/h200.sqlite > "$out/show.txt" 2>&1
