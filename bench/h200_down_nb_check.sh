#!/usr/bin/env bash
# One H200 call (~7 minutes): the down projection's D-blocks walked NB per program in one flattened pipelined
# loop (GemvParams / GemmParams.down_nb). The GPU kernel tests of the new paths (bf16 among them), then
# bench/kernels.py with --nb-twins at the cells where the down kernel streams slowest (ncu, session 9 call 4:
# 3.1-3.9 TB/s against 3.8-4.4 for gate/up): every candidate beside its -n2 / -n4 twin, the table's schedule
# (`table`) among them. Results in $OUT/n.tgz; a table of each cell's candidates and twins last.
#   CELLS="shape:T,T;shape:T" TAGS=regex BENCH_S=seconds bash bench/h200_down_nb_check.sh
export PYTHONUNBUFFERED=1
R=/tmp/n; rm -rf $R; mkdir -p $R
pack() { (cd $R && tar czf "$OUT/n.tgz" .); }
MOETUNE_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_triton_kernels.py \
  -k "nb2 or nb4" > $R/gputests.log 2>&1
echo "gpu tests rc=$?"; tail -n 2 $R/gputests.log; pack
cells=${CELLS:-"qwen3-30b-a3b:1,2,4,8,16,32,64,128;qwen3.5-397b-a17b:1,2,4,8,16;deepseek-v3:1,4,16;mixtral-8x7b:2,16,64"}
IFS=';' read -ra groups <<< "$cells"
for g in "${groups[@]}"; do
  shape=${g%%:*}; toks=${g#*:}
  timeout -k 5 $(( ${BENCH_S:-380} / ${#groups[@]} + 20 )) python3 bench/kernels.py --out $R/$shape --baselines "" \
    --shapes $shape --tokens $toks --nb-twins --tags "${TAGS:-table|ga|gd|m16|m16-t|m64n64-t1}" \
    --budget-s $(( ${BENCH_S:-380} / ${#groups[@]} )) > $R/$shape.log 2>&1
  echo "$shape rc=$?"; pack
done
python3 - $R <<'PY'
import glob, json, sys
from collections import defaultdict
cells = defaultdict(dict)
for f in sorted(glob.glob(f"{sys.argv[1]}/*/*-kernels.json")):
    for r in json.load(open(f))["records"]:
        cells[(r["shape"], r["tokens"])][r["variant"]] = r.get("time_us") or r.get("error", "?")
def fmt(x):  # a time, or the first word of a failure (e.g. OutOfResources)
    return f"{x:.1f}" if isinstance(x, float) else str(x).split(":")[0][:20]
for (shape, T), v in cells.items():
    base = [t for t in v if not t.endswith(("-n2", "-n4"))]
    row = "  ".join(f"{t} {fmt(v[t])}/{fmt(v.get(t + '-n2', '-'))}/{fmt(v.get(t + '-n4', '-'))}" for t in base)
    print(f"{shape:18s} T={T:<4d} (µs: nb 1/2/4)  {row}")
PY
