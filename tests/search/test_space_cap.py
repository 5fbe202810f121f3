"""`--space-cap`: a deterministic sub-grid of each bucket's space around the default heuristic, the same
for TPE and for the exhaustive grid that checks it."""

from __future__ import annotations

import dataclasses

import pytest
import toy_backend as tb

from moetune.codegen.backend import get
from moetune.ir import ConfigError, Schedule, UnsupportedSchedule
from moetune.ir.presets import preset
from moetune.passes.pipeline import schedule_block
from moetune.passes.policy import representative_tokens
from moetune.search import TuneOptions, bucket_inputs, tune_bucket
from moetune.search.objective import expert_tensors
from moetune.search.seeds import default_schedules, launch_twins, runtime_default
from moetune.search.space import build_space, cap_space, key
from moetune.search.timing import FakeTimer

QWEN = preset("qwen3-30b-a3b")
QWEN_BUCKETS = {b.lo: b for b in schedule_block(QWEN, "h200", tokens=(1, 1024)).buckets}

CAP_CASES = [
    # (bucket lo of qwen3-30b-a3b on h200, cap)
    (1, 1), (1, 8), (1, 24), (10, 24), (10, 64), (115, 24), (115, 200),
]


@pytest.mark.parametrize("lo,cap", CAP_CASES)
def test_the_sub_grid_holds_the_default_and_stays_within_the_cap(lo, cap):
    be = get("triton")
    bucket = QWEN_BUCKETS[lo]
    full = build_space(QWEN, be, bucket)
    default = runtime_default(QWEN, be, "h200", bucket)
    anchors = default_schedules(QWEN, be, full, representative_tokens(bucket.lo, bucket.hi), first=default)
    capped = cap_space(full, cap, anchors)
    assert capped == cap_space(full, cap, anchors)  # deterministic
    assert capped.size() <= max(cap, len(full.kinds)) and capped.full_size == full.size() > capped.size()
    assert f"a sub-grid of {full.size()}" in capped.describe()
    assert capped.contains(default)  # the study starts from the untuned choice, inside the sub-grid
    for ks, kf in zip(capped.kinds, full.kinds, strict=True):
        assert ks.kind == kf.kind and ks.params.params_type is kf.params.params_type
        for (name, sub), (fname, vals) in zip(ks.choices(), kf.choices(), strict=True):
            assert name == fname and sub
            i = vals.index(sub[0])
            assert vals[i:i + len(sub)] == sub  # a window of neighbours, in the backend's order
    points = [p for p in capped.grid() if isinstance(p, Schedule)]
    assert all(full.contains(p) for p in points)
    if cap >= 24:  # room to widen: the first listed field of every kind varies
        assert all(len(ks.choices()[0][1]) > 1 for ks in capped.kinds)


def test_a_cap_above_the_size_keeps_the_space():
    space = build_space(tb.BLOCK, tb.toy("toy-cap-all"), tb.bucket())
    assert cap_space(space, space.size()) is space


@pytest.mark.parametrize("cap", [0, -3])
def test_a_cap_below_one_point_is_refused_naming_it(cap):
    space = build_space(tb.BLOCK, tb.toy("toy-cap-zero"), tb.bucket())
    with pytest.raises(UnsupportedSchedule, match=f"space cap {cap}"):
        cap_space(space, cap)
    with pytest.raises(ConfigError, match=f"space_cap = {cap}"):
        TuneOptions(space_cap=cap)


def test_tpe_and_the_grid_search_the_same_sub_grid():
    be = tb.toy("toy-cap-tune")
    b = tb.bucket(floor_s=1e-9)  # no floor stop
    w = expert_tensors(tb.BLOCK)
    inputs = bucket_inputs(tb.BLOCK, b, w, routings=2)

    def run(**kw):
        return tune_bucket(tb.BLOCK, be, "toy-target", b, inputs, FakeTimer(tb.cost),
                           TuneOptions(budget_s=60, space_cap=12, **kw))

    grid, tpe = run(exhaustive=True), run()
    full = build_space(tb.BLOCK, be, b)
    capped = cap_space(full, 12, default_schedules(tb.BLOCK, be, full, inputs.tokens))
    accepted = [p for p in capped.grid() if isinstance(p, Schedule)]
    assert grid.space == tpe.space == capped.describe()
    assert grid.stopped == f"space exhausted ({len(accepted)} points)" and grid.evaluated >= len(accepted)
    assert grid.winner == tpe.winner and capped.contains(grid.winner)
    best = min(accepted, key=tb.cost)
    assert key(grid.winner) == key(best)  # the sub-grid's best, not the full space's (64, 1) points
    assert tb.cost(best) > tb.cost(min((p for p in full.grid() if isinstance(p, Schedule)), key=tb.cost))


def test_an_fp8_study_starts_from_each_default_and_its_w8a8_twin():
    """The study of an FP8 block starts from each default and its twin with the other activation quantisation
    the kind's space offers (the grouped GEMM's default is w8a8: its weight-only twin), so both sides are timed
    in every bucket; each of them also launched the other way (its launch twin, pdl flipped)."""
    be = get("triton")
    block = preset("qwen3.5-397b-a17b-fp8")
    seen = 0
    for bucket in schedule_block(block, "h200", tokens=(1, 1024)).buckets:
        full = build_space(block, be, bucket)
        starts = default_schedules(block, be, full, representative_tokens(bucket.lo, bucket.hi))
        gemm = [s for s in starts if s.kind == "grouped_gemm" and not s.params.pdl]
        if not any(ks.kind == "grouped_gemm" for ks in full.kinds):
            continue
        seen += 1
        assert [s.params.act_quant for s in gemm] == ["fp8_1x128", "none"], bucket
        assert gemm[1].params == dataclasses.replace(gemm[0].params, act_quant="none")
        for s in gemm:
            assert launch_twins(s)[0] in starts, (bucket, s.describe())
        assert all(full.contains(s) for s in starts)
    assert seen >= 4
