"""A dispatch table never loses coverage: random sequences of tuner writes (`put(..., supersede=True)`),
plain puts and merges of a second table, on a real SQLite file, checked after every operation against a
model that maps each token count T to the entry that should serve it.

The model: a write that goes in (no stored row of its bucket, or a faster one, or `replace`) becomes the
entry of every T in its bucket; the table's rows are the model's maximal runs of one entry; a merge keeps
the faster row of each bucket and writes them oldest first, as writes that replace what they meet."""

from __future__ import annotations

import dataclasses
import datetime as dt

from hypothesis import given, settings
from hypothesis import strategies as st

from moetune.codegen.torch import BACKEND as TORCH
from moetune.ir import MoEBlock
from moetune.runtime.entry import DispatchEntry
from moetune.runtime.merge import merge
from moetune.runtime.schema import TABLE
from moetune.runtime.table import DispatchTable
from moetune.runtime.versions import Versions

BLOCK = MoEBlock(E=16, k=4, D=64, F=40, weight_dtype="float32", routing_weight_dtype="float32", name="t")
HERE = Versions.current("torch", "cpu")
T_MAX = 20
KINDS = ("stream_gemv", "grouped_gemm", "hybrid")
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

buckets = st.integers(1, T_MAX).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, min(T_MAX, lo + 9))))
writes = st.tuples(buckets, st.sampled_from(KINDS), st.sampled_from((1.0, 2.0, 3.0)))
tunes = st.tuples(st.just("tune"), writes, st.booleans())  # put(..., replace=?, supersede=True)
puts = st.tuples(st.just("put"), writes, st.just(False))  # plain put
merges = st.tuples(st.just("merge"), st.lists(writes, min_size=1, max_size=4), st.just(False))
ops = st.one_of(tunes, puts, tunes, puts, merges)  # a merge (a file written and renamed) one time in five


class Model:
    """T → the entry serving it (None: not covered)."""

    def __init__(self) -> None:
        self.at: dict[int, DispatchEntry | None] = dict.fromkeys(range(1, T_MAX + 1))

    def rows(self) -> list[tuple[int, int, DispatchEntry]]:
        out: list[tuple[int, int, DispatchEntry]] = []
        for T in range(1, T_MAX + 1):
            e = self.at[T]
            if e is None:
                continue
            if out and out[-1][2] is e and out[-1][1] == T - 1:
                out[-1] = (out[-1][0], T, e)
            else:
                out.append((T, T, e))
        return out

    def put(self, e: DispatchEntry, replace: bool = False) -> None:
        stored = next((s for lo, hi, s in self.rows() if (lo, hi) == e.bucket), None)
        if stored is None or replace or e.time_us < stored.time_us:
            for T in range(e.bucket_lo, e.bucket_hi + 1):
                self.at[T] = e

    def merge(self, other: Model) -> None:
        best: dict[tuple[int, int], DispatchEntry] = {}
        for lo, hi, e in self.rows() + other.rows():
            part = dataclasses.replace(e, bucket_lo=lo, bucket_hi=hi)
            if (lo, hi) not in best or part.time_us < best[(lo, hi)].time_us:
                best[(lo, hi)] = part
        self.at = dict.fromkeys(range(1, T_MAX + 1))
        for e in sorted(best.values(), key=lambda e: (e.tuned_at, e.bucket_lo)):
            self.put(e, replace=True)


def _fields(e: DispatchEntry) -> dict:
    return {k: v for k, v in e.row().items() if k not in ("bucket_lo", "bucket_hi")}


def _open(path) -> DispatchTable:
    t = DispatchTable(path)
    t.db.execute("PRAGMA synchronous = OFF")  # this connection's commits skip fsync: the test is about rows
    return t


def _check(t: DispatchTable, model: Model, covered_before: set[int]) -> set[int]:
    rows = t.entries()
    found = t.lookup(BLOCK, "cpu", "torch", versions=HERE)
    want = model.rows()
    assert [e.bucket for e in rows] == [(lo, hi) for lo, hi, _ in want]
    assert [_fields(e) for e in rows] == [_fields(e) for _, _, e in want]  # the entry each T should map to
    covered = {T for e in rows for T in range(e.bucket_lo, e.bucket_hi + 1)}
    assert covered >= covered_before, f"lost coverage of T = {sorted(covered_before - covered)}"
    assert not found.rejected
    served = {T: s for lo, hi, s in found.usable for T in range(lo, hi + 1)}
    assert served == {T: e.schedule(BLOCK) for lo, hi, e in want for T in range(lo, hi + 1)}
    return covered


@settings(max_examples=50, deadline=None)
@given(st.lists(ops, min_size=25, max_size=25))
def test_coverage_never_shrinks_and_each_T_maps_to_the_last_entry_written_over_it(tmp_path_factory, seq):
    folder = tmp_path_factory.mktemp("cover")
    path, side = folder / "t.sqlite", folder / "other.sqlite"
    clock = iter(range(10**6))

    def entry(w) -> DispatchEntry:
        (lo, hi), kind, time_us = w
        tuned_at = (START + dt.timedelta(seconds=next(clock))).isoformat(timespec="seconds")
        return DispatchEntry.of(target="cpu", block=BLOCK, bucket=(lo, hi), schedule=TORCH.default(BLOCK, kind, hi),
                                time_us=time_us, versions=HERE, floor_us=0.5, trials=3, tuned_at=tuned_at)

    model, covered = Model(), set()
    t, o = _open(path), _open(side)
    try:
        for op, arg, replace in seq:
            if op == "merge":
                other = Model()
                o.db.execute(f"DELETE FROM {TABLE}")
                for w in arg:
                    e = entry(w)
                    o.put(e)
                    other.put(e)
                t.close()
                merge([side], path)  # renamed over `path`: open it again
                t = _open(path)
                model.merge(other)
            else:
                e = entry(arg)
                t.put(e, replace=replace, supersede=op == "tune")
                model.put(e, replace=replace)
            covered = _check(t, model, covered)
    finally:
        t.close()
        o.close()
