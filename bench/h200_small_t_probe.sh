#!/usr/bin/env bash
# One H200 call (~4 minutes): what bounds the small-T kernels. First bench/proto_small_t.py at T = 1, 2 with
# its default configurations (8x12L and 8x12LW8 since c01b388; 8x12 and 8x12L in call 2), checked and timed beside
# the table's schedule; then ncu's SpeedOfLight, launch, occupancy, warp-state and memory sections of the
# named variants' kernels (bench/kernels.py --probe-variants: each kernel alone, caches flushed): the token-
# mode down against the gate/up at qwen3.5-397b-a17b / qwen3-30b-a3b T = 1, with and without down_nb.
# Results in $OUT/p.tgz.
export PYTHONUNBUFFERED=1
R=/tmp/p; rm -rf $R; mkdir -p $R
pack() { (cd $R && tar czf "$OUT/p.tgz" .); }
timeout -k 5 ${PROTO_S:-150} python3 bench/proto_small_t.py --out $R/proto --tokens ${TOKENS:-1,2} > $R/proto.log 2>&1
echo "prototype rc=$?"; tail -n 8 $R/proto.log; pack
cells=${CELLS:-"qwen3.5-397b-a17b:1:ga,ga-n4;qwen3-30b-a3b:1:ga,gd-n2;qwen3-30b-a3b:16:m16,m16-n4"}
timeout -k 5 ${NCU_S:-200} ncu --profile-from-start off --clock-control none --csv --section SpeedOfLight \
  --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
  python3 bench/kernels.py --probe-variants "$cells" --out $R > $R/ncu.csv 2> $R/ncu.err
echo "ncu rc=$?"; tail -n 3 $R/ncu.err; pack
python3 - $R <<'PY'
import csv, sys
from collections import defaultdict
R = sys.argv[1]
rows = [r for r in csv.DictReader(l for l in open(f"{R}/ncu.csv") if l.startswith('"'))]
keep = ("Duration", "DRAM Throughput", "Memory Throughput", "Achieved Occupancy", "Theoretical Occupancy",
        "Waves Per SM", "Registers Per Thread", "Grid Size", "Stall Long Scoreboard", "Warp Cycles Per Issued Instruction",
        "L2 Hit Rate", "Mem Busy", "Max Bandwidth", "Dynamic Shared Memory Per Block", "Static Shared Memory Per Block")
by = defaultdict(dict)
for r in rows:
    if r["Metric Name"] in keep:
        by[(int(r["ID"]), r["Kernel Name"][:22])][r["Metric Name"]] = r["Metric Value"] + r.get("Metric Unit", "")
for (i, name), m in sorted(by.items()):
    print(i, name, "  ".join(f"{k}={v}" for k, v in m.items()))
PY
