#!/usr/bin/env bash
# One H200 call (~3 minutes): the launch-path GPU tests over every kernel-test schedule (y_half ones
# included), then ncu's time and DRAM bytes of each kernel of the shipped table's schedule at the cells
# under target (bench/kernels.py --probe-table; ncu serialises the kernels and flushes caches before each).
# Results in $OUT/q.tgz; the per-kernel table last.
export PYTHONUNBUFFERED=1
R=/tmp/q; rm -rf $R; mkdir -p $R
pack() { (cd $R && tar czf "$OUT/q.tgz" .); }
MOETUNE_TEST_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_triton_launch.py \
  > $R/gputests.log 2>&1
echo "launch gpu tests rc=$?"; tail -n 2 $R/gputests.log; pack
cells=${CELLS:-"qwen3-30b-a3b:1,2,4,8,16,64,256,1024;qwen3.5-397b-a17b:1,4;deepseek-v3:1;mixtral-8x7b:2,512,1024"}
timeout 200 ncu --profile-from-start off --clock-control none --csv --metrics \
  gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size \
  python3 bench/kernels.py --probe-table "$cells" --out $R > $R/ncu.csv 2> $R/ncu.err
echo "ncu rc=$?"; tail -n 3 $R/ncu.err; pack
python3 - $R <<'PY'
import csv, json, sys
from collections import defaultdict
R = sys.argv[1]
rows = [r for r in csv.DictReader(l for l in open(f"{R}/ncu.csv") if l.startswith('"'))]
plan = json.load(open(f"{R}/probe_table_plan.json"))
by = defaultdict(dict)
for r in rows:
    by[(r["ID"], r["Kernel Name"])][r["Metric Name"]] = r["Metric Value"]
ks = list(by.items())
print(f"{len(ks)} kernels profiled for {len(plan)} cells")
for (i, name), m in ks:
    print(f"{i:>4} {name[:34]:34s} {m.get('gpu__time_duration.sum', '?'):>10} ns  read {m.get('dram__bytes_read.sum', '?'):>14}"
          f"  write {m.get('dram__bytes_write.sum', '?'):>12}  regs {m.get('launch__registers_per_thread', '?'):>4}"
          f"  grid {m.get('launch__grid_size', '?')}")
PY
