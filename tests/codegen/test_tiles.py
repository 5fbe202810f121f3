"""The backends' tile rules: each kind's default tiles change exactly where its ladder's cuts lie, every cut is a
real change, and constraints override what the rule picks."""

from __future__ import annotations

import dataclasses

import pytest

from moetune.codegen import tiles as shared
from moetune.codegen.pallas_gpu import grouped_gemm as pg_gemm
from moetune.codegen.pallas_gpu import tiles as pallas_gpu_tiles
from moetune.codegen.triton import (
    fused_gemv,
    grouped_gemm,
    grouped_gemm_fp8,
    hybrid,
    hybrid_fp8,
    stream_gemv,
    stream_gemv_fp8,
)
from moetune.codegen.triton import tiles as triton_tiles
from moetune.ir import UnsupportedSchedule
from moetune.ir.presets import PRESETS, preset
from moetune.targets import get_target

H200 = get_target("h200")
TOKENS = range(1, 1025)
# (rule's CUTS, key, kind module) of every ladder kind
LADDERS = [
    (triton_tiles.CUTS, "stream_gemv", stream_gemv, False),
    (triton_tiles.CUTS, "stream_gemv@fp8_block", stream_gemv_fp8, True),
    (triton_tiles.CUTS, "grouped_gemm", grouped_gemm, False),
    (triton_tiles.CUTS, "grouped_gemm@fp8_block", grouped_gemm_fp8, True),
    (triton_tiles.CUTS, "hybrid", hybrid, False),
    (triton_tiles.CUTS, "hybrid@fp8_block", hybrid_fp8, True),
    (triton_tiles.CUTS, "fused_gemv", fused_gemv, False),
    (triton_tiles.CUTS, "fused_gemv@fp8_block", fused_gemv, True),
    (pallas_gpu_tiles.CUTS, "grouped_gemm", pg_gemm, False),
]


def _blocks(fp8: bool):
    return [preset(n) for n in PRESETS if n.endswith("-fp8") == fp8]


@pytest.mark.parametrize("cuts,key,module,fp8", LADDERS, ids=[f"{c is triton_tiles.CUTS and 'triton' or 'pallas_gpu'}-"
                                                               f"{k}" for c, k, _, _ in LADDERS])
def test_defaults_change_exactly_at_the_cuts(cuts, key, module, fp8):
    """Between two cuts a kind's default is one point whatever T; at each cut a preset reaches within T ≤ 1024
    it is another (no cut in the table is dead)."""
    for block in _blocks(fp8):
        prev_rung, prev = None, None
        for T in TOKENS:
            r, p = shared.rung(cuts[key], block, T), module.default_params(block, T, H200)
            if prev is not None:
                assert (r != prev_rung) == (p != prev), (block.name, key, T, r, prev_rung, p, prev)
            prev_rung, prev = r, p


def test_the_gemm_ladder_reads_its_cuts_as_rows_per_active_expert():
    from moetune.passes.policy import rows_per_active

    block = preset("qwen3-30b-a3b")
    for T in (1, 40, 200, 1024, 4096):
        rows = rows_per_active(block, T)
        m = grouped_gemm.default_params(block, T, H200).block_m
        assert m == (16 if rows < 12 else 64 if rows < 48 else 128), (T, rows, m)


def test_constraints_override_the_rule_and_keep_the_rest():
    block = preset("qwen3-30b-a3b")
    d = grouped_gemm.default_params(block, 1, H200)
    c = grouped_gemm.default_params(block, 1, H200, {"block_n": 128, "num_stages": 3})
    assert (c.block_n, c.num_stages) == (128, 3)
    assert dataclasses.replace(c, block_n=d.block_n, num_stages=d.num_stages) == d
    g = stream_gemv_fp8.default_params(preset("qwen3-30b-a3b-fp8"), 1, H200, {"down_block_n": 4})
    assert g.down_block_n == 4
    with pytest.raises(ValueError, match="GemmParams has no field block_q"):
        grouped_gemm.default_params(block, 1, H200, {"block_q": 1})
    with pytest.raises((UnsupportedSchedule, ValueError)):  # the parameters' own check still holds
        pg_gemm.default_params(block, 1, H200, {"block_m": 8})
