"""Faults of the dispatch-table file: a table of another backend, a read-only file system, a table held by a
running tuner (readers never wait, never see half a write), writers killed with SIGKILL at random points, and
a full disk. (Truncated, random-bytes, wrong-schema and other-device tables: test_table.py.)"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_table import BLOCK, HERE, entry

from moetune.ir import CacheError
from moetune.runtime.schema import TABLE
from moetune.runtime.table import DispatchTable, load_entries

ROOT = Path(__file__).resolve().parents[2]
SPAN = (1, 64)  # the token range the tuners below tile


def _tiling(rng: random.Random, gen: int, hi: int = SPAN[1], least: int = 1) -> list:
    """A random tiling of [1, hi] into `least` to 6 buckets, every part with time `gen` (the write it came from)."""
    cuts = sorted(rng.sample(range(2, hi + 1), rng.randint(least - 1, 5)))
    edges = [1, *cuts, hi + 1]
    return [entry(lo, nxt - 1, float(gen)) for lo, nxt in zip(edges, edges[1:], strict=False)]


def _tiled_by_one_write(rows) -> int:
    """The write that the rows of SPAN come from; fails unless they tile SPAN exactly and come from one write."""
    span = sorted((e.bucket_lo, e.bucket_hi, e.time_us) for e in rows if e.bucket_hi <= SPAN[1])
    assert span and span[0][0] == 1 and span[-1][1] == SPAN[1], span
    assert all(a[1] + 1 == b[0] for a, b in zip(span, span[1:], strict=False)), span  # no gap, no overlap
    gens = {t for _, _, t in span}
    assert len(gens) == 1, span  # one write's parts, never half of one and half of another
    return int(gens.pop())


def _integrity(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


# ------------------------------------------------------------------------------- another backend


def test_a_table_of_another_backend_serves_nothing_and_keeps_its_rows(tmp_path):
    """Rows of another backend for the same block and target are not served (not even as foreign), and a
    write of this backend beside them leaves them as they are."""
    import dataclasses

    path = tmp_path / "d.sqlite"
    theirs = [dataclasses.replace(entry(lo, hi, 3.0), backend="triton") for lo, hi in ((1, 8), (9, 64))]
    with DispatchTable(path) as t:
        t.put_all(theirs)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_entries(path, BLOCK, "cpu", "torch") == []
    with DispatchTable(path) as t:
        assert t.put(entry(1, 64, 9.0), supersede=True)
        assert sorted(t.entries(backend="triton"), key=lambda e: e.bucket_lo) == theirs
    assert [(lo, hi) for lo, hi, _ in load_entries(path, BLOCK, "cpu", "torch")] == [(1, 64)]


# ------------------------------------------------------------------------------ read-only files

CHILD = r"""
import json, sys, warnings
sys.path.insert(0, {tests!r})
from test_table import BLOCK, entry
from moetune.ir import CacheError
from moetune.runtime.table import DispatchTable, load_entries

