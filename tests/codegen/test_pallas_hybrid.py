"""Pallas hybrid (heavy experts through large row tiles, light ones through small row tiles of the same
grouped matmul): in TPU interpret mode (DMA races detected) against the float32 reference with both sides
running, one side empty, every layout; defaults lowered for TPU at the presets' real shapes and inside a
space within each target's VMEM; the policy's threshold."""

from __future__ import annotations

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

from moetune.codegen.pallas_tpu import hybrid as hy  # noqa: E402
from moetune.codegen.pallas_tpu import tiles as gt  # noqa: E402
from moetune.ir import Schedule, UnsupportedSchedule  # noqa: E402
from moetune.ir.presets import preset  # noqa: E402
from moetune.passes.policy import hybrid_threshold, rows_per_active  # noqa: E402
from moetune.targets import get_target  # noqa: E402

P = hy.HybridParams(32, 256, 256, 256, 256, 16)


@pytest.fixture(autouse=True)
def races(monkeypatch):
    monkeypatch.setenv("MOETUNE_PALLAS_INTERPRET", "races")


def schedule(R: int, p: hy.HybridParams = P) -> Schedule:
    return Schedule("hybrid", row_threshold=R, backend="pallas_tpu", params=p)


def mixed_ids(T: int, E: int) -> torch.Tensor:
    """Slot 0 of every token to expert 3 (heavy), slot 1 spread over the others (light, 1–2 rows each)."""
    ids = torch.empty(T, 2, dtype=torch.long)
    ids[:, 0] = 3
    ids[:, 1] = torch.tensor([e for e in range(E) if e != 3] * T)[:T]
    return ids


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
    _, kw, T, route = case
    check(case_block(kw), schedule(2), T, route)


@pytest.mark.parametrize("R", [2, 3, 32], ids=["R=2", "R=3", "all light"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_sides_match_reference(R, dtype):
    """One heavy expert (13 rows) and seven light ones; R = 32 sends every expert to the light side."""
    block = case_block(dict(dtype=dtype))
    check(block, schedule(R), 13, "", ids=mixed_ids(13, block.E))


def test_light_tile_of_32_rows_and_sentinels():
    block = case_block(dict(dtype="bfloat16"))
    ids = mixed_ids(13, block.E)
    ids[::4, 1] = -1
    ids[1, 0] = block.E
    check(block, schedule(4, hy.HybridParams(16, 128, 128, 128, 128, 32)), 13, "", ids=ids)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_both_sides_match_reference(dtype):
    block = case_block(dict(dtype=dtype, fp8=((128, 128), "float32")))
    check(block, schedule(2, hy.HybridParams(16, 128, 256, 256, 128, 16)), 13, "", ids=mixed_ids(13, block.E))


def test_default_threshold_is_the_policys():
    block = preset("qwen3-30b-a3b")
    for T in (1, 16, 64, 1024):
        assert BACKEND.default(block, "hybrid", T).row_threshold == hybrid_threshold(rows_per_active(block, T))


@pytest.mark.parametrize("bad, why", [(dict(light_tile_m=8), "multiple of 16"), (dict(tile_m=48), "power of two")])
def test_params_checked(bad, why):
    with pytest.raises(UnsupportedSchedule, match=why):
        hy.HybridParams(**bad)


@pytest.mark.parametrize("name", LOWERED_PRESETS + FP8_PRESETS)
def test_defaults_lower_for_tpu_within_vmem(name, monkeypatch):
    monkeypatch.delenv("MOETUNE_PALLAS_INTERPRET")
    block = preset(name)
    xb, wb = gt.dtype_bytes(block)
    lowered = set()
    for target in TARGETS:
        t = get_target(target)
        sp = hy.space(block, t)
        for T in (64, 1024):
            s = BACKEND.default(block, "hybrid", T)
            p = hy.default_params(block, T, t)
            assert all(getattr(p, n) in vals for n, vals in sp.choices), (T, p)
            sp.admit(p)
            for gu, dn in ((gt.gate_up_tiles(p), gt.down_tiles(p)), hy.light_tiles(p)):
                assert gt.gate_up_vmem(block, gu, xb, wb) <= 0.75 * t.vmem_bytes
                assert gt.down_vmem(block, dn, xb, wb) <= 0.75 * t.vmem_bytes
            if (p, s.row_threshold, T) not in lowered:
                lowered.add((p, s.row_threshold, T))
                text = lower_for_tpu(hy.experts_fn(block, p, s.row_threshold, False), block, T)
                assert text.count("tpu_custom_call") >= 4  # two passes of two GEMMs


def test_cost_splits_rows_between_the_sides():
    block = preset("qwen3-30b-a3b")
    (hr, he), (lr, le) = hy.sides(block, 64, 4)
    assert hr + lr == pytest.approx(64 * block.k) and he > 0 and le > 0
    flops, moved = BACKEND.cost(block, BACKEND.default(block, "hybrid", 64), 64)
    assert flops > 0 and moved > 0
