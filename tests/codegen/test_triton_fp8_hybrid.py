"""Triton hybrid on FP8 block-quantised weights against the float32 reference on the dequantised weights (CPU:
interpreted, 32 × 32 scale blocks to keep it quick): heavy experts through the GEMM tiles, light ones through
the GEMV rows, in every routing case and in skewed random ones (hypothesis); its space, default and refusals.
Its sm_90 compile is test_triton_fp8_stream_gemv's (`fp8_gemv_sm90.py` lists the hybrid's configurations too)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_triton_fp8_stream_gemv import CASES, check, fp8_block, fp8_preset, make_problem
from triton_cases import ON_GPU

from moetune.codegen.torch.reference import experts_reference
from moetune.codegen.triton import BACKEND, Fp8HybridParams
from moetune.codegen.triton.hybrid_fp8 import KIND
from moetune.ir import MoEBlock, Schedule, UnsupportedSchedule


def sched(R: int, **kw) -> Schedule:
    return Schedule("hybrid", backend="triton", params=Fp8HybridParams(**kw), row_threshold=R)


SCHEDULES = {  # for 32 × 32 scale blocks: 16-row tiles with two-block GEMV chunks; 32-row tiles, half-block chunks
    "m16": dict(block_m=16, block_n=32, block_k=32, gemv_block_n=16, gemv_block_k=64, down_block_n=32,
                down_block_k=32, down_gemv_block_n=8, down_gemv_block_k=32),
    "m32": dict(block_m=32, block_n=16, block_k=16, gemv_block_n=32, gemv_block_k=16, down_block_n=16,
                down_block_k=16, down_gemv_block_n=32, down_gemv_block_k=64, num_stages=2, down_stages=2),
}
PAIRS = [(c, s, R) for c in CASES for s in SCHEDULES for R in (2, 4)
         if s == "m16" or R == 2 and c[0] in ("uniform", "one_expert_every_row", "ue8m0", "fp16_weight_on_input")]


@pytest.mark.parametrize("case, name, R", PAIRS, ids=[f"{c[0]}-{s}-R{R}" for c, s, R in PAIRS])
def test_against_reference(case, name, R, poisoned):
    """Every output element written (torch.empty poisoned) and within the dtype's bound of the float32 reference;
    at R = 2 every expert with two rows or more takes GEMM tiles, at R = 4 only the busier ones."""
    label, E, k, D, F, T, routing, fb, sd, compute, over = case
    block, x, ids, weights, w = make_problem(E, k, D, F, T, routing, fb, sd, compute, over)
    check(block, x, ids, weights, w, sched(R, **SCHEDULES[name]), f"{label}/{name}/R={R}")


@settings(max_examples=8, deadline=None)
@given(E=st.integers(2, 8), k=st.integers(1, 3), T=st.integers(1, 24), nd=st.integers(1, 3), nf=st.integers(1, 3),
       sd=st.sampled_from(["float32", "ue8m0"]), R=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**16),
       name=st.sampled_from(sorted(SCHEDULES)))
def test_hypothesis_shapes_and_routings(E, k, T, nd, nf, sd, R, seed, name):
    """Skewed routings (experts of random popularity: some over R rows, some under, some none) over small shapes
    in whole 32×32 blocks, at any row threshold."""
    k = min(k, E)
    gen = torch.Generator().manual_seed(seed)
    pop = torch.rand(E, generator=gen) ** 3 + 1e-3
    block, x, _, weights, w = make_problem(E, k, 32 * nd, 32 * nf, T, "uniform", (32, 32), sd, "bfloat16", {},
                                           seed=seed)
    ids = torch.stack([torch.multinomial(pop, k, replacement=False, generator=gen) for _ in range(T)]).to(x.device)
    check(block, x, ids, weights, w, sched(R, **SCHEDULES[name]),
          f"{name} R={R} E={E} k={k} T={T} D={block.D} F={block.F} {sd}")


def test_both_halves_run_in_one_call():
    """A hot expert (every token) beside one-row experts at R = 4: the tiles serve the hot one, the GEMV rows the
    rest; each half alone is also right (R = 2: all tiles but the one-row experts; R above T: all GEMV)."""
    block, x, ids, weights, w = make_problem(8, 2, 64, 64, 6, "one_hot_expert", (32, 32), "float32", "bfloat16", {})
    counts = torch.bincount(ids.flatten(), minlength=8)
    assert counts.max() >= 4 and ((counts >= 1) & (counts < 4)).any()
    for R in (2, 4, 7):
        check(block, x, ids, weights, w, sched(R, **SCHEDULES["m16"]), f"hot expert R={R}")


@pytest.mark.skipif(not ON_GPU, reason="the interpreter widens the e4m3 NaN byte to 480: a GPU check "
                                       "(MOETUNE_TEST_GPU=1 on the GPU machine)")
@pytest.mark.parametrize("R", [2, 7])
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_nan_in_a_weight_propagates(proj, R):
    """A NaN weight (e4m3 0x7F) of the hot expert makes NaN exactly the outputs the reference makes NaN, whether its
    rows go through the GEMM tiles (R = 2) or the GEMV rows (R = 7, above its row count)."""
    block, x, ids, weights, w = make_problem(8, 2, 64, 64, 6, "one_hot_expert", (32, 32), "float32", "bfloat16", {})
    e = int(torch.bincount(ids.flatten(), minlength=8).argmax())
    (w.gate_up if proj == "gate_up" else w.down).view(torch.uint8)[e, 5, 7] = 0x7F
    out = BACKEND.build(block, sched(R, **SCHEDULES["m16"]))(x, ids, weights, w)
    ref = experts_reference(block, x, ids, weights, w)
    assert torch.isnan(ref).any() and torch.equal(torch.isnan(out), torch.isnan(ref))


@pytest.mark.parametrize("bad, why", [
    (dict(block_n=64), "block_n = 64 must divide the block rows 32"),
    (dict(block_k=64), "block_k = 64 must divide the block columns 32"),
    (dict(gemv_block_k=48), "power of two"),
    (dict(block_m=8), "tl.dot tiles need ≥ 16, got block_m = 8"),
    (dict(gemv_block_n=32, gemv_block_k=512), "registers"),
])
def test_params_refused_with_reason(bad, why):
    space = BACKEND.space(fp8_block(8, 2, 64, 64, (32, 32)), "hybrid")
    with pytest.raises(UnsupportedSchedule, match=why):
        space.make(**{**SCHEDULES["m16"], **bad})


def test_refusals_and_the_kind_it_is():
    q = fp8_block(8, 2, 200, 128, (128, 128))
    why = BACKEND.kinds(q)["hybrid"]
    assert why and "hybrid" in why and "D = 200" in why, why
    assert BACKEND.kind("hybrid", fp8_block(8, 2, 256, 128)) is KIND
    assert KIND.refusal(MoEBlock(E=8, k=2, D=256, F=128)), "unquantised weights are the bf16 hybrid's"
    with pytest.raises(UnsupportedSchedule, match="not a multiple"):
        BACKEND.build(q, sched(4))


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3.5-397b-a17b", "deepseek-v3", "mixtral-8x7b"])
def test_defaults_are_points_of_the_space(name):
    block = fp8_preset(name)
    space = BACKEND.space(block, "hybrid")
    for T in (1, 16, 256):
        p = BACKEND.default(block, "hybrid", T).params
        space.admit(p)
        flops, nbytes = BACKEND.cost(block, Schedule("hybrid", backend="triton", params=p, row_threshold=4), T)
        assert flops > 0 and nbytes > block.weight_bytes_per_expert
