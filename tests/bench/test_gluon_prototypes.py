"""The Gluon prototypes in bench/ compile for sm_90 on this CPU machine.

proto_gluon_gemm.py (warp-specialised gate/up GEMM): one m64n256 wgmma per K step over the [2, BN, BK] box, two
TMA loads per K step issued by the producer partition, register reallocation between the partitions.
proto_small_t.py (the whole block at a few tokens in one launch): TMA loads from the producer partition, the
consumers' CTA barrier scoped to their own 128 threads (a whole-CTA bar.sync would wait for the producer warp
forever), the grid barrier's release add and acquire load at gpu scope.
Both: shared memory within the H200's limit, no register spills (ptxas)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H200_SMEM_LIMIT = 232448

PTXAS = r'''
import json, os, re, subprocess, sys, tempfile
sys.path.insert(0, "bench")
import triton


def ptxas_spills(ptx):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ptx)
        res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", os.path.join(d, "k.ptx"), "-o",
                              os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return int(spill.group(1)) if spill else 0
'''

GEMM = r'''
import proto_gluon_gemm as G
for two in (False, True):
    shared, ptx = G.compile_sm90(STAGES=4, num_warps=4 if two else 8, two=two)
    print(json.dumps(dict(two=two, shared=shared, wgmma=sorted(set(re.findall(r"wgmma\.mma_async\S+", ptx))),
                          tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                          setmaxnreg=len(re.findall(r"setmaxnreg", ptx)), spill=ptxas_spills(ptx))))
'''

SMALL_T = r'''
import proto_small_t as S
assert ptxas_spills(S.compile_sm90(LATE=True)[1]) == 0  # the down loop's once-per-token sums
assert ptxas_spills(S.compile_sm90(LATE=True, W=8)[1]) == 0  # eight consumer warps
base = dict(LATE=False, W=4, IDREG=False, LOWP=False, BAR=False, DYN=False, TM=2)
assert S.parse_config("8x12LW8") == dict(base, SLOTS=8, NB=12, LATE=True, W=8)
best = S.parse_config("8x12LRHBD")
assert best == dict(base, SLOTS=8, NB=12, LATE=True, IDREG=True, LOWP=True, BAR=True, DYN=True), best
assert S.parse_config("8x16Lt1")["TM"] == 1 and S.config_name(best) == "one-launch-8x12LRHBD"
for cfg in ({}, best):
    shared, ptx = S.compile_sm90(**cfg)
    print(json.dumps(dict(best=bool(cfg), shared=shared, tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                          bars=sorted(set(re.findall(r"bar\.sync\s+[^;]*;", ptx))),
                          release=len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)),
                          acquire=len(re.findall(r"ld\.global\.gpu\.acquire", ptx)),
                          bf16x2=len(re.findall(r"\.bf16x2", ptx)), spill=ptxas_spills(ptx))))
'''


def _compile(script: str) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", PTXAS + script], env=env, capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_gluon_gate_up_kernels_compile_for_sm90():
    rows = _compile(GEMM)
    assert [r["two"] for r in rows] == [False, True]
    for r in rows:
        assert r["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"], r
        assert r["tma"] == 2 and r["setmaxnreg"] > 0 and r["spill"] == 0, r
        assert r["shared"] <= H200_SMEM_LIMIT, r


def test_one_launch_small_t_kernel_compiles_for_sm90():
    rows = _compile(SMALL_T)
    assert [r["best"] for r in rows] == [False, True]
    for r in rows:  # the grid barrier: one release add and one acquire spin per program, in both barrier forms
        assert r["tma"] > 0 and r["release"] == 1 and r["acquire"] == 1 and r["spill"] == 0, r
        assert r["bars"] and all(b.replace(" ", "").replace("\t", "").endswith(",128;") for b in r["bars"]), r
        assert r["shared"] <= H200_SMEM_LIMIT, r
    assert rows[0]["bf16x2"] == 0 < rows[1]["bf16x2"], rows  # H: the down loop's packed bf16 products
