"""torch backend variants against the float32 reference: a table of cases, then hypothesis."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetune.codegen.backend import get
from moetune.codegen.common import ExpertTensors
from moetune.codegen.torch import experts_reference, tolerances
from moetune.codegen.torch._common import GATHER_WORKSPACE_BYTES, GroupedGemmParams
from moetune.codegen.torch.gathered import GatheredParams
from moetune.codegen.torch.hybrid import HybridParams, binomial_tail
from moetune.codegen.torch.tolerance import worst_error
from moetune.ir import Activation, MoEBlock, Schedule, UnsupportedSchedule, WeightLayout

BACKEND = get("torch")

# every variant, as a Schedule (hybrid's R = 2 so both halves run on the small cases)
VARIANTS = {
    "sorted_gemm/unsort": Schedule(
        "grouped_gemm", backend="torch", params=GroupedGemmParams("sorted_gemm", "unsort_sum")
    ),
    "sorted_gemm/index_add": Schedule(
        "grouped_gemm", backend="torch", params=GroupedGemmParams("sorted_gemm", "index_add")
    ),
    "grouped_mm/unsort": Schedule(
        "grouped_gemm", backend="torch", params=GroupedGemmParams("grouped_mm", "unsort_sum")
    ),
    "grouped_mm/index_add": Schedule(
        "grouped_gemm", backend="torch", params=GroupedGemmParams("grouped_mm", "index_add")
    ),
    "gathered/4": Schedule("stream_gemv", backend="torch", params=GatheredParams(4)),
    "gathered/256": Schedule("stream_gemv", backend="torch", params=GatheredParams(256)),
    "hybrid/sorted": Schedule(
        "hybrid", row_threshold=2, backend="torch", params=HybridParams("sorted_gemm", 4)
    ),
    "hybrid/grouped_mm": Schedule(
        "hybrid", row_threshold=3, backend="torch", params=HybridParams("grouped_mm", 16)
    ),
}

GPT_OSS_ACT = Activation("clamped_swiglu", alpha=1.702, limit=7.0)
GPT_OSS_LAYOUT = WeightLayout(transposed=True, interleaved=True, has_bias=True)


def make_block(E=8, k=2, D=64, F=40, dtype="float32", act=None, layout=None, apply="output") -> MoEBlock:
    return MoEBlock(
        E=E,
        k=k,
        D=D,
        F=F,
        activation=act or Activation(),
        layout=layout or WeightLayout(),
        weight_dtype=dtype,
        routing_weight_dtype=dtype,
        weight_application=apply,
        name="case",
    )


def make_tensors(block: MoEBlock, seed: int = 0) -> ExpertTensors:
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, block.weight_dtype)
    lay = block.layout

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    gu = rnd(*lay.gate_up_shape(block.E, block.D, block.F), scale=block.D**-0.5)
    dn = rnd(*lay.down_shape(block.E, block.D, block.F), scale=block.F**-0.5)
    if not lay.has_bias:
        return ExpertTensors(gu, dn)
    return ExpertTensors(gu, dn, rnd(block.E, 2 * block.F, scale=0.1), rnd(block.E, block.D, scale=0.1))


def routing(kind: str, T: int, E: int, k: int, seed: int = 0) -> torch.Tensor:
    """ids [T, k] (distinct per token where possible) for a named routing pattern."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return (
            torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            if T
            else torch.zeros(0, k, dtype=torch.long)
        )
    if (
        kind == "hot"
    ):  # expert 3 takes every token; the other k-1 slots also fixed: experts 0..E-1 mostly idle
        return torch.tensor([[3] + [(3 + j) % E for j in range(1, k)] for _ in range(T)], dtype=torch.long)
    if kind == "one_row":  # every (token, slot) a different expert: one row per active expert (T·k ≤ E)
        return torch.arange(T * k, dtype=torch.long).view(T, k) % E
    if kind == "sentinels":  # expert-parallel style ids outside [0, E)
        ids = routing("uniform", T, E, k, seed)
        ids[::2, 0] = E + 1
        ids[1::3, -1] = -1
        return ids
    raise ValueError(kind)


def run_case(block: MoEBlock, schedule: Schedule, T: int, route: str, seed: int = 0):
    w = make_tensors(block, seed)
    dt = getattr(torch, block.weight_dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, block.D, generator=g).to(dt)
    ids = routing(route, T, block.E, block.k, seed)
    weights = torch.softmax(torch.randn(T, block.k, generator=g), -1).to(dt)
    fn = BACKEND.build(block, schedule)
    out = fn(x, ids, weights, w)
    ref = experts_reference(block, x, ids, weights, w)
    return out, ref


