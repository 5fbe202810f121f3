"""Every representative Triton config compiles for sm_90 on this CPU machine and fits the H200.

Compilation runs in a subprocess with TRITON_INTERPRET unset (interpreted kernels cannot be compiled).
`triton_sm90.representative()` holds one config per kernel path that the bench's winners use; the
slow test compiles every candidate the bench times and every default schedule, on every shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from moetune.targets import TARGETS  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
H200_SMEM_LIMIT = TARGETS["h200"].smem_per_block


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
        if "_tma" in r["label"]:
            assert r["tma"] > 0, f"{r['label']}: no TMA load (cp.async.bulk.tensor)"
        elif r["label"].split("/")[0] in ("gemv", "gemm", "hybrid"):
            assert r["cp_async"] > 0, f"{r['label']}: weight loads not pipelined (no cp.async)"
        if "m16" in r["label"] or "m128" in r["label"] or "rows16" in r["label"] or "hybrid" in r["label"]:
            assert r["mma"] > 0, f"{r['label']}: no tensor-core instruction"
        if r["label"] == "gemm/gate_up_m128_tma_one_dot":  # one wgmma of N = 2·BN from the [2, BN, BK] box
            assert r["wgmma_n"] == 256 and r["tma"] > 0, f"{r['label']}: {r}"
        if r["label"].startswith("combine"):  # each thread sums its own vector of the k rows
            assert r["bar_sync"] == 0, f"{r['label']}: the sum over k crosses threads (bar.sync)"


SWEEP = r'''
import json, sys
from dataclasses import replace
from bench import kernels as B
from bench import cells
from moetune.codegen.triton import BACKEND
from moetune.runtime.table import DispatchTable
from moetune.runtime.versions import kernel_source_hash
with DispatchTable("cache/h200.sqlite", create=False) as t:  # judged as on the H200 the table was tuned on
    here = replace(t.entries(target="h200", backend="triton")[0].versions, kernel_hash=kernel_source_hash("triton"))
from triton_sm90 import compile_sm90, schedule_kernels
seen = set()
for shape in cells.SHAPES:
    block = cells.bench_block(shape)
    for T in cells.TOKENS:
        defaults = [(f"default-{kind}", BACKEND.default(block, kind, T)) for kind in BACKEND.kinds(block)]
        for tag, s in B.candidates(block, T, table="cache/h200.sqlite", samples=1, versions=here) + defaults:
            for _, kern, cx, o in schedule_kernels(block, T, s):
                key = (kern.fn.__name__, tuple(sorted(cx.items())), repr(sorted(o.items())))
                if key in seen:
                    continue
                seen.add(key)
                c = compile_sm90(kern, cx, fp32_out=cx.get("PROJ") == 1, **o)
                print(json.dumps(dict(label=f"{shape}/T{T}/{tag}", shared=c.metadata.shared)), flush=True)
'''


@pytest.mark.slow
def test_every_bench_config_and_default_fits_h200():
    """Every candidate the bench times (the table's choice, the defaults, a sample of the tuner's space) and
    every kind's default schedule, on the bench's four shapes and twelve token counts, compiles for sm_90."""
    rows = _compile(SWEEP)
    assert rows
    over = [r for r in rows if r["shared"] > H200_SMEM_LIMIT]
    assert not over, over


@pytest.mark.slow
def test_every_shipped_table_winner_compiles_for_sm_90():
    """Every kernel of every winner in cache/h200.sqlite compiles for sm_90 at its bucket's edges; the PTX
    digests are what `python tests/codegen/triton_sm90.py --digests cache/h200.sqlite` prints (compared
    before and after a source edit that must not change the code)."""
    rows = _compile("import json, triton_sm90 as S; "
                    "print(json.dumps(S.table_digests('cache/h200.sqlite')))")
    assert len(rows) == 1
    digests = rows[0]
    entries = {k.split(" T=")[0] for k in digests}
    assert len(entries) >= 40 and all(len(v) == 16 for v in digests.values())
