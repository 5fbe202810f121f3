"""bench/proto_small_t.py's one-launch Gluon kernel (measured on the H200 in session 10) compiles for sm_90 on
this CPU machine: TMA loads from the producer partition, the consumers' CTA barrier scoped to their own 128
threads (a whole-CTA bar.sync would wait for the producer warp forever), the grid barrier's release add and
acquire load at gpu scope, shared memory within the H200's limit, no register spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H200_SMEM_LIMIT = 232448

SCRIPT = r'''
import json, os, re, subprocess, sys, tempfile
sys.path.insert(0, "bench")
import triton
import proto_small_t as S
shared, ptx = S.compile_sm90()
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
with tempfile.TemporaryDirectory() as d:
    open(os.path.join(d, "k.ptx"), "w").write(ptx)
    res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", os.path.join(d, "k.ptx"), "-o",
                          os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True)
spill = re.search(r"(\d+) bytes spill stores", res.stderr)
print(json.dumps(dict(shared=shared, tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                      bars=sorted(set(re.findall(r"bar\.sync\s+[^;]*;", ptx))),
                      release=len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)),
                      acquire=len(re.findall(r"ld\.global\.gpu\.acquire", ptx)),
                      spill=int(spill.group(1)) if spill else 0)))
'''


def test_one_launch_small_t_kernel_compiles_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("{")))
    assert r["tma"] > 0 and r["release"] == 1 and r["acquire"] == 1 and r["spill"] == 0, r
    assert r["bars"] and all(b.replace(" ", "").replace("\t", "").endswith(",128;") for b in r["bars"]), r
    assert r["shared"] <= H200_SMEM_LIMIT, r