CASES = [
    # name, block kwargs, T, routing
    ("fp32 uniform", dict(), 13, "uniform"),
    ("zero-row experts (k=1, T=3, E=16)", dict(E=16, k=1), 3, "uniform"),
    ("one hot expert takes all", dict(E=8, k=2), 17, "hot"),
    ("one row per expert", dict(E=16, k=4), 4, "one_row"),
    ("k=1", dict(E=4, k=1), 9, "uniform"),
    ("odd sizes D=200 F=72", dict(E=6, k=2, D=200, F=72), 7, "uniform"),
    ("bf16", dict(dtype="bfloat16"), 11, "uniform"),
    ("fp16", dict(dtype="float16"), 11, "uniform"),
    ("gpt-oss layout, clamped swiglu fp32", dict(act=GPT_OSS_ACT, layout=GPT_OSS_LAYOUT), 10, "uniform"),
    (
        "gpt-oss layout, clamped swiglu bf16",
        dict(act=GPT_OSS_ACT, layout=GPT_OSS_LAYOUT, dtype="bfloat16"),
        10,
        "hot",
    ),
    ("transposed only", dict(layout=WeightLayout(transposed=True)), 6, "uniform"),
    (
        "interleaved + bias, standard",
        dict(layout=WeightLayout(interleaved=True, has_bias=True)),
        6,
        "uniform",
    ),
    ("weight on the input", dict(apply="input"), 8, "uniform"),
    ("sentinel ids", dict(), 12, "sentinels"),
    ("T=1", dict(E=16, k=4), 1, "uniform"),
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_variant_matches_reference(case, variant):
    _, kw, T, route = case
    block = make_block(**kw)
    out, ref = run_case(block, VARIANTS[variant], T, route)
    assert out.dtype == getattr(torch, block.weight_dtype) and out.shape == (T, block.D)
    assert worst_error(out, ref) <= 1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_empty_and_noncontiguous(variant):
    block = make_block()
    w = make_tensors(block)
    fn = BACKEND.build(block, VARIANTS[variant])
    out = fn(torch.zeros(0, block.D), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), w)
    assert out.shape == (0, block.D) and out.dtype == torch.float32
    x = torch.randn(block.D, 9).t()  # [9, D], column-major
    ids = routing("uniform", 9, block.E, block.k)
    wt = torch.rand(9, block.k)
    torch.testing.assert_close(
        fn(x, ids, wt, w), experts_reference(block, x, ids, wt, w), rtol=1e-5, atol=1e-5
    )


def test_mixed_dtypes_fp32_routing_weights_bf16_model():
    """Mixtral/DeepSeek hand the experts float32 routing weights in a bf16 model."""
    block = make_block(dtype="bfloat16")
    w = make_tensors(block)
    x = torch.randn(5, block.D).bfloat16()
    ids = routing("uniform", 5, block.E, block.k)
    wt = torch.rand(5, block.k)  # float32
    for name, sch in VARIANTS.items():
        out = BACKEND.build(block, sch)(x, ids, wt, w)
        assert out.dtype == torch.bfloat16, name
        assert worst_error(out, experts_reference(block, x, ids, wt, w)) <= 1, name


def test_reads_weights_in_place():
    """No copy at build time: the kernel follows an in-place edit of the model's tensors."""
    block = make_block()
    w = make_tensors(block)
    fn = BACKEND.build(block, VARIANTS["sorted_gemm/unsort"])
    x, ids, wt = torch.randn(4, block.D), routing("uniform", 4, block.E, block.k), torch.rand(4, block.k)
    before = fn(x, ids, wt, w)
    with torch.no_grad():
        w.down.mul_(2)
    torch.testing.assert_close(fn(x, ids, wt, w), 2 * before)


# --------------------------------------------------------------------------- refusals and spaces --


def test_grouped_mm_refuses_misaligned_strides():
    block = make_block(D=37, F=19)
    with pytest.raises(UnsupportedSchedule, match="16 bytes.*impl=sorted_gemm"):
        BACKEND.build(block, VARIANTS["grouped_mm/unsort"])
    assert BACKEND.space(block, "grouped_gemm").choices[0] == ("impl", ("sorted_gemm",))
    out, ref = run_case(block, VARIANTS["sorted_gemm/unsort"], 5, "uniform")  # the loop still serves it
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_gathered_refuses_workspace_over_bound():
    big = make_block(E=8, k=2, D=4096, F=14336, dtype="bfloat16")  # 352 MiB per expert
    assert big.weight_bytes_per_expert > GATHER_WORKSPACE_BYTES
    why = BACKEND.kinds(big)["stream_gemv"]
    assert why and "limit 256 MiB" in why and "grouped_gemm" in why
    with pytest.raises(UnsupportedSchedule, match="limit 256 MiB"):
        BACKEND.build(big, Schedule("stream_gemv", backend="torch", params=GatheredParams(1)))
    mid = make_block(E=8, k=2, D=1024, F=2048, dtype="bfloat16")  # 12 MiB per expert: chunk ≤ 21
    with pytest.raises(UnsupportedSchedule, match="lower chunk to ≤ 21"):
        BACKEND.build(mid, Schedule("stream_gemv", backend="torch", params=GatheredParams(64)))
    assert BACKEND.space(mid, "stream_gemv").choices == (("chunk", (4, 16)),)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: GroupedGemmParams("cublas"),
        lambda: GroupedGemmParams(combine="atomic"),
        lambda: GatheredParams(0),
        lambda: HybridParams("eager"),
        lambda: HybridParams(chunk=-1),
    ],
)
def test_params_checked(bad):
    with pytest.raises(UnsupportedSchedule):
        bad()


