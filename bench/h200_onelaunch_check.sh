#!/usr/bin/env bash
# One H200 call (~6 minutes): GemvParams.one_launch on the GPU. First its kernel and launch tests in
# bf16, including twenty full-size calls and graph replays over fresh routings (a wrong order between
# gate/up's h and the down programs shows as a wrong result; a hang is cut by timeout). Then the small-T
# cells timed with the one-launch twins (`-o`, `-o2`, `-o5`) beside their two-launch schedules, same run.
# Results in $OUT/o.tgz; per-cell variant times last.
#   TOKENS=1,2,3,4,8 bash bench/h200_onelaunch_check.sh
export PYTHONUNBUFFERED=1
R=/tmp/o; rm -rf $R; mkdir -p $R
pack() { (cd $R && tar czf "$OUT/o.tgz" .); }
MOETUNE_TEST_GPU=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_triton_kernels.py \
  tests/codegen/test_triton_launch.py -k "one_launch" > $R/gputests.log 2>&1
echo "gpu tests rc=$?"; tail -n 3 $R/gputests.log; pack
timeout -k 10 -s INT ${BENCH_S:-300} python3 bench/kernels.py --out $R/b --baselines "" \
  --tags "(ga|gd|table)(-o.*)?" --tokens ${TOKENS:-1,2,3,4,8} --budget-s $((${BENCH_S:-300} - 30)) > $R/b.log 2>&1
echo "bench rc=$?"; pack; tail -n 3 $R/b.log
python3 - $R/b <<'PY'
import glob, json, sys
recs = json.load(open(glob.glob(f"{sys.argv[1]}/*-kernels.json")[0]))["records"]
cells = {}
for r in recs:
    cells.setdefault((r["shape"], r["tokens"]), []).append(r)
for (shape, T), rs in cells.items():
    got = sorted((r["time_us"], r["variant"]) for r in rs if "time_us" in r)
    bad = [f'{r["variant"]}: {r.get("error", "")[:60]}' for r in rs if "time_us" not in r]
    print(f"{shape} T={T} floor {rs[0]['floor_us']:.1f}: " + "  ".join(f"{v} {t:.1f}" for t, v in got)
          + (f"  FAILED {bad}" if bad else ""))
PY
