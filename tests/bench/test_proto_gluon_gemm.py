"""bench/proto_gluon_gemm.py's Gluon kernels (warp-specialised gate/up GEMM, measured on the H200 in session
10) compile for sm_90 on this CPU machine: one m64n256 wgmma per K step over the [2, BN, BK] box, two TMA
loads per K step issued by the producer partition, register reallocation between the partitions, shared
memory within the H200's limit and no register spills (ptxas)."""

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
import proto_gluon_gemm as G
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
for two in (False, True):
    shared, ptx = G.compile_sm90(STAGES=4, num_warps=4 if two else 8, two=two)
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ptx)
        res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", os.path.join(d, "k.ptx"), "-o",
                              os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    print(json.dumps(dict(two=two, shared=shared, wgmma=sorted(set(re.findall(r"wgmma\.mma_async\S+", ptx))),
                          tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                          setmaxnreg=len(re.findall(r"setmaxnreg", ptx)),
                          spill=int(spill.group(1)) if spill else 0)))
'''


def test_gluon_gate_up_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["two"] for r in rows] == [False, True]
    for r in rows:
        assert r["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"], r
        assert r["tma"] == 2 and r["setmaxnreg"] > 0 and r["spill"] == 0, r
        assert r["shared"] <= H200_SMEM_LIMIT, r
