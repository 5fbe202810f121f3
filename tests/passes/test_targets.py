"""The target table and `floor`: reference floors of four real shapes, hand arithmetic, the roofline pass."""

import dataclasses

import pytest
from pass_shapes import gpu_block

from moetune.ir import Bucket, IRError, MoEBlock, ScheduledBlock
from moetune.passes.pipeline import context
from moetune.passes.roofline import floor, roofline
from moetune.passes.stats import uniform
from moetune.targets import TARGETS, get_target, gpu_target

# Reference floors, µs at the datasheet rates, averaged over random uniform routings (so a few % from the
# expectation `floor` takes where the number of distinct experts varies most)
GPU_FLOORS = [
    ("qwen3-30b-a3b", 1, 15.7), ("qwen3-30b-a3b", 8, 102), ("qwen3-30b-a3b", 64, 248),
    ("qwen3-30b-a3b", 1024, 253),
    ("deepseek-v3", 1, 147), ("deepseek-v3", 16, 1870), ("deepseek-v3", 1024, 4704),
    ("qwen3.5-397b-a17b", 1, 52.4), ("qwen3.5-397b-a17b", 8, 392), ("qwen3.5-397b-a17b", 256, 2668),
    ("mixtral-8x7b", 1, 147), ("mixtral-8x7b", 4, 397), ("mixtral-8x7b", 64, 587),
    ("mixtral-8x7b", 1024, 730),
]


@pytest.mark.parametrize("name,T,floor_us", GPU_FLOORS)
def test_floor_reproduces_the_reference_floors(name, T, floor_us):
    f = floor(gpu_block(name), "h200", T)
    assert f.time_s * 1e6 == pytest.approx(floor_us, rel=0.015)
    assert f.target == "h200" and f.tokens == T


def test_floor_by_hand():
    block = MoEBlock(8, 2, 4096, 14336, routing_weight_dtype="float32")
    T = 1024
    d = 8 * (1 - (1 - 2 / 8) ** T)
    nbytes = d * 3 * 4096 * 14336 * 2 + 2 * T * 4096 * 2 + T * 2 * (8 + 4)
    flops = 2 * 3 * T * 2 * 4096 * 14336
    f = floor(block, "h200", T)
    assert f.bytes == pytest.approx(nbytes, rel=1e-12) and f.flops == flops
    assert f.bound == "compute" and f.time_s == pytest.approx(flops / 989e12)
    assert floor(block, "h200", 1).bound == "memory"


def test_floor_with_measured_stats():
    block = gpu_block("qwen3-30b-a3b")
    st = dataclasses.replace(uniform(128, 8).stats(8), distinct_experts=20.0)
    assert floor(block, "h200", 8, st).bytes < floor(block, "h200", 8).bytes
    with pytest.raises(IRError, match="another token count"):
        floor(block, "h200", 9, st)


def test_target_table():
    h = get_target("h200")
    assert (h.bandwidth, h.peak_flops) == (4.8e12, 989e12)
    assert h.measured_bandwidth < h.bandwidth and h.measured_flops < h.peak_flops
    assert {"h200", "tpu-v5e", "tpu-v6e", "tpu-v7", "cpu"} <= set(TARGETS)
    assert get_target("ironwood") is TARGETS["tpu-v7"]
    assert "bench cpu" in get_target("cpu").source and get_target("cpu").measured_bandwidth
    for t in TARGETS.values():
        assert t.source and t.ridge > 1
    assert {"h100", "a100", "b200"} <= set(TARGETS)
    hopper = get_target("h100")
    assert (hopper.bandwidth, hopper.sm_count, hopper.smem_per_block) == (3.35e12, 132, 227 * 1024)
    assert hopper.measured_bandwidth < hopper.bandwidth and get_target("a100").fp8_flops is None
    with pytest.raises(IRError, match="known: h200"):
        get_target("mi300x")


@pytest.mark.parametrize("name, target", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                          ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA B200", "b200"),
                                          ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090")])
def test_gpu_target_from_the_device_name(name, target):
    assert gpu_target(name) == target


def test_roofline_pass_before_expected():
    block = gpu_block("deepseek-v3", T_max=64)
    ctx = context(block, "tpu-v6e")
    st = ctx.routing.stats(23)  # [8, 64]'s representative count
    before = ScheduledBlock(block, (Bucket(1, 7, ctx.routing.stats(3)), Bucket(8, 64, st)))
    after = roofline(before, ctx)
    assert after.buckets[1].floor == floor(block, "tpu-v6e", 23, st)
    assert after.buckets[1].floor.bandwidth == 1640e9
    assert roofline(after, ctx) is after