def test_worst_error_scales_and_catches_nan():
    ref = torch.tensor([[100.0, 0.0]])
    assert worst_error(ref.bfloat16(), ref) == 0
    assert worst_error(torch.tensor([[100.0, 1.0]]).bfloat16(), ref) <= 1  # 1 % of the row's scale
    assert worst_error(torch.tensor([[100.0, 3.0]]).bfloat16(), ref) > 1
    assert worst_error(torch.tensor([[100.0, 1e-2]]), ref) > 1  # float32: 1e-5 of the scale
    assert worst_error(torch.tensor([[float("nan"), 0.0]]), ref) == float("inf")
    assert tolerances(torch.float16) == (5e-3, 5e-3)
    with pytest.raises(KeyError, match="float64"):
        tolerances(torch.float64)


def test_params_frozen_and_wrong_type_refused():
    p = GatheredParams(8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.chunk = 4
    with pytest.raises(UnsupportedSchedule, match="needs GatheredParams"):
        BACKEND.build(make_block(), Schedule("stream_gemv", backend="torch", params=GroupedGemmParams()))


@pytest.mark.parametrize("kind", ["grouped_gemm", "stream_gemv", "hybrid"])
def test_space_grid_builds(kind):
    block = make_block()
    space = BACKEND.space(block, kind)
    assert space.size() >= 2
    for values in space.grid():
        sch = Schedule(
            kind, row_threshold=2 if kind == "hybrid" else None, backend="torch", params=space.make(**values)
        )
        out, ref = run_case(block, sch, 6, "uniform")
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cost_orders_regimes():
    """GEMM reads each active expert once; the gathered GEMV reads, copies and re-reads one expert per
    pair; the hybrid sits between, near GEMM when most experts are heavy."""
    block = make_block(E=128, k=8, D=1024, F=512, dtype="bfloat16")
    gemm = Schedule("grouped_gemm", backend="torch", params=GroupedGemmParams())
    gemv = Schedule("stream_gemv", backend="torch", params=GatheredParams(16))
    f1, _ = BACKEND.cost(block, gemm, 1)
    assert f1 == pytest.approx(8 * (6 * 1024 * 512 + 4 * 512))
    for T, R in ((16, 2), (512, 8)):
        hyb = Schedule("hybrid", row_threshold=R, backend="torch", params=HybridParams())
        b_gemm, b_gemv, b_hyb = (BACKEND.cost(block, s, T)[1] for s in (gemm, gemv, hyb))
        assert b_gemm < b_gemv and b_hyb < b_gemv, T
        assert b_gemm <= 128 * block.weight_bytes_per_expert * 1.5
    assert BACKEND.cost(block, hyb, 512)[1] < 1.1 * BACKEND.cost(block, gemm, 512)[1]


def test_binomial_tail_against_direct_sum():
    import math

    n, q, r = 30, 0.2, 5
    pm = [math.comb(n, m) * q**m * (1 - q) ** (n - m) for m in range(n + 1)]
    p, m = binomial_tail(n, q, r)
    assert p == pytest.approx(sum(pm[r:])) and m == pytest.approx(sum(i * pm[i] for i in range(r, n + 1)))
    assert binomial_tail(4096, 0.5, 2000)[0] == pytest.approx(0.9, abs=0.1)  # no overflow


# --------------------------------------------------------------------------------- hypothesis --


@settings(max_examples=60, deadline=None)
@given(
    E=st.integers(1, 12),
    k_frac=st.floats(0, 1),
    T=st.integers(0, 24),
    seed=st.integers(0, 2**16),
    skew=st.floats(0, 4),
    variant=st.sampled_from(sorted(VARIANTS)),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    gpt_oss=st.booleans(),
)
def test_random_routing(E, k_frac, T, seed, skew, variant, dtype, gpt_oss):
    """Rows per expert drawn from a skewed distribution (skew 0: uniform; 4: a few experts take most),
    in either dtype, standard swiglu or GPT-OSS's layout and clamped swiglu."""
    k = max(1, round(k_frac * E))
    extra = dict(act=GPT_OSS_ACT, layout=GPT_OSS_LAYOUT) if gpt_oss else {}
    block = make_block(E=E, k=k, D=32, F=24, dtype=dtype, **extra)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) + skew * torch.linspace(0, 1, E)  # [T, E]
    ids = torch.topk(logits, k, dim=-1).indices  # [T, k]
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(getattr(torch, dtype))
    x = torch.randn(T, block.D, generator=g).to(getattr(torch, dtype))
    w = make_tensors(block, seed)
    out = BACKEND.build(block, VARIANTS[variant])(x, ids, weights, w)
    assert out.dtype == x.dtype and out.shape == (T, block.D)
    assert worst_error(out, experts_reference(block, x, ids, weights, w)) <= 1
