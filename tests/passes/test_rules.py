"""Specialisation rules and pass: Before (buckets) / Expected (candidate kinds), four real shapes,
and a Zipf-skewed trace moving the boundaries."""

import dataclasses

import pytest
from pass_shapes import GPU_SHAPES, gpu_block

from moetune.ir import Bucket, CandidateSpace, MoEBlock, Refusal, ScheduledBlock, verify_scheduled
from moetune.ir.trace import synthetic_trace
from moetune.passes.bucketing import bucketing
from moetune.passes.pipeline import context, schedule_block
from moetune.passes.policy import Policy
from moetune.passes.rules import RULES, grouped_gemm, hybrid, stream_gemv
from moetune.passes.specialise import specialise
from moetune.targets import get_target


def kinds(b):
    return [c.kind for c in b.candidates]


def test_rule_order():
    assert [n for n, _ in RULES] == ["fused_gemv", "stream_gemv", "hybrid", "grouped_gemm"]


BLOCK = MoEBlock(128, 8, 2048, 768, T_max=4096, name="q30")
# (lo, hi, expected kinds) for uniform routing on h200: rows per active expert 1.0, ~2.3-3.8, 49
# (one-row buckets keep grouped GEMM on a GPU target only: rules/grouped_gemm.py; the one-launch GEMV is a
# GPU's, while T·k ≤ 64: rules/fused_gemv.py)
SPEC_CASES = [
    (1, 1, ["fused_gemv", "stream_gemv", "grouped_gemm"], "h200"),
    (2, 3, ["fused_gemv", "stream_gemv", "grouped_gemm"], "h200"),
    (24, 64, ["stream_gemv", "hybrid", "grouped_gemm"], "h200"),
    (512, 1024, ["grouped_gemm"], "h200"),
    (1, 1, ["stream_gemv"], "cpu"),
    (2, 3, ["stream_gemv"], "tpu-v5e"),
]


@pytest.mark.parametrize("lo,hi,expected,target", SPEC_CASES)
def test_specialise_before_expected(lo, hi, expected, target):
    ctx = context(BLOCK, target)
    rep = (lo * hi) ** 0.5
    rep = min(hi, max(lo, round(rep)))
    buckets = [Bucket(1, lo - 1, ctx.routing.stats(1))] if lo > 1 else []
    buckets.append(Bucket(lo, hi, ctx.routing.stats(rep)))
    buckets += [Bucket(hi + 1, 4096, ctx.routing.stats(hi + 1))] if hi < 4096 else []
    before = ScheduledBlock(BLOCK, tuple(buckets))
    after = specialise(before, ctx)
    verify_scheduled(after)
    b = after.bucket_for(lo)
    assert kinds(b) == expected
    refused = {r.kind for r in b.refusals}
    assert refused == {"fused_gemv", "stream_gemv", "hybrid", "grouped_gemm"} - set(expected)
    assert all(r.reason for r in b.refusals)


def test_refusal_reasons_say_why():
    ctx = context(BLOCK)
    one = Bucket(1, 1, ctx.routing.stats(1))
    big = Bucket(2048, 4096, ctx.routing.stats(2896))
    r = grouped_gemm.rule(BLOCK, one, context(BLOCK, "cpu"))
    assert isinstance(r, Refusal) and "one-row regime" in r.reason and "on cpu" in r.reason
    assert isinstance(grouped_gemm.rule(BLOCK, one, ctx), CandidateSpace)  # a GPU: the tuner decides
    r = stream_gemv.rule(BLOCK, big, ctx)
    assert isinstance(r, Refusal) and "GEMV row limit" in r.reason and "h200" in r.reason
    r = hybrid.rule(BLOCK, one, ctx)
    assert isinstance(r, Refusal) and "T_hi = 1" in r.reason
    r = hybrid.rule(BLOCK, big, ctx)
    assert isinstance(r, Refusal) and "below R rows" in r.reason


