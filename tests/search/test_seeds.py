"""Where a study starts: the defaults with their launch twins, and a bucket's stored winners with theirs."""

from __future__ import annotations

import dataclasses

import pytest
import toy_backend as tb

from moetune.codegen.backend import get
from moetune.ir import Schedule
from moetune.ir.presets import preset
from moetune.passes.pipeline import schedule_block
from moetune.runtime.entry import DispatchEntry
from moetune.runtime.table import DispatchTable
from moetune.runtime.versions import Versions
from moetune.search import TuneOptions, tune_block
from moetune.search.seeds import launch_twins, seeds
from moetune.search.timing import FakeTimer

pytest.importorskip("triton")


def test_a_launch_twin_is_the_same_schedule_with_pdl_flipped():
    """FP8 grouped GEMM and token-mode GEMV schedules have a twin, pdl flipped and nothing else; a GEMV in
    expert mode (which refuses pdl) and a bf16 schedule (no launch knob) have none."""
    be = get("triton")
    block = preset("qwen3-30b-a3b-fp8")
    grouped = be.default(block, "grouped_gemm", 64)
    (twin,) = launch_twins(grouped)
    assert twin.params.pdl != grouped.params.pdl
    assert twin == dataclasses.replace(grouped, params=dataclasses.replace(grouped.params, pdl=twin.params.pdl))
    assert launch_twins(twin) == [grouped]
    gemv = be.default(block, "stream_gemv", 1)
    assert gemv.params.down_mode == "token" and [t.params.pdl for t in launch_twins(gemv)] == [not gemv.params.pdl]
    expert = dataclasses.replace(gemv, params=dataclasses.replace(gemv.params, down_mode="expert", pdl=False))
    assert launch_twins(expert) == []
    assert launch_twins(be.default(preset("qwen3-30b-a3b"), "grouped_gemm", 64)) == []


def test_a_buckets_stored_winner_seeds_its_study_with_its_twin(tmp_path):
    """seeds(): the bucket's own stored winner, then its twin, then the neighbours' winners (no twins)."""
    be = get("triton")
    block = preset("qwen3-30b-a3b-fp8")
    buckets = schedule_block(block, "h200", tokens=(1, 1024)).buckets
    i = next(j for j, b in enumerate(buckets) if b.lo <= 64 <= b.hi)
    own = be.default(block, "grouped_gemm", 64)
    below = dataclasses.replace(own, params=dataclasses.replace(own.params, num_stages=3))
    v = Versions.current("triton", "cpu")
    with DispatchTable(tmp_path / "t.sqlite") as t:
        for b, s in ((buckets[i], own), (buckets[i - 1], below)):
            t.put(DispatchEntry.of(target="h200", block=block, bucket=(b.lo, b.hi), schedule=s, time_us=10.0,
                                   versions=v))
        got = seeds(block, t, "h200", "triton", buckets, buckets[i], [])
    assert got == [own, *launch_twins(own), below]


def test_revalidate_at_tokens_retimes_a_current_bucket_without_a_search(tmp_path):
    """--revalidate with --at-tokens: the bucket holding the count is re-timed though its entry is current,
    from its defaults and stored winners only (no TPE point); the other buckets are not touched."""
    be = tb.toy("toy-block-revalidate-at")
    with DispatchTable(tmp_path / "d.sqlite") as t:
        first = tune_block(tb.BLOCK, "toy-block-revalidate-at", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu"), budget_s=20)
        target = next(r.bucket for r in first if r.bucket[0] <= 5 <= r.bucket[1])
        be.built.clear()
        again = tune_block(tb.BLOCK, "toy-block-revalidate-at", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu", revalidate=True), budget_s=20, at_tokens=[5])
    assert [r.bucket for r in again] == [target]
    assert again[0].stopped.startswith("revalidated")
    assert again[0].evaluated <= 3 + 3 and len({Schedule.describe(s) for s in be.built}) <= 3 + 3
