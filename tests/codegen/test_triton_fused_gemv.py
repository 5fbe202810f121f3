"""Triton fused_gemv (one launch) against the float32 reference: every case of the table on unquantised weights,
the FP8 cases on block-quantised ones (float32 and ue8m0 scales), skewed routings; the counters back at zero after
every call; its parameters' refusals; on an H200 (MOETUNE_TEST_GPU=1) the preset shapes bf16 and FP8, eager,
back to back and in CUDA-graph replays:

    MOETUNE_TEST_GPU=1 python -m pytest -p no:logging tests/codegen/test_triton_fused_gemv.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("moetune.codegen.triton")
from test_triton_fp8_stream_gemv import CASES as FP8_CASES  # noqa: E402
from test_triton_fp8_stream_gemv import check as fp8_check  # noqa: E402
from test_triton_fp8_stream_gemv import make_problem as fp8_problem  # noqa: E402
from triton_cases import CASES, DEV, ON_GPU, check_against_reference, make_problem, of_kind, within  # noqa: E402

from moetune.codegen.backend import get  # noqa: E402
from moetune.codegen.torch.reference import experts_reference  # noqa: E402
from moetune.codegen.triton import BACKEND, FusedGemvParams  # noqa: E402
from moetune.codegen.triton.fused_gemv import KIND  # noqa: E402
from moetune.ir import MoEBlock, Schedule, UnsupportedSchedule  # noqa: E402
from moetune.ir.presets import preset  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402

GPU = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (MOETUNE_TEST_GPU=1 on the H200)")


def sched(**kw) -> Schedule:
    return Schedule("fused_gemv", backend="triton", params=FusedGemvParams(**kw))


@pytest.mark.parametrize("name", of_kind("fused_gemv"))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference(case, name, poisoned):
    check_against_reference(case, name, poisoned)


# FP8 tiles within (32, 32) scale blocks: gate/up chunks of two column blocks and of half a block
FP8_SCHEDULES = {
    "two_blocks": sched(block_f=16, block_k=64, block_d=16, down_block_k=32),
    "half_block": sched(block_f=32, block_k=16, block_d=8, down_block_k=16, prefetch=False, pdl=True),
}


@pytest.mark.parametrize("name", sorted(FP8_SCHEDULES))
@pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_against_reference(case, name, poisoned):
    """FP8 block-quantised weights (float32 and ue8m0 scales, fp16 and float32 activations, clamped SwiGLU,
    the weight on the input, sentinel ids): within the bound of the float32 reference on the dequantised
    weights, every element written."""
    label, E, k, D, F, T, routing, fb, sd, compute, over = case
    block, x, ids, weights, w = fp8_problem(E, k, D, F, T, routing, fb, sd, compute, over)
    poisoned.clear()
    fp8_check(block, x, ids, weights, w, FP8_SCHEDULES[name], f"{label}/{name}")
    P = T * k
    assert sum(poisoned) <= 4 * (P * F + T * D + 4 * P) + 4 * 64 * max(16, E), f"{label}/{name}: workspace"


def counters_of(fn) -> torch.Tensor:
    """The counters of a built fused_gemv function (its closure's workspace) on DEV."""
    assert len(fn.counters) == 1, "one counter workspace per device"
    return next(iter(fn.counters.values()))


@pytest.mark.parametrize("T", [1, 3, 40])  # 40 · 2 pairs: past the ids' own grouping, routing.py's
def test_counters_are_back_at_zero_after_each_call(T):
    """Ticket, done and finished counters reset by the last down item, so the next call (or graph replay)
    starts from zero: three calls in a row, each right."""
    block, x, ids, weights, w = make_problem(8, 2, 64, 48, T, "uniform", torch.float32, {})
    fn = BACKEND.build(block, sched(block_f=16, block_k=32, block_d=16, down_block_k=16))
    ref = experts_reference(block, x, ids, weights, w)
    for _ in range(3):
        assert within(fn(x, ids, weights, w), ref)
        assert int(counters_of(fn).abs().sum()) == 0


def test_no_tokens():
    block, x, ids, weights, w = make_problem(8, 2, 64, 48, 1, "uniform", torch.float32, {})
    out = BACKEND.build(block, sched())(x[:0], ids[:0], weights[:0], w)
    assert out.shape == (0, 64)


@settings(max_examples=8, deadline=None)
@given(E=st.integers(2, 12), k=st.integers(1, 4), T=st.integers(1, 9), seed=st.integers(0, 2**16),
       bf=st.sampled_from([4, 16, 32]), bd=st.sampled_from([2, 8, 32]))
def test_hypothesis_skewed_routing(E, k, T, seed, bf, bd):
    """Experts of random popularity (a hot expert takes many of a few tokens' rows), odd F and D."""
    k = min(k, E)
    gen = torch.Generator().manual_seed(seed)
    pop = torch.rand(E, generator=gen) ** 3 + 1e-3
    ids = torch.stack([torch.multinomial(pop, k, replacement=False, generator=gen) for _ in range(T)]).to(DEV)
    block, x, _, weights, w = make_problem(E, k, 72, 40, T, "uniform", torch.float32, {}, seed=seed)
    out = BACKEND.build(block, sched(block_f=bf, block_k=32, block_d=bd, down_block_k=16))(x, ids, weights, w)
    assert within(out, experts_reference(block, x, ids, weights, w))


@pytest.mark.parametrize("bad, why", [
    (dict(block_f=24), "power of two"),
    (dict(block_f=64, block_k=1024, num_warps=2), "gate/up accumulator registers"),
    (dict(num_stages=0), "≥ 1"),
])
def test_params_refused_with_reason(bad, why):
    with pytest.raises(UnsupportedSchedule, match=why):
        FusedGemvParams(**bad)


def test_space_refuses_what_the_block_cannot_hold():
    """Down tiles over the registers at a large k; FP8 tiles that straddle a scale block; a partial scale block."""
    wide = MoEBlock(E=64, k=16, D=512, F=256)
    with pytest.raises(UnsupportedSchedule, match="down accumulator registers"):
        BACKEND.space(wide, "fused_gemv").admit(FusedGemvParams(block_d=32, down_block_k=256, num_warps=4))
    fp8 = preset("qwen3-30b-a3b-fp8")
    with pytest.raises(UnsupportedSchedule, match="must divide the block columns"):
        BACKEND.space(fp8, "fused_gemv").admit(FusedGemvParams(down_block_k=256))
    assert "not a multiple of the 128x128" in KIND.refusal(preset("qwen3-30b-a3b-fp8").replace(F=200))


def test_the_policy_offers_it_in_the_few_rows_regime_only():
    """The rule proposes fused_gemv while T·k ≤ Policy.fused_max_pairs at a bucket's largest T, on a GPU target
    only; the plan of a preset on the Triton backend offers it at T = 1 beside the streaming GEMV (the default:
    the search picks the one launch where it times faster) and never past that many pairs."""
    from moetune.passes.policy import POLICY
    from moetune.runtime.default import default_plan

    block = preset("qwen3-30b-a3b")
    plan = default_plan(block, BACKEND, "h200")
    one = plan.bucket_for(1)
    assert one.schedule.kind == "stream_gemv" and "fused_gemv" in [c.kind for c in one.candidates]
    for b in plan.buckets:
        offered = [c.kind for c in b.candidates]
        assert ("fused_gemv" in offered) == (b.hi * block.k <= POLICY.fused_max_pairs), (b.label, offered)
    cpu = default_plan(block, get("torch"), "cpu").bucket_for(1)
    assert "fused_gemv" in {r.kind for r in cpu.refusals} and "cpu target" in str(cpu.refusals)


@GPU
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3.5-397b-a17b", "deepseek-v3", "mixtral-8x7b",
                                  "gpt-oss-120b", "qwen3-30b-a3b-fp8", "qwen3.5-397b-a17b-fp8", "deepseek-v3-fp8"])
