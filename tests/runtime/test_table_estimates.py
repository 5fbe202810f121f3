"""Estimate rows in the dispatch table: a measured entry always wins over an estimate (on write, lookup and
merge), an estimate never displaces a measured entry, no write lowers coverage, and the lookup names the
estimates it serves."""

from __future__ import annotations

import dataclasses
import warnings

from moetune.codegen.torch import BACKEND as TORCH
from moetune.ir import MoEBlock
from moetune.runtime.entry import DispatchEntry
from moetune.runtime.merge import merge
from moetune.runtime.table import CacheWarning, DispatchTable, load_entries
from moetune.runtime.versions import Versions, judge

BLOCK = MoEBlock(E=16, k=4, D=64, F=40, weight_dtype="float32", routing_weight_dtype="float32", name="t")
HERE = Versions.current("torch", "cpu")


def entry(lo: int, hi: int, time_us: float, *, estimated: bool = False, tuned_at: str | None = None,
          kind: str = "stream_gemv", versions: Versions = HERE) -> DispatchEntry:
    return DispatchEntry.of(target="cpu", block=BLOCK, bucket=(lo, hi), schedule=TORCH.default(BLOCK, kind, hi),
                            time_us=time_us, versions=versions, floor_us=2.0, timer="t", trials=3,
                            estimated=estimated, tuned_at=tuned_at)


def spans(t: DispatchTable) -> dict[tuple[int, int], bool]:
    return {e.bucket: e.estimated for e in t.entries()}


def covered(t: DispatchTable) -> set[int]:
    return {x for e in t.entries() for x in range(e.bucket_lo, e.bucket_hi + 1)}


def test_the_flag_round_trips_and_is_null_for_measured_rows(tmp_path):
    with DispatchTable(tmp_path / "d.sqlite") as t:
        t.put(entry(1, 4, 9.0, estimated=True))
        t.put(entry(5, 8, 9.0))
        assert spans(t) == {(1, 4): True, (5, 8): False}
        raw = dict(t.db.execute("SELECT bucket_lo, estimated FROM dispatch_v2").fetchall())
    assert raw == {1: 1, 5: 0}
    assert entry(1, 4, 9.0, estimated=True).describe().endswith("(estimate)")


def test_a_measured_entry_replaces_an_estimate_even_when_slower_and_an_estimate_never_a_measured_one(tmp_path):
    with DispatchTable(tmp_path / "d.sqlite") as t:
        assert t.put(entry(1, 8, 1.0, estimated=True))
        assert t.put(entry(1, 8, 50.0))  # slower, but measured
        assert spans(t) == {(1, 8): False} and t.entries()[0].time_us == 50.0
        assert not t.put(entry(1, 8, 0.1, estimated=True))  # faster, but an estimate
        assert not t.put(entry(1, 8, 0.1, estimated=True), replace=True)  # not even with replace
        assert spans(t) == {(1, 8): False} and t.entries()[0].time_us == 50.0


def test_an_estimate_replaces_a_slower_estimate_only(tmp_path):
    with DispatchTable(tmp_path / "d.sqlite") as t:
        assert t.put(entry(1, 8, 5.0, estimated=True))
        assert not t.put(entry(1, 8, 6.0, estimated=True))
        assert t.put(entry(1, 8, 4.0, estimated=True))
        assert [e.time_us for e in t.entries()] == [4.0]


def test_a_measured_entry_splits_the_estimates_it_overlaps_and_an_estimate_splits_no_measured_entry(tmp_path):
    with DispatchTable(tmp_path / "d.sqlite") as t:
        t.put(entry(1, 16, 3.0, estimated=True, tuned_at="2026-01-01T00:00:00+00:00"))
        before = covered(t)
        t.put(entry(5, 8, 30.0))  # measured, in the middle of the estimate: the estimate keeps both sides
        assert spans(t) == {(1, 4): True, (5, 8): False, (9, 16): True}
        assert covered(t) >= before
        t.put(entry(1, 12, 0.5, estimated=True))  # an estimate over the measured entry leaves it whole
        got = spans(t)
        assert got[(5, 8)] is False and got[(1, 12)] is True
        assert covered(t) >= before


def test_lookup_prefers_measured_entries_and_names_the_estimates_it_serves(tmp_path):
    path = tmp_path / "d.sqlite"
    with DispatchTable(path) as t:
        t.put(entry(5, 8, 30.0))
        t.put(entry(1, 12, 0.5, estimated=True))  # overlaps the measured (5, 8), which stays whole
        t.put(entry(13, 16, 3.0, estimated=True))
        found = t.lookup(BLOCK, "cpu", "torch")
    assert [(lo, hi) for lo, hi, _ in found.usable] == [(5, 8), (13, 16)]
    assert [e.bucket for e in found.estimated] == [(13, 16)]
    assert [(lo, hi) for lo, hi, _ in found.measured] == [(5, 8)]
    (bad, why), = found.rejected
    assert bad.bucket == (1, 12) and "measured entry [5,8]" in why and "preferred" in why
    assert "estimates, not measured" in found.warning() and "[13,16]" in found.warning()
    est: list = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = load_entries(path, BLOCK, "cpu", "torch", estimated=est)
    assert [(lo, hi) for lo, hi, _ in got] == [(5, 8), (13, 16)] and est == [(13, 16)]
    assert any(issubclass(w.category, CacheWarning) and "estimates" in str(w.message) for w in said)


def test_an_estimate_from_another_device_is_not_foreign(tmp_path):
    there = dataclasses.replace(HERE, device="cpu: elsewhere", capability="other")
    assert judge(entry(1, 4, 3.0, estimated=True, versions=there), HERE) is None
    assert judge(entry(1, 4, 3.0, versions=there), HERE).startswith("foreign:")


def test_merge_keeps_the_measured_entry_of_a_key_whatever_the_times(tmp_path):
    a, b, out = tmp_path / "a.sqlite", tmp_path / "b.sqlite", tmp_path / "out.sqlite"
    with DispatchTable(a) as t:
        t.put(entry(1, 8, 0.1, estimated=True))
        t.put(entry(9, 16, 0.1, estimated=True))
    with DispatchTable(b) as t:
        t.put(entry(1, 8, 40.0))
    merge([a, b], out)
    with DispatchTable(out, create=False) as t:
        assert spans(t) == {(1, 8): False, (9, 16): True}
        assert {e.bucket: e.time_us for e in t.entries()}[(1, 8)] == 40.0
