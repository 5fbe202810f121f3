"""The torch backend as a whole: every variant on empty and non-contiguous inputs and mixed dtypes, every
point of every space, the cost model's order of the regimes, and skewed routings drawn by hypothesis."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_cases import (
    BACKEND,
    GPT_OSS_ACT,
    GPT_OSS_LAYOUT,
    VARIANTS,
    make_block,
    make_tensors,
    routing,
    run_case,
)

from moetune.codegen.torch import GatheredParams, GroupedGemmParams, HybridParams, experts_reference, worst_error
from moetune.ir import Schedule


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
