#!/usr/bin/env bash
# One H200 call (~2 minutes): ncu on bench/proto_gluon_gemm.py's gate/up kernels at mixtral-8x7b T = 1024 and
# 512 (the package's TMA one-dot kernel, the warp-specialised Gluon kernels): time, SM clock, tensor-pipe
# activity, L2 and DRAM traffic, to tell whether the tensor cores, the L2 or the clock bound them.
# Results in $OUT/n.tgz; a summary last.
export PYTHONUNBUFFERED=1
R=/tmp/n; rm -rf $R; mkdir -p $R
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
timeout -k 5 ${NCU_S:-200} ncu --clock-control none --csv -k regex:"gate_up|grouped_gemm|gemm|nvjet|xmma|cutlass" --metrics $M \
  python3 bench/proto_gluon_gemm.py --reps 2 --cells mixtral-8x7b:1024,mixtral-8x7b:512 \
  --variants "pkg-t1|ws-s4|ws2-s4|cublas" > $R/ncu.csv 2> $R/ncu.err
echo "ncu rc=$?"; (cd $R && tar czf "$OUT/n.tgz" .)
python3 - "$R/ncu.csv" <<'PY'
import csv, sys, collections, statistics as st
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((r for r in rows if r and r[0] == "ID"), None)
per = collections.defaultdict(dict)
for r in rows:
    if hdr and len(r) == len(hdr) and r[0] != "ID":
        d = dict(zip(hdr, r))
        per[(d["ID"], d["Kernel Name"].split("(")[0][:28])][d["Metric Name"]] = float(d["Metric Value"].replace(",", ""))
for (i, name), m in per.items():
    print(i, name, " ".join(f"{k.split('.')[0].split('__')[1][:24]}={v:.4g}" for k, v in m.items()))
PY
