"""Winners judged against noise: the finalists and the default are re-timed together, interleaved, and a
winner is written only when it beats the default by more than the spread of those timings; else the bucket
keeps the default, says why with the numbers, and the default itself is written where no usable entry covers
the bucket."""

from __future__ import annotations

import pytest
import torch
import toy_backend as tb

from moetune.ir import Schedule
from moetune.runtime.table import DispatchTable
from moetune.runtime.versions import Versions
from moetune.search import TuneOptions, bucket_inputs, tune_bucket
from moetune.search.finalists import against_default, spread
from moetune.search.objective import expert_tensors
from moetune.search.seeds import runtime_default
from moetune.search.space import key
from moetune.search.timing import FakeTimer

VERSIONS = Versions("0.1.0", "toyhash", "toy 1", torch.__version__, "toy device", "toy")
DEFAULT_S = 100e-6
NOISE = (1.0, 1.05, 0.95)  # the default's successive timings: median 100 µs, spread 10 µs (10 %)


def test_spread_and_the_verdict_against_the_default():
    assert spread([3.0, 1.0, 2.0]) == 2.0  # the range of the timings
    assert spread([2.0], [0.5]) == 0.5  # one timing: its reps' interquartile range
    assert spread([]) == 0.0
    assert against_default(90.0, 100.0, 9.0) == ""
    assert against_default(98.1, 100.0, 3.1) == ("kept the default: the best finalist 1.9 % faster, "
                                                 "within the spread 3.1 %")
    assert against_default(97.0, 100.0, 3.0) != ""  # beating it by exactly the spread is not enough
    assert against_default(103.0, 100.0, 1.0) == "kept the default: the best finalist 3.0 % slower, spread 1.0 %"


def _tune(tmp_path, name: str, candidate_s: float, before=None):
    """A bucket whose default times 100 µs with ±5 % noise, one other point `candidate_s` steady, every
    other point 1 ms; every point timed (exhaustive), the three best re-timed in two rounds. `before(t, b)`
    fills the table first."""
    be = tb.toy(name)
    b = tb.bucket(floor_s=1e-9)
    default = runtime_default(tb.BLOCK, be, "toy-target", b)
    kind = next(k for k in ("stream_gemv", "grouped_gemm") if k != default.kind)
    other = Schedule(kind, backend=be.name, params=tb.ToyParams(tile=32, stages=2))
    calls: list[str] = []

    def cost(s) -> float:
        k = key(s)
        calls.append(k)
        if k == key(default):
            return DEFAULT_S * NOISE[(calls.count(k) - 1) % len(NOISE)]
        return candidate_s if k == key(other) else 1e-3

    inputs = bucket_inputs(tb.BLOCK, b, expert_tensors(tb.BLOCK), routings=2)
    opts = TuneOptions(budget_s=60, exhaustive=True, retime=3, retime_rounds=2, edge_timing=False)
    with DispatchTable(tmp_path / f"{name}.sqlite") as t:
        if before is not None:
            before(t, b)
        r = tune_bucket(tb.BLOCK, be, "toy-target", b, inputs, FakeTimer(cost), opts, table=t, versions=VERSIONS)
        rows = t.entries()
    return r, rows, default, other, calls


def test_a_noisy_winner_within_the_spread_is_not_written(tmp_path):
    """The noisy winner is not written; the bucket keeps its default, which an empty table gets as the bucket's
    entry (so the table covers it)."""
    r, rows, default, other, calls = _tune(tmp_path, "toy-noise-within", 98e-6)
    (e,) = rows
    assert e.schedule(tb.BLOCK) == default and e.time_us == pytest.approx(DEFAULT_S * 1e6) and r.written
    assert r.winner == default and r.time_s == pytest.approx(DEFAULT_S)
    assert r.spread_s == pytest.approx(0.1 * DEFAULT_S)
    assert r.stopped.endswith("kept the default: the best finalist 2.0 % faster, within the spread 10.0 %; "
                              "the default written as the bucket's entry (no usable entry covered it)")
    assert key(r.finalists[0][0]) == key(default) and key(r.finalists[1][0]) == key(other)
    # the re-timing: two rounds of the same three finalists, the second in reverse, the default among them
    last = calls[-6:]
    assert last[:3] == last[3:][::-1] and key(default) in last[:3] and key(other) in last[:3]
    assert calls.count(key(default)) == 3  # its search timing and the two rounds


def test_a_winner_beyond_the_spread_is_written_with_the_spread(tmp_path):
    r, rows, default, other, _ = _tune(tmp_path, "toy-noise-beyond", 50e-6)
    assert r.written and r.winner == other and "kept the default" not in r.stopped
    assert r.default_time_s == pytest.approx(DEFAULT_S) and r.spread_s == pytest.approx(0.1 * DEFAULT_S)
    (e,) = rows
    assert e.schedule(tb.BLOCK) == other and e.time_us == pytest.approx(50.0)
    assert e.default_time_us == pytest.approx(100.0) and e.spread_us == pytest.approx(10.0)


def test_a_kept_default_fills_only_what_no_usable_entry_covers(tmp_path):
    """The table holds a current entry for T = 1…3 of the bucket [1, 8]: the default the bucket keeps is written
    for 4…8 alone, the entry stays."""
    from moetune.runtime.entry import DispatchEntry

    held = Schedule("grouped_gemm", backend="toy-noise-holes", params=tb.ToyParams(tile=16, stages=3))

    def before(t, b):
        t.put(DispatchEntry.of(target="toy-target", block=tb.BLOCK, bucket=(1, 3), schedule=held, time_us=90.0,
                               versions=VERSIONS))

    r, rows, default, _, _ = _tune(tmp_path, "toy-noise-holes", 98e-6, before)
    assert r.winner == default and r.written
    assert [(e.bucket_lo, e.bucket_hi) for e in rows] == [(1, 3), (4, 8)]
    assert rows[0].schedule(tb.BLOCK) == held and rows[1].schedule(tb.BLOCK) == default
    assert r.stopped.endswith("the default written where no usable entry covered the bucket: [4,8]")


def test_a_kept_default_replaces_the_buckets_entry_it_beat(tmp_path):
    """The table's entry of the bucket itself is a slower schedule; the study times it (a seed) and keeps the
    default: the default replaces that entry, which would else go on serving the bucket."""
    from moetune.runtime.entry import DispatchEntry

    slow = Schedule("grouped_gemm", backend="toy-noise-beaten", params=tb.ToyParams(tile=16, stages=3))

    def before(t, b):
        t.put(DispatchEntry.of(target="toy-target", block=tb.BLOCK, bucket=(b.lo, b.hi), schedule=slow,
                               time_us=90.0, versions=VERSIONS))

    r, rows, default, _, calls = _tune(tmp_path, "toy-noise-beaten", 98e-6, before)
    assert key(slow) in calls and r.winner == default and r.written
    (e,) = rows
    assert e.schedule(tb.BLOCK) == default and e.time_us == pytest.approx(DEFAULT_S * 1e6)
    assert r.stopped.endswith("the default written as the bucket's entry, replacing the stored entry it beat here")