@pytest.mark.parametrize("T", [1, 2, 4, 8])
def test_presets_on_gpu_eager_back_to_back_and_in_graphs(name, T):
    """Each preset's shape at its default and with pdl: two calls back to back (the second's programs may start
    while the first's end), then 3 replays of a CUDA graph of 2 calls, each within the bound."""
    base = preset(name)
    if T * base.k > 64:
        pytest.skip("past the few-rows regime")
    w = expert_tensors(base, DEV, 0)
    gen = torch.Generator().manual_seed(T)
    dt = torch.bfloat16
    for params in (BACKEND.default(base, "fused_gemv", T).params, FusedGemvParams(pdl=True, block_f=16,
                                                                                  block_d=2, block_k=256,
                                                                                  prefetch=True)):
        try:
            fn = BACKEND.build(base, Schedule("fused_gemv", backend="triton", params=params))
        except UnsupportedSchedule as e:
            pytest.fail(f"{name}: {e}")
        xs = [torch.randn(T, base.D, generator=gen).to(dt).to(DEV) for _ in range(2)]
        ids = [torch.stack([torch.randperm(base.E, generator=gen)[:base.k] for _ in range(T)]).to(DEV)
               for _ in range(2)]
        wts = [torch.softmax(torch.randn(T, base.k, generator=gen), -1).to(dt).to(DEV) for _ in range(2)]
        refs = [experts_reference(base, xs[i], ids[i], wts[i], w) for i in range(2)]
        outs = [fn(xs[i], ids[i], wts[i], w) for i in range(2)]
        torch.cuda.synchronize()
        for o, r in zip(outs, refs, strict=True):
            assert within(o, r), f"{name} T={T} {params}"
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [fn(xs[i], ids[i], wts[i], w) for i in range(2)]
        for _ in range(3):
            for o in outs:
                o.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            for o, r in zip(outs, refs, strict=True):
                assert within(o, r), f"{name} T={T} {params} (graph)"
        assert int(counters_of(fn).abs().sum()) == 0