def test_hybrid_thresholds_respect_bucket_and_gemv_limit():
    ctx = context(BLOCK)
    limit = get_target("h200").gemv_max_rows("bfloat16")
    assert limit == 13  # 67e12 / 4.8e12 · 2 bytes / 2 flop
    for b in schedule_block(BLOCK).buckets:
        for c in b.candidates:
            if c.kind == "hybrid":
                assert c.row_thresholds and all(2 <= R <= b.hi and R - 1 <= limit for R in c.row_thresholds)
    # a target without a vector rate uses the policy's default limit
    cpu = context(BLOCK, "cpu", policy=Policy(gemv_default_rows=4))
    out = hybrid.rule(BLOCK, Bucket(24, 64, ctx.routing.stats(40)), cpu)
    assert isinstance(out, CandidateSpace) and max(out.row_thresholds) <= 5


@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_gpu_shapes_gemv_then_hybrid_then_gemm(name):
    sb = schedule_block(gpu_block(name))
    verify_scheduled(sb, final=True)
    hyb = []
    for b in sb.buckets:
        rho = b.stats.rows_per_active
        if rho <= 1.1:  # one-row: GEMV, and 16-row GEMM tiles (as fast on a GPU, rules/grouped_gemm.py)
            assert "stream_gemv" in kinds(b) and "grouped_gemm" in kinds(b), (b.label, rho)
        if rho >= 20:
            assert "grouped_gemm" in kinds(b) and "stream_gemv" not in kinds(b), (b.label, rho)
        if "hybrid" in kinds(b):
            hyb.append(b)
            assert 1.5 < rho < 20, (b.label, rho)
    assert hyb, f"{name}: no bucket offers a hybrid schedule"
    assert sb.buckets[0].schedule.kind == "stream_gemv" and sb.buckets[-1].schedule.kind == "grouped_gemm"


def first_lo(sb, pred):
    return next(b.lo for b in sb.buckets if pred(b))


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3.5-397b-a17b"])
def test_zipf_trace_moves_the_candidate_boundaries(name):
    block = gpu_block(name)
    E, k = block.E, block.k
    uni = schedule_block(block)
    skew_trace = synthetic_trace(E, k, tokens=20000, zipf=1.0, seed=1)
    skew = schedule_block(block, trace=skew_trace)
    # hot experts: hybrid pays off at a smaller T, GEMM turns up sooner, streaming stops sooner
    has = lambda kind: lambda b: kind in kinds(b)  # noqa: E731
    assert first_lo(skew, has("hybrid")) < first_lo(uni, has("hybrid"))
    cpu = lambda trace: schedule_block(block, "cpu", trace=trace)  # noqa: E731 - GEMM is refused one-row there
    assert first_lo(cpu(skew_trace), has("grouped_gemm")) < first_lo(cpu(None), has("grouped_gemm"))
    no_gemv = lambda b: "stream_gemv" not in kinds(b)  # noqa: E731
    assert first_lo(skew, no_gemv) < first_lo(uni, no_gemv)
    # and the cold experts keep hybrid useful up to a larger T
    last = lambda sb: max(b.hi for b in sb.buckets if "hybrid" in kinds(b))  # noqa: E731
    assert last(skew) > last(uni)


def test_every_rule_refusing_is_an_error_naming_the_bucket():
    block = MoEBlock(8, 2, 64, 32, T_max=16)
    ctx = context(block, "cpu", policy=Policy(gemv_max_heavy_rows=-1.0, hybrid_thresholds=()))
    sb = bucketing(block, ctx)
    with pytest.raises(Exception, match=r"bucket \[1,1\].*every rule refused"):
        specialise(sb, ctx)


def test_specialise_is_identity_on_its_own_output():
    ctx = context(BLOCK)
    once = specialise(bucketing(BLOCK, ctx), ctx)
    assert specialise(once, ctx) is once
    # and it rewrites stale candidates
    stale = once.replace(buckets=(dataclasses.replace(once.buckets[0], candidates=()),) + once.buckets[1:])
    assert specialise(stale, ctx) == once
