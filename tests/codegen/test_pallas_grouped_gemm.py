"""Pallas grouped_gemm: in TPU interpret mode (DMA races detected) against the float32 reference on every
routing edge, layout, activation and dtype; every default and some space points lowered for TPU at the
presets' real shapes; the space within each target's VMEM and the defaults inside it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

jax = pytest.importorskip("jax")

from pallas_cases import (  # noqa: E402
    BACKEND,
    CASES,
    FP8_PRESETS,
    LOWERED_PRESETS,
    TARGETS,
    case_block,
    check,
    lower_for_tpu,
)

from moetune.codegen.pallas_tpu import grouped_gemm as gg  # noqa: E402
from moetune.codegen.pallas_tpu import tiles as gt  # noqa: E402
from moetune.ir import MoEBlock, Schedule, UnsupportedSchedule, WeightFormat  # noqa: E402
from moetune.ir.presets import preset  # noqa: E402
from moetune.targets import get_target  # noqa: E402

FULL = gt.GemmParams(16, 256, 256, 256, 256)  # one column tile, one K step at D = F = 256
SPLIT = gt.GemmParams(16, 128, 128, 128, 128)  # two column tiles, two K steps: the accumulators and index maps


@pytest.fixture(autouse=True)
def races(monkeypatch):
    monkeypatch.setenv("MOETUNE_PALLAS_INTERPRET", "races")


def schedule(p: gt.GemmParams) -> Schedule:
    return Schedule("grouped_gemm", backend="pallas_tpu", params=p)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
    _, kw, T, route = case
    check(case_block(kw), schedule(FULL), T, route)


@pytest.mark.parametrize("p", [SPLIT, gt.GemmParams(32, 128, 256, 256, 128)], ids=["split", "tile_m=32"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_tiles_match_reference(p, dtype):
    """Several column tiles and K steps, tiles crossing expert boundaries (T·k = 26 rows over 8 experts)."""
    check(case_block(dict(dtype=dtype)), schedule(p), 13, "uniform", seed=3)


def test_only_sentinels_give_zeros():
    block = case_block({})
    ids = torch.full((5, 2), block.E, dtype=torch.long)
    ids[::2, 1] = -1
    out = check(block, schedule(FULL), 5, "uniform", ids=ids)
    assert torch.equal(out, torch.zeros_like(out))


def test_tile_metadata_skips_zero_row_experts():
    """Tiles only for non-empty experts, in order, covering each expert's rows; the count is the grid's."""
    import jax.numpy as jnp

    block = case_block({})
    ids = jnp.array([[5, 0], [5, 5], [0, 9], [5, -1]], jnp.int32)  # experts 0: 2 rows, 5: 4 rows
    r = gg.route(block, ids)
    assert r.counts.tolist() == [2, 0, 0, 0, 0, 4, 0, 0]
    group, m, total = gg.tile_metadata(r, jnp.ones(block.E, bool), 4, 8)
    assert int(total[0]) == 3 and group.shape == (2 + 8 - 1,)
    assert group.tolist()[:3] == [0, 5, 5] and m.tolist()[:3] == [0, 0, 1]
    group, m, total = gg.tile_metadata(r, jnp.arange(block.E) != 0, 4, 8)  # expert 0 off: rows 0–1 skipped
    assert int(total[0]) == 2 and group.tolist()[:2] == [5, 5] and m.tolist()[:2] == [0, 1]


@pytest.mark.parametrize("name", LOWERED_PRESETS)
def test_defaults_and_space_points_lower_for_tpu(name, monkeypatch):
    monkeypatch.delenv("MOETUNE_PALLAS_INTERPRET")
    block = preset(name)
    points = set()
    for target in TARGETS:
        t = get_target(target)
        points |= {gt.default_params(block, T, t) for T in (64, 1024)}
        sp = gt.space(block, t)
        first = {n: vals[0] for n, vals in sp.choices}
        last = {n: vals[-1] for n, vals in sp.choices}
        points.add(sp.make(**first))
        try:
            points.add(sp.make(**last))
        except UnsupportedSchedule:
            pass
    for p in points:
        for T in (64, 1024):  # deliberately both: T changes the grid and the padded rows
            assert "tpu_custom_call" in lower_for_tpu(gg.experts_fn(block, p, False), block, T), p


@pytest.mark.parametrize("case", CASES[6:], ids=[c[0] for c in CASES[6:]])
def test_every_layout_lowers_for_tpu(case, monkeypatch):
    monkeypatch.delenv("MOETUNE_PALLAS_INTERPRET")
    for dtype in ("float32", "bfloat16"):
        block = case_block(dict(case[1], dtype=dtype))
        for p in (FULL, SPLIT):
            assert "tpu_custom_call" in lower_for_tpu(gg.experts_fn(block, p, False), block, 13)


@pytest.mark.parametrize("name", LOWERED_PRESETS + FP8_PRESETS)
@pytest.mark.parametrize("target", TARGETS)
def test_defaults_are_points_of_a_space_within_vmem(name, target):
    block, t = preset(name), get_target(target)
    sp = BACKEND.kind("grouped_gemm", block).space(block, t)
    xb, wb = gt.dtype_bytes(block)
    for T in (1, 8, 64, 1024, 4096):
        p = gt.default_params(block, T, t)
        assert all(getattr(p, n) in vals for n, vals in sp.choices), (T, p)
        sp.admit(p)
    admitted = 0
    for values in sp.grid():
        try:
            p = sp.make(**values)
        except UnsupportedSchedule:
            continue
        admitted += 1
        assert gt.gate_up_vmem(block, gt.gate_up_tiles(p), xb, wb) <= 0.75 * t.vmem_bytes
        assert gt.down_vmem(block, gt.down_tiles(p), xb, wb) <= 0.75 * t.vmem_bytes
    assert admitted


def test_vmem_refuses_what_a_small_core_cannot_hold():
    block = preset("mixtral-8x7b")
    small = dataclasses.replace(get_target("tpu-v7"), vmem_bytes=8 * 2**20)
    sp = gt.space(block, small)
    with pytest.raises(UnsupportedSchedule, match="VMEM"):
        sp.make(tile_m=512, tile_n=1024, tile_k=2048, down_tile_n=1024, down_tile_k=2048)
    sp.make(tile_m=16, tile_n=128, tile_k=128, down_tile_n=128, down_tile_k=128)
    p = gt.default_params(block, 1024, small)
    sp.admit(p)


def test_larger_tiles_at_more_rows_per_expert():
    block, t = preset("qwen3-30b-a3b"), get_target("tpu-v6e")
    ms = [gt.default_params(block, T, t).tile_m for T in (1, 64, 1024, 8192)]
    assert ms == sorted(ms) and ms[-1] > ms[0]


@pytest.mark.parametrize("bad, why", [(dict(tile_m=8), "multiple of 16"), (dict(tile_n=100), "multiples of 128"),
                                      (dict(down_tile_k=0), "multiples of 128")])
def test_params_checked(bad, why):
    with pytest.raises(UnsupportedSchedule, match=why):
        gt.GemmParams(**bad)


def test_tiles_that_do_not_divide_are_refused():
    block = case_block({})
    with pytest.raises(UnsupportedSchedule, match="does not divide"):
        BACKEND.build(block, schedule(gt.GemmParams(16, 512, 256, 256, 256)))


def test_refusals_name_the_reason():
    odd = MoEBlock(E=8, k=2, D=2880, F=2880)
    assert "multiples of 128" in BACKEND.kinds(odd)["grouped_gemm"]
    with pytest.raises(UnsupportedSchedule, match="multiples of 128"):
        BACKEND.build(odd, schedule(FULL))
    fp8 = MoEBlock(E=8, k=2, D=256, F=256).with_weight_format(WeightFormat.fp8_block())
    assert BACKEND.kinds(fp8)["grouped_gemm"] is None


def test_cost_counts_padded_rows_and_weights():
    block = case_block(dict(dtype="bfloat16"))
    small, big = (BACKEND.cost(block, schedule(gt.GemmParams(m, 256, 256, 256, 256)), 4096)
                  for m in (16, 512))
    assert big[0] > small[0]  # more padded rows
    assert small[1] > big[1]  # more weight re-reads


FP8 = ((128, 128), "float32")
FP8_CASES = [  # name, block kwargs, T, routing
    ("fp8 uniform odd T", dict(dtype="bfloat16", fp8=FP8), 13, "uniform"),
    ("fp8 one hot expert", dict(dtype="bfloat16", fp8=FP8), 13, "hot"),
    ("fp8 one row per expert, weight on the input", dict(dtype="bfloat16", fp8=FP8, apply="input"), 4, "one_row"),
    ("fp8 sentinels, fp32 compute, k=1", dict(fp8=FP8, k=1), 5, "sentinels"),
]


@pytest.mark.parametrize("p", [FULL, SPLIT], ids=["full", "split"])
@pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_matches_reference(case, p):
    """w8a16: per scale block one matmul on the e4m3 values, scaled in f32; checked to the compute dtype's
    bound against the float32 reference on the dequantised weights."""
    _, kw, T, route = case
    check(case_block(kw), schedule(p), T, route)


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_fp8_defaults_lower_for_tpu(name, monkeypatch):
    monkeypatch.delenv("MOETUNE_PALLAS_INTERPRET")
    block = preset(name)
    points = {gt.default_params(block, T, get_target(t)) for t in TARGETS for T in (64, 1024)}
    for p in points:
        assert "tpu_custom_call" in lower_for_tpu(gg.experts_fn(block, p, False), block, 64), p


def test_fp8_formats_it_cannot_read_are_refused():
    ue8m0 = case_block(dict(dtype="bfloat16", fp8=((128, 128), "ue8m0")))
    assert "ue8m0" in BACKEND.kinds(ue8m0)["grouped_gemm"]
    small = case_block(dict(dtype="bfloat16", fp8=((64, 64), "float32")))
    assert "multiples of 128" in BACKEND.kinds(small)["grouped_gemm"]
    with pytest.raises(UnsupportedSchedule, match="multiples of 128"):
        BACKEND.build(small, schedule(FULL))
