"""Bucketing pass: Before (a MoEBlock) / Expected (buckets) on regimes computed here by hand."""

from math import comb

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pass_shapes import GPU_SHAPES, gpu_block

from moetune.ir import MoEBlock, ScheduledBlock, verify_scheduled
from moetune.ir.trace import synthetic_trace
from moetune.passes.bucketing import bucketing, grid
from moetune.passes.pipeline import context
from moetune.passes.policy import representative_tokens as representative


def sf(T, p, r):
    """P(Bin(T, p) ≥ r), by direct summation."""
    return 1.0 - sum(comb(T, j) * p**j * (1 - p) ** (T - j) for j in range(min(r, T + 1)))


def regime_by_hand(E, k, T):
    p = k / E
    active = sf(T, p, 1)
    if sf(T, p, 2) / active <= 0.25:
        return "one_row"
    if sf(T, p, 16) / active >= 0.75:
        return "many_rows"
    return "mixed"


CASES = [  # (E, k, T_max)
    (8, 2, 300),
    (16, 4, 200),
    (128, 8, 600),
    (64, 6, 64),
]


@pytest.mark.parametrize("E,k,T_max", CASES)
def test_buckets_follow_the_regimes(E, k, T_max):
    before = MoEBlock(E, k, 64, 32, T_max=T_max, name="b")
    after = bucketing(before, context(before, "h200"))
    assert isinstance(after, ScheduledBlock) and after.block is before
    verify_scheduled(after)
    by_hand = [regime_by_hand(E, k, T) for T in range(1, T_max + 1)]
    changes = [T for T in range(2, T_max + 1) if by_hand[T - 1] != by_hand[T - 2]]
    starts = [b.lo for b in after.buckets]
    for T in changes:  # every regime change is a bucket boundary ...
        assert T in starts, (T, starts)
    for b in after.buckets:  # ... and no bucket holds two regimes
        assert len({by_hand[T - 1] for T in range(b.lo, b.hi + 1)}) == 1, b.label
        assert b.stats is not None and b.stats.tokens == representative(b.lo, b.hi) and b.stats.tokens in b


@pytest.mark.parametrize("E,k", [(64, 6), (128, 8)])
def test_bucket_statistics_stay_alike(E, k):
    block = MoEBlock(E, k, 64, 32, T_max=64)
    ctx = context(block)
    sb = bucketing(block, ctx)
    r = ctx.routing
    for b in sb.buckets:  # dense grid up to 64: the ratios hold exactly
        assert r.distinct(b.hi) <= 1.5 * r.distinct(b.lo) + 1e-9
        assert r.rows_per_active(b.hi) <= 2.0 * r.rows_per_active(b.lo) + 1e-9
    # and the buckets are as coarse as the ratios allow: the next T would break one of them
    for b, nxt in zip(sb.buckets, sb.buckets[1:], strict=False):
        broke = (r.distinct(nxt.lo) > 1.5 * r.distinct(b.lo)
                 or r.rows_per_active(nxt.lo) > 2 * r.rows_per_active(b.lo)
                 or ctx.regime(nxt.lo) != ctx.regime(b.lo))
        assert broke, (b.label, nxt.label)


@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_gpu_shapes_never_mix_one_row_and_many_rows(name):
    block = gpu_block(name)
    ctx = context(block)
    sb = bucketing(block, ctx)
    verify_scheduled(sb)
    assert sb.buckets[0].label == "[1,1]"  # decode at concurrency 1 is a bucket of its own
    for b in sb.buckets:
        regs = {ctx.regime(T) for T in {b.lo, b.hi, b.stats.tokens}}
        assert regs != {"one_row", "many_rows"} and len(regs) == 1, (b.label, regs)
    assert 5 <= len(sb.buckets) <= 20


def test_zipf_trace_moves_the_regime_boundaries():
    block = gpu_block("qwen3-30b-a3b")
    uni = context(block)
    skew = context(block, trace=synthetic_trace(128, 8, tokens=20000, zipf=1.0, seed=0))

    def first(ctx, regime):
        return next(b.lo for b in bucketing(block, ctx).buckets if ctx.regime(b.lo) == regime)

    # hot experts collect a second row sooner, and cold ones keep few rows longer
    assert first(skew, "mixed") < first(uni, "mixed")
    assert first(skew, "many_rows") > 1.5 * first(uni, "many_rows")


def test_grid_and_representative():
    g = grid(4096)
    assert g[:64] == list(range(1, 65)) and g[-1] == 4096 and g == sorted(set(g))
    assert all(b / a <= 1.06 for a, b in zip(g[64:], g[65:], strict=False))
    assert grid(5) == [1, 2, 3, 4, 5]
    assert [representative(*r) for r in [(1, 1), (2, 3), (64, 256), (7, 9)]] == [1, 2, 128, 8]


@settings(max_examples=30, deadline=None)
@given(E=st.integers(2, 512), k_frac=st.floats(0, 1), T_max=st.integers(1, 3000),
       zipf=st.sampled_from([None, 0.5, 1.5]), seed=st.integers(0, 3))
def test_bucketing_properties(E, k_frac, T_max, zipf, seed):
    k = 1 + int(k_frac * (min(E, 16) - 1))
    block = MoEBlock(E, k, 64, 32, T_max=T_max)
    trace = None if zipf is None else synthetic_trace(E, k, tokens=2000, zipf=zipf, seed=seed)
    ctx = context(block, trace=trace)
    sb = bucketing(block, ctx)
    verify_scheduled(sb)  # covers [1, T_max] without gap or overlap
    assert sb.buckets[0].lo == 1 and sb.buckets[0].hi == 1 or T_max == 1 or ctx.regime(2) == "one_row"
    for b in sb.buckets:
        assert len({ctx.regime(b.lo), ctx.regime(b.hi), ctx.regime(b.stats.tokens)}) == 1, b.label
