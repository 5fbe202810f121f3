"""The dispatch table: typed versioned rows, keep-faster upsert, concurrent writers, stale / foreign /
corrupt files, files of the previous version read and moved, Schedule round trips through the backend's
params class, show and merge."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from moetune.cli import main as cli_main
from moetune.codegen.torch import BACKEND as TORCH
from moetune.ir import CacheError, MoEBlock, Schedule
from moetune.runtime.entry import DispatchEntry
from moetune.runtime.merge import merge
from moetune.runtime.schema import ADDED, COLUMNS, PK, TABLE, V1
from moetune.runtime.table import CacheWarning, DispatchTable, load_entries, table_path
from moetune.runtime.versions import Versions

BLOCK = MoEBlock(E=16, k=4, D=64, F=40, weight_dtype="float32", routing_weight_dtype="float32", name="t")
HERE = Versions.current("torch", "cpu")


def sched(kind: str = "stream_gemv", T: int = 4) -> Schedule:
    return TORCH.default(BLOCK, kind, T)


def entry(lo: int, hi: int, time_us: float, kind: str = "stream_gemv", versions: Versions = HERE,
          target: str = "cpu", block: MoEBlock = BLOCK) -> DispatchEntry:
    return DispatchEntry.of(target=target, block=block, bucket=(lo, hi), schedule=sched(kind, hi),
                            time_us=time_us, versions=versions, floor_us=2.0, default_time_us=20.0,
                            baseline_time_us=30.0, baseline="transformers:grouped_mm", timer="cpu", trials=7)


def other(**kw) -> Versions:
    import dataclasses

    return dataclasses.replace(HERE, **kw)


# ------------------------------------------------------------------------------------------ schema


def test_versioned_typed_columns_and_wal(tmp_path):
    with DispatchTable(tmp_path / "d.sqlite") as t:
        assert TABLE == "dispatch_v2" and TABLE in t.db.table_names()
        cols = {c.name: c.type for c in t.db[TABLE].columns}
        assert cols == {c: {str: "TEXT", int: "INTEGER", float: "REAL"}[ty] for c, ty in COLUMNS.items()}
        assert tuple(t.db[TABLE].pks) == PK
        assert t.db.journal_mode == "wal"
        assert "fusion" not in cols
        for need in ("signature_text", "kind", "row_threshold", "params", "params_type", "time_us", "floor_us",
                     "pct_of_floor", "default_time_us", "baseline_time_us", "moetune", "kernel_hash",
                     "backend_version", "torch", "device", "capability", "tuned_at"):
            assert need in cols


@pytest.mark.parametrize("kind", ["grouped_gemm", "stream_gemv", "hybrid"])
def test_schedule_round_trip_through_backend_params(tmp_path, kind):
    s = sched(kind, 12)
    if kind == "hybrid":
        s = Schedule("hybrid", row_threshold=5, backend="torch", params=s.params)
    e = DispatchEntry.of(target="cpu", block=BLOCK, bucket=(8, 17), schedule=s, time_us=3.0, versions=HERE)
    with DispatchTable(tmp_path / "d.sqlite") as t:
        assert t.put(e)
        got = t.get("cpu", "torch", BLOCK.signature_hash(), 8, 17)
    assert got == e
    back = got.schedule(BLOCK)
    assert back == s and type(back.params) is type(s.params)
    assert got.signature_text == BLOCK.signature() and got.pct_of_floor is None


def test_params_class_renamed_is_refused_with_reason(tmp_path):
    import dataclasses

    e = dataclasses.replace(entry(1, 1, 5.0), params_type="OldParams")
    with pytest.raises(CacheError, match="OldParams"):
        e.schedule(BLOCK)
    e = dataclasses.replace(entry(1, 1, 5.0), params='{"no_such_field": 3}')
    with pytest.raises(CacheError, match="cannot rebuild"):
        e.schedule(BLOCK)


# ------------------------------------------------------------------------------------------- upsert

UPSERT_CASES = [
    # (stored µs, new µs, stored after)
    (10.0, 5.0, 5.0),  # faster replaces
    (5.0, 10.0, 5.0),  # slower is dropped
    (5.0, 5.0, 5.0),  # a tie keeps the stored one
]


@pytest.mark.parametrize("first,second,kept", UPSERT_CASES)
def test_put_keeps_the_faster(tmp_path, first, second, kept):
    with DispatchTable(tmp_path / "d.sqlite") as t:
        assert t.put(entry(1, 4, first, kind="grouped_gemm"))
        written = t.put(entry(1, 4, second, kind="stream_gemv"))
        got = t.entries()
    assert len(got) == 1 and got[0].time_us == kept
    assert written == (second < first)
    assert got[0].kind == ("stream_gemv" if second < first else "grouped_gemm")
    assert got[0].pct_of_floor == pytest.approx(100 * 2.0 / kept)


def test_put_replaces_an_entry_measured_with_other_kernels_but_merge_does_not(tmp_path):
    old = entry(1, 4, 1.0, versions=other(kernel_hash="0ld"))
    new = entry(1, 4, 9.0)
    with DispatchTable(tmp_path / "d.sqlite") as t:
        t.put(old)
        assert t.put(new)  # a timing of other kernels says nothing about these
        assert t.entries()[0].time_us == 9.0
        slower_old = entry(1, 4, 20.0, versions=other(kernel_hash="0ld"))
        assert not t.put(slower_old, replace_stale=False)  # merge: only the time decides
        assert t.entries()[0].time_us == 9.0
        assert t.put(old, replace_stale=False)
        assert t.entries()[0].time_us == 1.0


def test_keys_are_distinct_per_target_backend_signature_bucket(tmp_path):
    b2 = BLOCK.replace(F=48)
    with DispatchTable(tmp_path / "d.sqlite") as t:
        for e in (entry(1, 4, 1.0), entry(5, 8, 1.0), entry(1, 4, 1.0, target="h200"),
                  entry(1, 4, 1.0, block=b2)):
            assert t.put(e)
        assert len(t.entries()) == 4
        assert len(t.entries("cpu", "torch", BLOCK.signature_hash())) == 2


# ---------------------------------------------------------------------------------- concurrent writes

def _writer(path: str, wid: int, n: int) -> None:
    s = sched("stream_gemv", 1)
    for i in range(n):
        with DispatchTable(path) as t:  # open per write: the way separate tuners meet one file
            # own keys (lo = 1000·(wid + 1) + i) and shared keys (lo = i + 1) where worker 1 is faster
            t.put(DispatchEntry.of(target="cpu", block=BLOCK, bucket=(1000 * (wid + 1) + i,) * 2, schedule=s,
                                   time_us=1.0, versions=HERE))
            t.put(DispatchEntry.of(target="cpu", block=BLOCK, bucket=(i + 1, i + 1), schedule=s,
                                   time_us=10.0 - wid - i * 1e-3, versions=HERE))


def test_two_processes_writing_one_file_lose_nothing(tmp_path):
    import multiprocessing as mp

    path = tmp_path / "d.sqlite"
    n = 80
    ctx = mp.get_context("fork")  # the children need no torch threads; fork spares them the import
    procs = [ctx.Process(target=_writer, args=(str(path), w, n)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with DispatchTable(path, create=False) as t:
        rows = t.entries()
    own = [e for e in rows if e.bucket_lo >= 1000]
    shared = {e.bucket_lo: e.time_us for e in rows if e.bucket_lo <= n}
    assert len(own) == 2 * n
    assert sorted(shared) == list(range(1, n + 1))
    assert all(shared[i + 1] == pytest.approx(9.0 - i * 1e-3) for i in range(n))  # worker 1's (faster) rows


def _killed_writer(path: str, n: int) -> None:
    """Write n entries and die without closing the table (a tuner killed by its time limit)."""
    import os
    import signal

    t = DispatchTable(path)
    for i in range(n):
        t.put(entry(i + 1, i + 1, 5.0))
    os.kill(os.getpid(), signal.SIGKILL)


def test_entries_are_in_the_file_itself_when_the_writer_is_killed(tmp_path):
    """A tuner killed mid-run leaves its rows in the .sqlite file, not only in its -wal side file: a
    copy of the file alone (what a deployment ships, what a GPU run sends back) holds every entry."""
    import multiprocessing as mp
    import shutil

    path = tmp_path / "d.sqlite"
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_killed_writer, args=(str(path), 3))
    p.start()
    p.join(60)
    assert p.exitcode == -9
    copy = tmp_path / "shipped" / "d.sqlite"
    copy.parent.mkdir()
    shutil.copy(path, copy)  # the main file only: no -wal, no -shm
    with DispatchTable(copy, create=False) as t:
        assert [e.bucket for e in t.entries()] == [(1, 1), (2, 2), (3, 3)]


# ----------------------------------------------------------------------------- stale, foreign, corrupt

def test_load_entries_leaves_stale_and_foreign_out_with_one_warning(tmp_path):
    path = tmp_path / "d.sqlite"
    with DispatchTable(path) as t:
        t.put(entry(1, 1, 1.0))
        t.put(entry(2, 2, 1.0, versions=other(device="NVIDIA H200", capability="sm_90")))
        t.put(entry(3, 7, 1.0, versions=other(kernel_hash="0ld")))
        t.put(entry(8, 16, 1.0, versions=other(backend_version="torch 1.0")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = load_entries(path, BLOCK, "cpu", "torch")
    assert [(lo, hi) for lo, hi, _ in got] == [(1, 1), (8, 16)]  # another torch, the same kernel sources: used
    assert got[0][2] == sched("stream_gemv", 1)
    msgs = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert len(msgs) == 1, msgs
    assert str(path) in msgs[0] and "2 entries not used: [2,2] foreign" in msgs[0] and "[3,7] stale" in msgs[0]
    assert "1 entry used, to be re-timed: [8,16] retime: same kernel sources, timed with other libraries (torch 1.0" \
        in msgs[0]


def test_load_entries_of_another_block_or_target_is_empty_without_warning(tmp_path):
    path = tmp_path / "d.sqlite"
    with DispatchTable(path) as t:
        t.put(entry(1, 1, 1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_entries(path, BLOCK.replace(F=48), "cpu", "torch") == []
        assert load_entries(path, BLOCK, "h200", "torch") == []


def test_missing_file_gives_no_entries_and_one_warning(tmp_path):
    with pytest.warns(CacheWarning, match="no such file"):
        assert load_entries(tmp_path / "none.sqlite", BLOCK, "cpu", "torch") == []
    with pytest.raises(CacheError, match="none.sqlite"):
        DispatchTable(tmp_path / "none.sqlite", create=False)


def test_a_folder_of_tables_is_read_at_the_target_s_file(tmp_path):
    with DispatchTable(tmp_path / "cpu.sqlite") as t:
        t.put(entry(1, 4, 1.0))
    with DispatchTable(tmp_path / "h100.sqlite") as t:
        t.put(entry(5, 8, 1.0))  # a cpu row in another target's file: never read for the cpu
    assert table_path(tmp_path, "cpu") == tmp_path / "cpu.sqlite"
    assert table_path(tmp_path / "h100.sqlite", "cpu") == tmp_path / "h100.sqlite"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [(lo, hi) for lo, hi, _ in load_entries(tmp_path, BLOCK, "cpu", "torch")] == [(1, 4)]
    with pytest.warns(CacheWarning, match=r"a100.sqlite: no such file \(the folder holds cpu.sqlite, h100.sqlite\)"):
        assert load_entries(tmp_path, BLOCK, "a100", "torch") == []


def _garbage(p: Path) -> None:
    p.write_bytes(b"this is not a dispatch table\n" * 200)


def _truncated(p: Path) -> None:
    with DispatchTable(p) as t:
        for i in range(200):
            t.put(entry(i + 1, i + 1, 1.0))
        t.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = p.read_bytes()
    for side in ("-wal", "-shm"):
        Path(str(p) + side).unlink(missing_ok=True)
    p.write_bytes(data[: len(data) // 3])


def _header_smashed(p: Path) -> None:
    with DispatchTable(p) as t:
        t.put(entry(1, 1, 1.0))
        t.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(p.read_bytes())
    data[16:24] = b"\xff" * 8  # page size and format bytes
    p.write_bytes(bytes(data))


def _other_columns(p: Path) -> None:
    conn = sqlite3.connect(p)
    conn.execute(f"CREATE TABLE {TABLE} (target TEXT, time_us TEXT)")
    conn.commit()
    conn.close()


def _folder(p: Path) -> None:
    p.mkdir()


CORRUPT_CASES = [_garbage, _truncated, _header_smashed, _other_columns, _folder]


@pytest.mark.parametrize("spoil", CORRUPT_CASES, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_file_raises_cache_error_naming_it(tmp_path, spoil):
    path = tmp_path / "spoilt.sqlite"
    spoil(path)
    if spoil is not _folder:  # a folder is read as a folder of tables (test_a_folder_of_tables_...)
        with pytest.raises(CacheError, match="spoilt.sqlite"):
            load_entries(path, BLOCK, "cpu", "torch")
    with pytest.raises(CacheError, match="spoilt.sqlite"):
        DispatchTable(path)


def test_table_of_another_version_is_not_read(tmp_path):
    path = tmp_path / "d.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE dispatch_v0 (target TEXT)")
    conn.commit()
    conn.close()
    with pytest.warns(CacheWarning, match="dispatch_v0"):
        assert load_entries(path, BLOCK, "cpu", "torch") == []


# ------------------------------------------------------------------------------- files of version 1

V1_SCHEMA = """CREATE TABLE "dispatch_v1" (
   "target" TEXT NOT NULL, "backend" TEXT NOT NULL, "signature" TEXT NOT NULL, "bucket_lo" INTEGER NOT NULL,
   "bucket_hi" INTEGER NOT NULL, "signature_text" TEXT NOT NULL, "kind" TEXT NOT NULL, "row_threshold" INTEGER,
   "params_type" TEXT, "params" TEXT, "fusion" TEXT NOT NULL, "time_us" REAL NOT NULL, "floor_us" REAL,
   "pct_of_floor" REAL, "default_time_us" REAL, "baseline_time_us" REAL, "baseline" TEXT, "timer" TEXT,
   "trials" INTEGER, "moetune" TEXT, "kernel_hash" TEXT NOT NULL, "backend_version" TEXT NOT NULL,
   "torch" TEXT, "device" TEXT NOT NULL, "capability" TEXT NOT NULL, "tuned_at" TEXT NOT NULL,
   PRIMARY KEY ("target", "backend", "signature", "bucket_lo", "bucket_hi")
)"""
FUSION_V1 = '{"combine_in_down": true, "gate_up": true, "route_in_gate_up": true, "weight_in_down": false}'
V1_ENTRIES = [entry(1, 1, 4.0), entry(2, 7, 6.0, kind="grouped_gemm"), entry(8, 16, 9.0, kind="hybrid")]


def _v1_file(path: Path, entries=V1_ENTRIES) -> Path:
    """A table file as the previous version wrote it: dispatch_v1, its rows with a fusion column."""
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(V1_SCHEMA)
        for e in entries:
            row = {c: v for c, v in e.row().items() if c not in ADDED} | {"fusion": FUSION_V1}
            conn.execute(f"INSERT INTO dispatch_v1 ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                         list(row.values()))
    conn.close()
    return path


def _tables(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    names = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()
    return names


def test_a_v1_file_is_read_as_it_is(tmp_path):
    """A deployment's table of the previous version keeps serving: its rows read (fusion ignored), the file
    left unchanged by a reader."""
    path = _v1_file(tmp_path / "old.sqlite")
    with DispatchTable(path, create=False) as t:
        assert t.source == V1 and t.foreign_version is None
        assert t.entries() == V1_ENTRIES
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = load_entries(path, BLOCK, "cpu", "torch")
    assert [(lo, hi, s) for lo, hi, s in got] == [(e.bucket_lo, e.bucket_hi, e.schedule(BLOCK)) for e in V1_ENTRIES]
    assert _tables(path) == {V1}


@pytest.mark.parametrize("how", ["create", "put"])
def test_a_v1_file_moves_to_v2_when_opened_for_writing(tmp_path, how):
    """Opened for writing (or written through a read-only handle), a v1 file's rows move to dispatch_v2, every
    column but fusion the same (spread_us, which v1 did not have, NULL), and the v1 table goes."""
    path = _v1_file(tmp_path / "old.sqlite")
    conn = sqlite3.connect(path)
    v1_cols = ", ".join(c for c in COLUMNS if c not in ADDED)
    before = conn.execute(f"SELECT {v1_cols} FROM dispatch_v1 ORDER BY bucket_lo").fetchall()
    conn.close()
    with DispatchTable(path, create=how == "create") as t:
        if how == "put":
            assert t.source == V1
            assert t.put(entry(17, 32, 3.0))
        assert t.source == TABLE
    assert _tables(path) == {TABLE}
    conn = sqlite3.connect(path)
    after = conn.execute(f"SELECT {v1_cols} FROM {TABLE} ORDER BY bucket_lo").fetchall()
    spreads = conn.execute(f"SELECT spread_us FROM {TABLE} ORDER BY bucket_lo").fetchall()
    conn.close()
    assert after[:3] == before and len(after) == 3 + (how == "put")
    assert spreads[:3] == [(None,)] * 3
    with DispatchTable(path, create=False) as t:
        assert t.entries()[:3] == V1_ENTRIES


def test_moving_a_v1_file_keeps_the_v2_rows_and_is_one_transaction(tmp_path):
    """A file holding both tables (a v1 writer came after the move): the v2 row of a key stays, the other v1
    rows join it. A v1 table with other columns is refused naming the file, and the file is left as it was."""
    path = tmp_path / "both.sqlite"
    with DispatchTable(path) as t:
        t.put(entry(1, 1, 8.0, kind="grouped_gemm"))
    _v1_file(path)
    with DispatchTable(path) as t:
        got = {e.bucket: (e.kind, e.time_us) for e in t.entries()}
    assert got == {(1, 1): ("grouped_gemm", 8.0), (2, 7): ("grouped_gemm", 6.0), (8, 16): ("hybrid", 9.0)}
    assert _tables(path) == {TABLE}

    bad = tmp_path / "bad.sqlite"
    _v1_file(bad)
    conn = sqlite3.connect(bad)
    with conn:
        conn.execute("ALTER TABLE dispatch_v1 ADD COLUMN extra TEXT")
    conn.close()
    with pytest.raises(CacheError, match=r"bad.sqlite.*dispatch_v1 has other columns"):
        DispatchTable(bad)
    assert _tables(bad) == {V1}

    half = tmp_path / "half.sqlite"  # the move fails at its last row: nothing of it stays
    with DispatchTable(half) as t:
        t.put(entry(1, 1, 8.0, kind="grouped_gemm"))
    _v1_file(half)
    conn = sqlite3.connect(half)
    with conn:
        conn.execute(f"CREATE TRIGGER fail BEFORE INSERT ON {TABLE} WHEN NEW.bucket_lo = 8 "
                     "BEGIN SELECT RAISE(ABORT, 'refused'); END")
    conn.close()
    with pytest.raises(CacheError, match=r"half.sqlite.*refused"):
        DispatchTable(half)
    conn = sqlite3.connect(half)
    counts = {n: conn.execute(f"SELECT count(*) FROM {n}").fetchone()[0] for n in (TABLE, V1)}
    conn.close()
    assert counts == {TABLE: 1, V1: 3}


# ------------------------------------------------------------------------------------ show and merge


def test_merge_keeps_the_faster_of_each_key(tmp_path, capsys):
    a, b, c = (tmp_path / f"{n}.sqlite" for n in "abc")
    with DispatchTable(a) as t:
        t.put(entry(1, 1, 5.0, kind="grouped_gemm"))
        t.put(entry(2, 2, 1.0))
    with DispatchTable(b) as t:
        t.put(entry(1, 1, 3.0))
        t.put(entry(2, 2, 4.0, kind="grouped_gemm"))
        t.put(entry(3, 7, 2.0))
    assert cli_main(["merge", str(a), str(b), "-o", str(c)]) == 0
    with DispatchTable(c, create=False) as t:
        got = {e.bucket: (e.time_us, e.kind) for e in t.entries()}
    assert got == {(1, 1): (3.0, "stream_gemv"), (2, 2): (1.0, "stream_gemv"), (3, 7): (2.0, "stream_gemv")}
    # nothing faster in a: a's [1,1] loses to the faster one c holds, its [2,2] is c's own row
    assert merge([a], c) == (2, 3, 3, 0, 1)


def test_merge_keeps_a_current_entry_over_a_faster_stale_one_and_splits_the_stale_around_it(tmp_path):
    """A row timed on other kernel sources serves nothing here: it loses its key to a current entry however
    fast it was, and a current entry over part of a stale row splits it; every T stays covered, by a current
    entry wherever one covers it, and the lookup serves every T."""
    import dataclasses

    old, new = (tmp_path / f"{n}.sqlite" for n in ("old", "new"))
    gone = other(kernel_hash="0ld")
    with DispatchTable(old) as t:
        for lo, hi in ((1, 4), (5, 8), (9, 40)):
            t.put(dataclasses.replace(entry(lo, hi, 1.0, versions=gone), tuned_at=OLD))
    with DispatchTable(new) as t:
        t.put(dataclasses.replace(entry(1, 4, 9.0), tuned_at=NEW))
        t.put(dataclasses.replace(entry(5, 20, 9.0), tuned_at=NEW))
    merge([new], old)
    with DispatchTable(old, create=False) as t:
        got = {e.bucket: (e.time_us, e.versions.kernel_hash == HERE.kernel_hash) for e in t.entries()}
    assert got == {(1, 4): (9.0, True), (5, 20): (9.0, True), (21, 40): (1.0, False)}
    with pytest.warns(CacheWarning, match=r"\[21,40\] stale"):  # named to re-tune, not served
        served = [(lo, hi) for lo, hi, _ in load_entries(old, BLOCK, "cpu", "torch")]
    assert served == [(1, 4), (5, 20)]


def test_show_lists_every_entry_with_floor_default_baseline_and_device(tmp_path, capsys):
    path = tmp_path / "d.sqlite"
    with DispatchTable(path) as t:
        t.put(entry(1, 1, 4.0))
        t.put(entry(2, 2, 8.0, kind="grouped_gemm"))
    assert cli_main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and HERE.device in out and BLOCK.signature() in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("[1,1]"))
    assert "stream_gemv" in line and "4.0" in line and "50.0%" in line and "5.00×" in line and "7.50×" in line
    assert cli_main(["show", str(tmp_path / "none.sqlite")]) == 2  # CacheError → exit 2, no traceback


def test_runtime_table_imports_neither_search_nor_optuna():
    code = ("import sys, moetune.runtime.table as t; "
            "bad = [m for m in sys.modules if m.startswith(('optuna', 'moetune.search'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def _raw_rows(path: Path, entries) -> None:
    """Rows as a writer that did not split them left them (they may overlap)."""
    with DispatchTable(path):
        pass
    conn = sqlite3.connect(path)
    with conn:
        for e in entries:
            row = e.row()
            conn.execute(f"INSERT INTO {TABLE} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                         list(row.values()))
    conn.close()


OLD, NEW = "2026-01-01T00:00:00+00:00", "2026-02-01T00:00:00+00:00"


def test_overlapping_rows_of_two_tuning_runs_keep_the_newer_in_lookup_and_in_prune(tmp_path):
    """Rows that overlap (left by a writer that did not split them): the lookup keeps the newer and says
    which it left out; prune_overlapped splits the older around the newer, so the lookup then serves all."""
    import dataclasses

    path = tmp_path / "d.sqlite"
    old = [dataclasses.replace(entry(lo, hi, 1.0), tuned_at=OLD) for lo, hi in ((1, 1), (2, 2), (3, 7), (8, 20))]
    new = [dataclasses.replace(entry(lo, hi, 2.0), tuned_at=NEW) for lo, hi in ((3, 7), (8, 17))]
    _raw_rows(path, old[:3] + [old[3]])
    with DispatchTable(path) as t:
        t.db.execute(f"DELETE FROM {TABLE} WHERE bucket_lo = 3")
        t.db.conn.commit()
    _raw_rows(path, new)
    with pytest.warns(CacheWarning, match=r"\[8,20\] overlaps \[8,17\]"):
        got = load_entries(path, BLOCK, "cpu", "torch")
    assert [(lo, hi) for lo, hi, _ in got] == [(1, 1), (2, 2), (3, 7), (8, 17)]
    with DispatchTable(path) as t:
        assert t.prune_overlapped() == 1
        assert {e.bucket: e.tuned_at for e in t.entries()} == {(1, 1): OLD, (2, 2): OLD, (3, 7): NEW, (8, 17): NEW,
                                                              (18, 20): OLD}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = load_entries(path, BLOCK, "cpu", "torch")
    assert [(lo, hi) for lo, hi, _ in got] == [(1, 1), (2, 2), (3, 7), (8, 17), (18, 20)]


def test_a_written_entry_splits_the_rows_it_overlaps_around_itself(tmp_path):
    """A written entry trims what it overlaps: the part outside it stays, every field but the bucket the
    same; a row wholly inside it goes; a row it does not touch stays; an entry not written (slower) changes
    nothing. A plain put splits rows of the same versions only, supersede (a tuner's write) all rows."""
    with DispatchTable(tmp_path / "d.sqlite") as t:
        for lo, hi in ((1, 1), (2, 7), (8, 17), (18, 40)):
            t.put(entry(lo, hi, 5.0))
        before = t.get("cpu", "torch", BLOCK.signature_hash(), 2, 7)
        assert t.put(entry(2, 3, 4.0))
        assert {e.bucket for e in t.entries()} == {(1, 1), (2, 3), (4, 7), (8, 17), (18, 40)}
        import dataclasses

        assert t.get("cpu", "torch", BLOCK.signature_hash(), 4, 7) == dataclasses.replace(before, bucket_lo=4)
        assert t.put(entry(5, 12, 4.0), supersede=True)  # over [4, 7] and [8, 17]
        assert {e.bucket for e in t.entries()} == {(1, 1), (2, 3), (4, 4), (5, 12), (13, 17), (18, 40)}
        assert t.put(entry(1, 4, 9.0), supersede=True)  # a new bucket: [1, 1], [2, 3], [4, 4] inside it go
        assert {e.bucket for e in t.entries()} == {(1, 4), (5, 12), (13, 17), (18, 40)}
        assert not t.put(entry(5, 12, 8.0), supersede=True)  # slower than the stored [5, 12]: nothing changes
        assert {e.bucket for e in t.entries()} == {(1, 4), (5, 12), (13, 17), (18, 40)}
        assert t.put(entry(20, 30, 1.0, versions=other(kernel_hash="0ld")))  # other kernels: beside [18, 40]
        assert {e.bucket for e in t.entries()} >= {(18, 40), (20, 30)}
        assert t.put(entry(25, 35, 1.0), supersede=True)  # splits both versions' rows
        assert {e.bucket for e in t.entries()} == {(1, 4), (5, 12), (13, 17), (18, 24), (20, 24), (25, 35),
                                                   (36, 40)}


def test_the_issue_case_merge_and_tune_write_keep_the_older_tables_edges(tmp_path):
    """A table tuned for T = 1…1024 holds [48,98]; one tuned later for 1…64 ends with [37,64]. Merged, or
    written by a tuner over it, [65,98] keeps the older winner: every T covered before stays covered."""
    import dataclasses

    a, b, c = (tmp_path / f"{n}.sqlite" for n in "abc")
    wide = [(1, 8), (9, 47), (48, 98), (99, 1024)]
    narrow = [(1, 8), (9, 36), (37, 64)]
    with DispatchTable(a) as t:
        for lo, hi in wide:
            t.put(dataclasses.replace(entry(lo, hi, 5.0, kind="grouped_gemm"), tuned_at=OLD))
    with DispatchTable(b) as t:
        for lo, hi in narrow:
            t.put(dataclasses.replace(entry(lo, hi, 6.0), tuned_at=NEW))
    m = merge([a, b], c)
    with DispatchTable(c, create=False) as t:
        got = {e.bucket: (e.kind, e.tuned_at) for e in t.entries()}
    assert got == {(1, 8): ("grouped_gemm", OLD), (9, 36): ("stream_gemv", NEW), (37, 64): ("stream_gemv", NEW),
                   (65, 98): ("grouped_gemm", OLD), (99, 1024): ("grouped_gemm", OLD)}
    assert m == (7, 0, 5, 1, 2)  # [9,47] goes ([9,36], [37,64] over it), b's slower [1,8] loses, [48,98] trimmed
    served = {lo for lo, hi, _ in load_entries(c, BLOCK, "cpu", "torch")}
    assert served == {1, 9, 37, 65, 99}
    with DispatchTable(a) as t:  # the tuner's write (supersede) over a's rows
        for lo, hi in narrow:
            t.put(entry(lo, hi, 6.0), replace=True, supersede=True)
        assert [e.bucket for e in t.entries()] == [(1, 8), (9, 36), (37, 64), (65, 98), (99, 1024)]


def test_a_failed_merge_leaves_the_output_as_it_was(tmp_path, capsys):
    """An input that cannot be read stops the merge before the output changes; nothing is left beside it."""
    a, bad, c = tmp_path / "a.sqlite", tmp_path / "bad.sqlite", tmp_path / "c.sqlite"
    with DispatchTable(a) as t:
        t.put(entry(1, 4, 5.0))
    with DispatchTable(c) as t:
        t.put(entry(5, 8, 5.0))
    _garbage(bad)
    before = c.read_bytes()
    with pytest.raises(CacheError, match="bad.sqlite"):
        merge([a, bad], c)
    assert cli_main(["merge", str(a), str(bad), "-o", str(c)]) == 2
    assert "bad.sqlite" in capsys.readouterr().err
    assert c.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.sqlite", "bad.sqlite", "c.sqlite"]
    fresh = tmp_path / "new.sqlite"
    with pytest.raises(CacheError):
        merge([a, bad], fresh)
    assert not fresh.exists()


def test_a_bucket_s_parts_go_in_together_or_not_at_all(tmp_path):
    """put_all is one transaction: a part that cannot be written takes the others (and their splits) back."""
    path = tmp_path / "d.sqlite"
    with DispatchTable(path) as t:
        t.put(entry(1, 16, 5.0))
        t.db.execute(f"CREATE TRIGGER fail BEFORE INSERT ON {TABLE} WHEN NEW.bucket_lo = 9 "
                     "BEGIN SELECT RAISE(ABORT, 'refused'); END")
        with pytest.raises(CacheError, match="refused"):
            t.put_all([entry(1, 8, 4.0), entry(9, 16, 4.0)], replace=True, supersede=True)
        assert [e.bucket for e in t.entries()] == [(1, 16)]


def test_parts_tile_a_bucket_exactly(tmp_path):
    """parts(lo, hi): the bucket's own entry, or entries that tile it with no gap (a split bucket), in order;
    [] when the rows inside leave a gap or stick out of it."""
    with DispatchTable(tmp_path / "d.sqlite") as t:
        for lo, hi in ((1, 1), (2, 4), (5, 9), (10, 17), (20, 30)):
            t.put(entry(lo, hi, 5.0))
        parts = lambda lo, hi: [e.bucket for e in t.parts("cpu", "torch", BLOCK.signature_hash(), lo, hi)]  # noqa: E731
        assert parts(1, 1) == [(1, 1)]
        assert parts(2, 9) == [(2, 4), (5, 9)]
        assert parts(2, 17) == [(2, 4), (5, 9), (10, 17)]
        assert parts(2, 8) == []  # (5, 9) sticks out
        assert parts(10, 30) == []  # a gap at 18-19
        assert parts(40, 50) == []


def test_merge_splits_what_a_newer_overlapping_entry_of_the_same_versions_overlaps(tmp_path):
    """One table split a bucket that the other holds whole: the merged file keeps the newer tuning where
    they overlap, as the lookup would; a row of other kernels gives way to the current one over it (it
    serves nothing on this tree), and a row nothing overlaps is kept."""
    import dataclasses

    a, b, c = (tmp_path / f"{n}.sqlite" for n in "abc")
    with DispatchTable(a) as t:
        t.put(dataclasses.replace(entry(8, 17, 5.0), tuned_at=OLD))
        t.put(dataclasses.replace(entry(18, 40, 5.0), tuned_at=OLD))
        t.put(dataclasses.replace(entry(1, 3, 5.0, versions=other(kernel_hash="older")), tuned_at=OLD))
    with DispatchTable(b) as t:
        t.put(dataclasses.replace(entry(8, 11, 6.0), tuned_at=NEW))
        t.put(dataclasses.replace(entry(12, 17, 6.0), tuned_at=NEW))
        t.put(dataclasses.replace(entry(1, 7, 6.0), tuned_at=NEW))
    assert merge([a, b], c) == (6, 0, 4, 0, 2)  # [8,17]: wholly under [8,11] and [12,17]; [1,3] under [1,7]
    with DispatchTable(c, create=False) as t:
        got = sorted((e.bucket, e.versions.kernel_hash == HERE.kernel_hash) for e in t.entries())
    assert got == [((1, 7), True), ((8, 11), True), ((12, 17), True), ((18, 40), True)]


# ------------------------------------------------------------------- the spread column (added to v2)


def test_the_spread_round_trips(tmp_path):
    """An entry's spread (of the re-timings its winner was judged against) is stored and read back; NULL when
    not given."""
    import dataclasses

    with DispatchTable(tmp_path / "d.sqlite") as t:
        t.put(dataclasses.replace(entry(1, 1, 4.0), spread_us=0.25))
        t.put(entry(2, 7, 6.0))
    with DispatchTable(tmp_path / "d.sqlite", create=False) as t:
        assert {e.bucket: e.spread_us for e in t.entries()} == {(1, 1): 0.25, (2, 7): None}


def _v2_without_spread(path: Path) -> Path:
    """A dispatch_v2 file as written before the spread column existed (nor the estimated one, added later)."""
    with DispatchTable(path) as t:
        for e in V1_ENTRIES:
            t.put(e)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(f"ALTER TABLE {TABLE} DROP COLUMN estimated")
        conn.execute(f"ALTER TABLE {TABLE} DROP COLUMN spread_us")
    conn.close()
    return path


def _columns(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    cols = [r[1] for r in conn.execute(f"PRAGMA table_info({TABLE})")]
    conn.close()
    return cols


def test_a_v2_file_without_the_spread_column_reads_it_as_null_and_gains_it_when_written(tmp_path):
    """A reader of an older v2 file sees every row with spread_us None and leaves the file as it was; a
    writer (opening it for writing, or writing through a read-only handle) adds the column, every row kept."""
    path = _v2_without_spread(tmp_path / "old.sqlite")
    assert "spread_us" not in _columns(path)
    with DispatchTable(path, create=False) as t:
        assert t.entries() == V1_ENTRIES and all(e.spread_us is None for e in t.entries())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_entries(path, BLOCK, "cpu", "torch")) == 3
    assert "spread_us" not in _columns(path)
    with DispatchTable(path) as t:
        assert "spread_us" in _columns(path) and t.entries() == V1_ENTRIES
    again = _v2_without_spread(tmp_path / "again.sqlite")
    import dataclasses

    with DispatchTable(again, create=False) as t:
        assert t.put(dataclasses.replace(entry(17, 32, 3.0), spread_us=0.5))
        assert {e.bucket: e.spread_us for e in t.entries()} == {(1, 1): None, (2, 7): None, (8, 16): None,
                                                               (17, 32): 0.5}
    assert _columns(again) == list(COLUMNS)
