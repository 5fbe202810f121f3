"""Every representative Triton config compiles for sm_90 on this CPU machine and fits the H200.

Compilation runs in a subprocess with TRITON_INTERPRET unset (interpreted kernels cannot be compiled).
`triton_sm90.representative()` holds one config per kernel path that the bench's winners use; the
slow test compiles every configuration the bench sweeps and every default schedule, on every shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from moetune.codegen.triton._common import H200_SMEM_LIMIT  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def _compile(script: str) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_representative_configs_fit_h200():
    rows = _compile("import triton_sm90; triton_sm90.main()")
    assert len(rows) >= 10
    for r in rows:
        assert r["shared"] <= H200_SMEM_LIMIT, f"{r['label']}: {r['shared']} B shared > {H200_SMEM_LIMIT}"
        assert r["local"] == 0, f"{r['label']}: register spills to local memory"
        assert r["spill_bytes"] == 0 and r["regs"] <= 255, f"{r['label']}: ptxas: {r['regs']} registers, " \
            f"{r['spill_bytes']} bytes spilled"
        if r["label"].endswith("_tma"):
            assert r["tma"] > 0, f"{r['label']}: no TMA load (cp.async.bulk.tensor)"
        elif r["label"].split("/")[0] in ("gemv", "gemm", "hybrid"):
            assert r["cp_async"] > 0, f"{r['label']}: weight loads not pipelined (no cp.async)"
        if "m16" in r["label"] or "m128" in r["label"] or "rows16" in r["label"] or "hybrid" in r["label"]:
            assert r["mma"] > 0, f"{r['label']}: no tensor-core instruction"


SWEEP = r'''
import json, sys
sys.path.insert(0, "bench")
import kernels as B
from moetune.codegen.triton import BACKEND
from moetune.ir import MoEBlock
from triton_sm90 import compile_sm90, tma_descs
from moetune.codegen.triton.stream_gemv import stream_gemv_kernel
from moetune.codegen.triton.grouped_gemm import grouped_gemm_kernel, grouped_gemm_tma_kernel
from moetune.codegen.triton.hybrid import hybrid_kernel
seen = set()
def cc(label, kern, cx, **o):
    key = (label, tuple(sorted(cx.items())), repr(sorted(o.items())))
    if key in seen:
        return
    seen.add(key)
    k = compile_sm90(kern, cx, fp32_out=cx.get("PROJ") == 1, **o)
    print(json.dumps(dict(label=label, shared=k.metadata.shared)), flush=True)
base = dict(ACT=0, HAS_BIAS=False, W_IN=False, UPCAST=False)
for shape, (E, k, D, F) in B.SHAPES.items():
    be = max(16, 1 << (E - 1).bit_length())
    kp = 1 << (k - 1).bit_length()
    block = MoEBlock(E=E, k=k, D=D, F=F, name=shape)
    for T in B.TOKENS:
        defaults = [(f"default-{kind}", BACKEND.default(block, kind, T)) for kind in BACKEND.kinds(block)]
        for tag, s in B.variants(E, k, D, F, T) + defaults:
            p = s.params
            lab = f"{shape}/T{T}/{tag}"
            if s.kind == "stream_gemv":
                m = dict(base, K_TOP=k, KP=kp, BLOCK_E=be, BP=16, FUSED=p.fused_route and T * k <= 64,
                         ROWS=p.rows, STAGES=p.num_stages)
                cc(lab, stream_gemv_kernel, dict(m, PROJ=0, BN=p.block_n, BK=p.block_k),
                   num_warps=p.num_warps, num_stages=p.num_stages)
                cc(lab, stream_gemv_kernel, dict(m, PROJ=2 if p.down_mode == "token" else 1,
                   BN=p.down_block_n, BK=p.down_block_k), num_warps=p.down_warps, num_stages=p.num_stages)
            elif s.kind == "grouped_gemm" and p.tma:
                m = dict(base, BLOCK_E=be, BM=p.block_m, GROUP_M=p.group_m)
                cc(lab, grouped_gemm_tma_kernel, dict(m, PROJ=0, BN=p.block_n, BK=p.block_k),
                   num_warps=p.num_warps, num_stages=p.num_stages, descs=tma_descs(p.block_m, p.block_n, p.block_k))
                cc(lab, grouped_gemm_tma_kernel, dict(m, PROJ=1, BN=p.down_block_n, BK=p.down_block_k),
                   num_warps=p.down_warps, num_stages=p.down_stages,
                   descs=tma_descs(p.block_m, p.down_block_n, p.down_block_k))
            elif s.kind == "grouped_gemm":
                m = dict(base, K_TOP=k, BLOCK_E=be, BM=p.block_m, GROUP_M=p.group_m)
                cc(lab, grouped_gemm_kernel, dict(m, PROJ=0, BN=p.block_n, BK=p.block_k, ONE_DOT=p.one_dot),
                   num_warps=p.num_warps, num_stages=p.num_stages)
                cc(lab, grouped_gemm_kernel, dict(m, PROJ=1, BN=p.down_block_n, BK=p.down_block_k),
                   num_warps=p.down_warps, num_stages=p.down_stages)
            else:
                rp = 1 << max(0, (s.row_threshold - 2).bit_length())
                m = dict(base, K_TOP=k, BLOCK_E=be, BM=p.block_m, RP=rp)
                cc(lab, hybrid_kernel, dict(m, PROJ=0, BN=p.block_n, BK=p.block_k, BNV=p.gemv_block_n,
                   BKV=p.gemv_block_k, STAGES=p.num_stages), num_warps=p.num_warps, num_stages=p.num_stages)
                cc(lab, hybrid_kernel, dict(m, PROJ=1, BN=p.down_block_n, BK=p.down_block_k,
                   BNV=p.down_gemv_block_n, BKV=p.down_gemv_block_k, STAGES=p.down_stages),
                   num_warps=p.down_warps, num_stages=p.down_stages)
'''


@pytest.mark.slow
def test_every_bench_config_and_default_fits_h200():
    """Every configuration the bench sweeps and every default schedule, on the four gpu.md shapes and the
    twelve token counts, compiles for sm_90 (~80 s on one CPU core)."""
    rows = _compile(SWEEP)
    assert rows
    over = [r for r in rows if r["shared"] > H200_SMEM_LIMIT]
    assert not over, over