path, said = {path!r}, {{}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    said["served"] = [[lo, hi] for lo, hi, _ in load_entries(path, BLOCK, "cpu", "torch")]
said["warnings"] = [str(w.message) for w in caught]
with DispatchTable(path, create=False) as t:
    said["rows"] = len(t.entries())
    try:
        t.put(entry(100, 200, 1.0))
    except CacheError as e:
        said["put"] = str(e)
try:
    DispatchTable(path)
except CacheError as e:
    said["open_to_write"] = str(e)
print(json.dumps(said))
"""


def _shipped(folder: Path) -> Path:
    folder.mkdir()
    path = folder / "cpu.sqlite"
    with DispatchTable(path) as t:
        t.put_all([entry(1, 8, 4.0), entry(9, 64, 6.0)])
    assert sorted(p.name for p in folder.iterdir()) == ["cpu.sqlite"]  # what a package ships: the file alone
    return path


def _namespaces() -> bool:
    """Whether this process may make a user and mount namespace (a read-only bind mount, a small tmpfs)."""
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _in_namespace(setup: str, code: str) -> subprocess.CompletedProcess:
    """Python `code` run after the shell `setup` in a user and mount namespace of its own."""
    script = f"{setup} && exec {sys.executable} -c \"$0\""
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, code],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def _check_read_only(said: dict, path: Path, before: bytes, why: str) -> None:
    assert said["served"] == [[1, 8], [9, 64]] and said["rows"] == 2
    assert not said["warnings"], said["warnings"]
    assert said["put"].startswith(f"dispatch table {path}: write failed, nothing was written (the file is read-only")
    assert said["open_to_write"] == f"dispatch table {path}: cannot be written: {why}; nothing was written"
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["cpu.sqlite"]


@pytest.mark.skipif(not _namespaces(), reason="no user and mount namespaces here (unshare)")
def test_a_table_on_a_read_only_file_system_is_read_and_refuses_writes_naming_it(tmp_path):
    path = _shipped(tmp_path / "ro")
    before = path.read_bytes()
    d = path.parent
    got = _in_namespace(f"mount --bind {d} {d} && mount -o remount,bind,ro {d}",
                        CHILD.format(tests=str(ROOT / "tests" / "runtime"), path=str(path)))
    assert got.returncode == 0, got.stderr
    _check_read_only(json.loads(got.stdout), path, before, f"{d} is on a read-only file system")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in folders without write permission")
def test_a_table_in_a_folder_without_write_permission_is_read_and_refuses_writes_naming_it(tmp_path):
    path = _shipped(tmp_path / "locked")
    before = path.read_bytes()
    path.parent.chmod(0o555)
    try:
        got = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(ROOT / "tests" / "runtime"),
                                                                  path=str(path))],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        path.parent.chmod(0o755)
    assert got.returncode == 0, got.stderr
    _check_read_only(json.loads(got.stdout), path, before, f"no permission to write in {path.parent}")


# ------------------------------------------------------------------------- held by a running tuner

HOLD_S = 0.1  # each row a held writer inserts keeps its transaction open this much longer


def _held_writer(path: str, writes: int, ready) -> None:
    """A tuner whose every write holds its transaction open (each inserted row sleeps in a trigger), and that
    holds a write transaction between its writes too."""
    rng = random.Random(7)
    with DispatchTable(path) as t:
        t.put_all(_tiling(rng, 1), replace=True, supersede=True)
        ready.set()
        t._conn.create_function("pause", 1, time.sleep)
        t._conn.execute(f"CREATE TEMP TRIGGER slow AFTER INSERT ON main.{TABLE} BEGIN SELECT pause({HOLD_S}); END")
        raw = sqlite3.connect(path, isolation_level=None)  # a second writer of the same tuner: holds, then commits
        for gen in range(2, writes + 2):  # each held ≥ 3 × HOLD_S
            t.put_all(_tiling(rng, gen, least=3), replace=True, supersede=True)
            raw.execute("BEGIN IMMEDIATE")
            raw.execute(f"UPDATE {TABLE} SET trials = trials + 0")  # the same rows: the span as it was
            time.sleep(3 * HOLD_S)
            raw.execute("COMMIT")
        raw.close()


def test_readers_of_a_table_a_tuner_holds_never_wait_nor_see_half_a_write(tmp_path):
    """A writer process holds a write transaction most of the time (each write's rows sleep in a trigger);
    readers in a loop, the runtime's load_entries and a table handle, each return at once, and every read
    sees the span tiled by one whole write."""
    path = tmp_path / "d.sqlite"
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    w = ctx.Process(target=_held_writer, args=(str(path), 4, ready))
    w.start()
    try:
        assert ready.wait(60)
        seen, took = set(), []
        while w.is_alive():
            t0 = time.monotonic()
            served = load_entries(path, BLOCK, "cpu", "torch", versions=HERE)
            with DispatchTable(path, create=False) as t:
                rows = t.entries()
            took.append(time.monotonic() - t0)
            seen.add(_tiled_by_one_write(rows))
            spans = sorted((lo, hi) for lo, hi, _ in served)  # its own read: tiled too
            assert spans[0][0] == 1 and spans[-1][1] == SPAN[1] and all(
                a[1] + 1 == b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    finally:
        w.join(120)
    assert w.exitcode == 0
    assert len(seen) >= 3, seen  # the reads met the writer at work
    took.sort()
    # a reader that waited for the write transaction it met would take about half of one (≥ 1.5 × HOLD_S)
    assert took[len(took) // 2] < HOLD_S / 2 and took[-1] < 1.0, (took[len(took) // 2], took[-1])


# ------------------------------------------------------------------------------ killed mid-write

READY = -1  # a writer's first message: it runs


def _killable_writer(path: str, seed: int, start: int, said) -> None:
    """Write forever: each write tiles SPAN anew (splitting the rows it covers) and adds a row of its own
    (bucket 1000 + gen), reported once put_all returned; every few writes a fresh handle (open and close)."""
    rng = random.Random(seed)
    gen = start
    said.send(READY)  # the kill's random delay counts from here, however long the fork took
    while True:
        with DispatchTable(path) as t:
            for _ in range(rng.randint(1, 4)):
                gen += 1
                t.put_all([*_tiling(rng, gen), entry(1000 + gen, 1000 + gen, float(gen))], replace=True,
                          supersede=True)
                said.send(gen)


def test_writers_killed_at_random_points_leave_a_sound_table_with_every_committed_row(tmp_path):
    """60 writers, each SIGKILLed after a random delay (inside a write, its commit, a checkpoint, an open or a
    close): after every kill the file passes integrity_check, holds every row of every write that returned,
    and the span stays tiled by one whole write, never by less than before."""
    path = tmp_path / "d.sqlite"
    ctx = mp.get_context("fork")
    rng = random.Random(43)
    committed: list[int] = []
    last_tiling = 0
    for kill in range(60):
        recv, send = ctx.Pipe(duplex=False)
        start = 1000 * (kill + 1)  # each writer's own generations
        p = ctx.Process(target=_killable_writer, args=(str(path), kill, start, send))
        p.start()
        send.close()
        assert recv.poll(30) and recv.recv() == READY
        time.sleep(rng.uniform(0.0, 0.06))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        while recv.poll():
            try:
                committed.append(recv.recv())
            except EOFError:
                break
        recv.close()
        if not path.exists():
            assert not committed
            continue
        assert _integrity(path) == "ok"
        with DispatchTable(path, create=False) as t:
            rows = t.entries()
        own = {e.bucket_lo - 1000 for e in rows if e.bucket_lo > 1000}
        lost = [g for g in committed if g not in own]
        assert not lost, f"kill {kill}: rows of returned writes lost: {lost}"
        if committed:
            tiling = _tiled_by_one_write(rows)
            assert tiling >= max(committed[-1], last_tiling), (kill, tiling, committed[-1])
            last_tiling = tiling
    assert len(committed) >= 60, "the writers were killed before they wrote"


# ------------------------------------------------------------------------------------- disk full

DISK_FULL = r"""
import json, os, sqlite3, sys
sys.path.insert(0, {tests!r})
from test_table import entry
from moetune.ir import CacheError
from moetune.runtime.table import DispatchTable

path, said = {path!r}, {{}}
with DispatchTable(path) as t:
    t.put_all([entry(1, 8, 4.0), entry(9, 64, 6.0)])
with DispatchTable(path) as t:  # a tuner that has the table open when the disk fills up
    before = open(path, "rb").read()
{fill}
    try:
        t.put_all([entry(100 + i, 100 + i, 1.0) for i in range(3000)])
    except CacheError as e:
        said["error"] = str(e)
    said["rows"] = sorted(e.bucket for e in t.entries())
said["unchanged"] = open(path, "rb").read() == before
conn = sqlite3.connect(path)
said["integrity"] = conn.execute("PRAGMA integrity_check").fetchone()[0]
conn.close()
{free}
with DispatchTable(path) as t:
    said["after"] = t.put(entry(65, 80, 2.0))
print(json.dumps(said))
"""


def _check_full(said: dict, path: str, cause: str) -> None:
    assert said["error"].startswith(f"dispatch table {path}: write failed, nothing was written ({cause}"), said
    assert said["rows"] == [[1, 8], [9, 64]] and said["unchanged"] and said["integrity"] == "ok"
    assert said["after"]  # once there is room again, the table takes writes


@pytest.mark.skipif(not _namespaces(), reason="no user and mount namespaces here (unshare)")
def test_a_full_disk_fails_the_write_naming_the_file_and_leaves_the_table_as_it_was(tmp_path):
    """A tmpfs of 256 KiB, filled up once the table is on it."""
    d = tmp_path / "small"
    d.mkdir()
    path = str(d / "cpu.sqlite")
    fill = (f"    with open({str(d / 'filler')!r}, 'wb', buffering=0) as f:\n"
            "        try:\n            while True:\n                f.write(bytes(4096))\n"
            "        except OSError:\n            pass")
    code = DISK_FULL.format(tests=str(ROOT / "tests" / "runtime"), path=path, fill=fill,
                            free=f"os.unlink({str(d / 'filler')!r})")
    got = _in_namespace(f"mount -t tmpfs -o size=256k tmpfs {d}", code)
    assert got.returncode == 0, got.stderr
    _check_full(json.loads(got.stdout), path, "the disk is full; SQLITE_FULL")


def test_a_file_size_limit_fails_the_write_naming_the_file_and_leaves_the_table_as_it_was(tmp_path):
    """RLIMIT_FSIZE: the kernel refuses to grow any file of the writer past the table's size at the time."""
    path = str(tmp_path / "cpu.sqlite")
    fill = ("    import resource, signal\n    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "    size = max(os.path.getsize(p) for p in (path, path + '-wal', path + '-shm') if os.path.exists(p))\n"
            "    resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))")
    code = DISK_FULL.format(tests=str(ROOT / "tests" / "runtime"), path=path, fill=fill,
                            free="resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert got.returncode == 0, got.stderr
    _check_full(json.loads(got.stdout), path, "SQLITE_IOERR")


def test_a_write_refused_at_commit_leaves_the_handle_usable(tmp_path):
    """A write SQLite refuses ends its transaction: the same handle's next write goes in."""
    path = tmp_path / "d.sqlite"
    with DispatchTable(path) as t:
        t.put(entry(1, 8, 4.0))
        t._conn.execute("PRAGMA max_page_count = 1")  # SQLITE_FULL at the first page the write needs
        with pytest.raises(CacheError, match=r"d.sqlite: write failed, nothing was written \(the disk is full"):
            t.put_all([entry(100 + i, 100 + i, 1.0) for i in range(500)])
        assert [e.bucket for e in t.entries()] == [(1, 8)]
        t._conn.execute("PRAGMA max_page_count = 1073741823")
        assert t.put(entry(9, 16, 4.0))
    with DispatchTable(path, create=False) as t:
        assert [e.bucket for e in t.entries()] == [(1, 8), (9, 16)]
