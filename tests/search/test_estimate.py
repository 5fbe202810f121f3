"""The cost model of `moetune tune --verify-only` and the block its candidates are checked on."""

from __future__ import annotations

import math
import os

import pytest

from moetune.codegen.pallas_tpu.lowering import GridCall
from moetune.ir import MoEBlock, WeightFormat
from moetune.ir.presets import preset
from moetune.passes.roofline import floor
from moetune.search.estimate import VERIFY_WEIGHT_BYTES, estimate_s, grid_steps, verify_block, verify_tokens
from moetune.targets import get_target

BF16 = MoEBlock(E=8, k=2, D=256, F=256, weight_dtype="bfloat16")
FP8 = BF16.with_weight_format(WeightFormat.fp8_block())


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e", "tpu-v7"])
def test_the_estimate_is_the_roofline_of_the_kernels_cost_plus_its_grid_steps(target):
    t = get_target(target)
    calls = (GridCall("gate_up", (4, 3), True), GridCall("down", (4, 2), True))
    flops, nbytes = 3e9, 2e6
    steps = math.ceil(4 / t.cores) * 3 + math.ceil(4 / t.cores) * 2
    assert grid_steps(calls, t) == steps
    want = max(nbytes / t.bandwidth, flops / t.peak_flops) + steps * t.grid_step_s
    assert estimate_s(BF16, target, flops, nbytes, calls) == pytest.approx(want)


def test_a_kernel_with_a_sequential_call_gets_one_cores_share_of_the_chip():
    t = get_target("tpu-v7")
    assert t.cores == 2
    calls = (GridCall("gate_up", (4,), True), GridCall("down", (4,), False))
    mem = 1e6 / (t.bandwidth / 2)
    assert estimate_s(BF16, t, 0.0, 1e6, calls) == pytest.approx(mem + (2 + 4) * t.grid_step_s)


def test_fp8_weights_are_estimated_at_the_fp8_peak_where_the_target_has_one():
    calls = (GridCall("k", (1,), True),)
    v7 = get_target("tpu-v7")
    assert estimate_s(FP8, v7, 1e12, 0.0, calls) == pytest.approx(1e12 / v7.fp8_flops + v7.grid_step_s)
    v5e = get_target("tpu-v5e")  # no FP8 matrix unit: the bf16 peak
    assert estimate_s(FP8, v5e, 1e12, 0.0, calls) == pytest.approx(1e12 / v5e.peak_flops + v5e.grid_step_s)


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e", "tpu-v7"])
def test_an_estimate_of_the_floors_own_work_is_at_least_the_floor(target):
    """The model is the floor's roofline plus overheads: a kernel moving the floor's bytes and doing its flops
    is estimated at or above it."""
    fl = floor(BF16, target, 16)
    assert estimate_s(BF16, target, fl.flops, fl.bytes, (GridCall("k", (2,), True),)) >= fl.time_s


def test_a_small_block_is_verified_as_it_is():
    assert verify_block(BF16) == (BF16, "the block itself (E=8)")


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3.5-397b-a17b-fp8", "mixtral-8x7b"])
def test_a_large_block_is_verified_on_fewer_experts_with_its_own_tiles(name):
    block = preset(name)
    small, said = verify_block(block)
    if block.E * block.weight_bytes_per_expert <= VERIFY_WEIGHT_BYTES:
        assert small is block
        return
    assert (small.k, small.D, small.F, small.layout, small.weight_format, small.activation) == (
        block.k, block.D, block.F, block.layout, block.weight_format, block.activation)
    assert 2 * block.k <= small.E < block.E and small.E % block.router.n_group == 0
    most = max(2 * block.k, VERIFY_WEIGHT_BYTES // block.weight_bytes_per_expert)  # then up to the groups
    assert small.E < most + block.router.n_group
    assert f"E={small.E} of {block.E}" in said


def test_the_verification_count_is_small_and_inside_small_buckets():
    from moetune.passes.pipeline import schedule_block

    for b in schedule_block(BF16, "tpu-v7", tokens=(1, 64)).buckets:
        assert 1 <= verify_tokens(b) <= 8 and (verify_tokens(b) >= b.lo or b.lo > 8)


@pytest.mark.parametrize("before", [None, "0"])
def test_interpret_mode_is_set_for_the_run_and_restored(before, monkeypatch):
    from moetune.codegen.pallas_tpu._common import INTERPRET_ENV, interpret_requested
    from moetune.search.estimate import interpreting

    if before is None:
        monkeypatch.delenv(INTERPRET_ENV, raising=False)
    else:
        monkeypatch.setenv(INTERPRET_ENV, before)
    with interpreting():
        assert interpret_requested() is not None
    assert os.environ.get(INTERPRET_ENV) == before
