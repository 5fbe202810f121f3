"""The dispatch table: tuned winners per (target, backend, block signature, token bucket), in SQLite.

One versioned table, `dispatch_v2`, with typed columns (sqlite-utils), in WAL mode:

    key     target, backend, signature (MoEBlock.signature_hash()), bucket_lo, bucket_hi
    winner  kind, row_threshold, params_type, params (JSON)
    timing  time_us, floor_us, pct_of_floor, default_time_us, baseline_time_us, baseline, timer, trials,
            spread_us (the spread of the winner's and the default's re-timings it was judged against)
    context signature_text, moetune, kernel_hash, backend_version, torch, device, capability, tuned_at
            (what the timing depends on: `versions.Versions`)
    kind of time  estimated: 1 where time_us is a cost-model estimate, not a measurement (`moetune tune
            --verify-only` for a target not here: every candidate verified and lowered, none timed; device
            then says where it was verified); NULL or 0: measured

A file of the previous version, `dispatch_v1` (the same columns and a `fusion` one, which no kernel
reads), is read as it is, and moved to `dispatch_v2` in one transaction when it is opened for writing.
A `dispatch_v2` file written before a column of `ADDED` existed is read with that column NULL, and gains
it when opened for writing.

An entry is replaced only by a faster one (`put`), or by any new one when the stored entry was measured
with another kernel source, backend version or device (it no longer says anything about this code), or
when the tuner that writes it measured the stored winner itself, on the same cases, and chose against it
(`put(..., replace=True)`: its choice also weighs the bucket's edges, so its time may be the higher).
Estimates and measurements are never weighed against each other: a measured entry replaces an estimate of
its key and splits the estimates it overlaps, whatever their times; an estimate never replaces or splits a
measured entry (it replaces and splits only estimates, by the rules above). A lookup prefers measured
entries: an estimate is used only where it overlaps no usable measured entry, and the lookup names it.
An entry written over rows of other buckets splits them around itself (`DispatchTable._split_around`):
a table never loses coverage, and rows of the same versions never overlap. Several tuners may write one
file at once: each `put_all` is one transaction and waits for the lock.

Beside this module: `schema` (the file format: columns, keys, the move from V1, opening a file), `entry` (a row,
a lookup's result) and `coverage` (which rows give way to a write and what of them stays). This module is the
table: opening and checking a file, writing (`put_all`, one transaction), reading (`entries`, `lookup`). It and
they are what a deployment reads: they import neither the search nor Optuna.

    table = DispatchTable("cache/cpu-tiny.sqlite")
    found = table.lookup(block, target="cpu", backend="torch")     # usable + rejected (with reasons)
    entries = load_entries(path, block, "cpu", "torch")             # [(lo, hi, Schedule)], warns once
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from ..ir import CacheError, MoEBlock, Schedule
from . import schema
from .coverage import gives_way, outside, precedence, rank, same_versions
from .entry import DispatchEntry, Lookup
from .schema import (
    COLUMNS,
    PK,
    TABLE,
    V1,
    V1_COLUMNS,
    VERSION_COLUMNS,
    connect,
    lacking,
    rollback,
    typed,
    write_failed,
)
from .versions import Versions, judge, serves


class CacheWarning(UserWarning):
    """A dispatch table (or some of its entries) could not be used; the model falls back to defaults."""


class Claim(Protocol):
    """Who writes a shared study's winner (`DispatchTable.put_all`): asked inside the write's transaction."""

    def free(self, table: DispatchTable, entries: list[DispatchEntry]) -> bool:
        """Whether this writer may write `entries` (no other one wrote what it would)."""

    def take(self, table: DispatchTable, written: list[DispatchEntry]) -> None:
        """Record that this writer wrote `written`."""


class DispatchTable:
    """One dispatch-table file. `create=False` opens an existing file only (the runtime's way)."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True):
        import sqlite_utils

        self.path = Path(path)
        self._conn = connect(self.path, create)
        self._wrote = False  # whether this handle wrote: only then does close() checkpoint (and wait for one)
        try:
            self.db = sqlite_utils.Database(self._conn)
            try:
                status = self._conn.execute("PRAGMA quick_check").fetchone()[0]
                if status != "ok":
                    raise CacheError(f"dispatch table {self.path}: corrupt ({status})")
                if create:
                    self._writable()
                else:
                    self._check_schema()
            except (sqlite3.Error, UnicodeDecodeError) as e:  # not SQLite, a schema it cannot parse, not UTF-8
                raise CacheError(f"dispatch table {self.path}: not a readable SQLite file ({e})") from e
        except BaseException:
            self._conn.close()
            raise

    def _setup(self, wait_s: float = 60.0) -> None:
        """WAL mode and the table (`_create`). Switching the journal mode may answer "locked" at once,
        without waiting (another tuner is creating the same file): retry until `wait_s` is spent."""
        import time

        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.db.enable_wal()
                self._create()
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _create(self) -> None:
        """Create `TABLE` or move an older file to it (`schema.create`)."""
        if schema.create(self._conn, self.db, self.path):
            self._wrote = True

    def _check_schema(self) -> None:
        """`source`: the table rows are read from (`TABLE`, or a `V1` table not yet moved; None when the
        file holds neither, and `foreign_version` names the dispatch table of another version it holds)."""
        names = self.db.table_names()
        self.foreign_version = None
        self.source = next((t for t in (TABLE, V1) if t in names), None)
        if self.source is None:
            others = [t for t in names if t.startswith("dispatch_")]
            self.foreign_version = others[0] if others else None
            return
        schema.check_columns(self.db, self.path, self.source, COLUMNS if self.source == TABLE else V1_COLUMNS)

    def _writable(self) -> None:
        """Before a write: the file holds `TABLE` with every column (a file opened with create=False may
        hold `V1` only, or a `TABLE` lacking the columns of `ADDED`)."""
        if getattr(self, "source", None) == TABLE and not lacking(self.db, TABLE):
            return
        try:
            self._setup()
        except sqlite3.Error as e:
            raise write_failed(self.path, e) from e
        self._check_schema()

    # context management
    def close(self) -> None:
        """Close; a handle that wrote first copies the log into the file (`_checkpoint`). A reader does not:
        the checkpoint would wait for a tuner's open write transaction, and a reader never waits."""
        if self._wrote:
            self._checkpoint("TRUNCATE")
        self._conn.close()

    def _checkpoint(self, mode: str = "PASSIVE") -> None:
        """Copy committed rows from the write-ahead log into the file itself, so that the .sqlite
        file alone (copied, shipped, or left by a killed tuner) holds every written entry.  Best
        effort: a busy database (another worker writing) is checkpointed by a later write."""
        try:
            self._conn.execute(f"PRAGMA wal_checkpoint({mode})")
        except sqlite3.Error:
            pass

    def __enter__(self) -> DispatchTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # writing
    def put(self, entry: DispatchEntry, *, replace_stale: bool = True, replace: bool = False,
            supersede: bool = False, claim: Claim | None = None) -> bool:
        """Write one entry (`put_all`); whether it was written."""
        return self.put_all([entry], replace_stale=replace_stale, replace=replace, supersede=supersede,
                            claim=claim)[0]

    def put_all(self, entries: Iterable[DispatchEntry], *, replace_stale: bool = True, replace: bool = False,
                supersede: bool = False, split: Callable[[DispatchEntry], bool] | None = None,
                claim: Claim | None = None) -> list[bool]:
        """Write `entries` in order, in one transaction (all of them or none); whether each was written.

        An entry replaces the stored one of its key when it is faster (or, with `replace_stale`, when the
        stored one was measured with other kernels, libraries or device; with `replace`, always). A written
        entry splits the other rows of its (target, backend, block) that overlap it and were measured with
        the same versions around itself (`_split_around`): what lies outside it stays, every field but the
        bucket unchanged, and a row wholly inside it goes, so every token count covered before stays
        covered. With `supersede` (a tuner's write: it re-tuned that range) rows of other versions are
        split too; with `split`, the rows of other versions it accepts (a merge's: the stale ones).
        With `claim` (workers sharing a study), nothing is written unless `claim.free(self)`, and
        `claim.take(self, written)` records the write; both inside the transaction, so that of the
        workers writing this file one at a time, each sees what the others wrote."""
        self._writable()
        entries = list(entries)
        with self._transaction():
            if claim is not None and not claim.free(self, entries):
                return [False] * len(entries)
            written = [self._write(e, replace_stale, replace, supersede, split) for e in entries]
            if claim is not None and any(written):
                claim.take(self, [e for e, w in zip(entries, written, strict=True) if w])
        if any(written):
            self._checkpoint()
        return written

    def prune_overlapped(self) -> int:
        """Split every row around the newer rows of its (target, backend, block) that overlap it and were
        measured with the same versions (a file written before writes split: the lookup would reject such a
        row whole); one transaction. Returns how many rows were trimmed or went."""
        self._writable()
        n = 0
        with self._transaction():
            for e in sorted(self.entries(), key=rank):  # oldest first: each row splits the older ones
                if self.get(e.target, e.backend, e.signature, e.bucket_lo, e.bucket_hi) != e:
                    continue
                n += self._split_around(e, lambda old, e=e: same_versions(old, e) and rank(old) < rank(e)
                                        and gives_way(old, e, False))
        if n:
            self._checkpoint()
        return n

    @contextlib.contextmanager
    def _transaction(self):
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._conn.execute("COMMIT")
            except BaseException:
                rollback(self._conn)
                raise
        except sqlite3.Error as e:
            raise write_failed(self.path, e) from e
        self._wrote = True

    def _write(self, entry: DispatchEntry, replace_stale: bool, replace: bool, supersede: bool,
               split: Callable[[DispatchEntry], bool] | None = None) -> bool:
        """Inside a transaction: the upsert of `put_all`, then the split of what it overlaps."""
        cond = "1" if replace else f"excluded.time_us < {TABLE}.time_us"
        if replace_stale and not replace:
            cond += "".join(f" OR excluded.{c} IS NOT {TABLE}.{c}" for c in VERSION_COLUMNS)
        if self._upsert(entry, precedence(entry, cond)) == 0:
            return False
        self._split_around(entry, lambda old: gives_way(old, entry, supersede or (split is not None and split(old))))
        return True

    def _upsert(self, entry: DispatchEntry, cond: str) -> int:
        row, cols = entry.row(), list(COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in cols if c not in PK)
        sql = (f"INSERT INTO {TABLE} ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)}) "
               f"ON CONFLICT ({', '.join(PK)}) DO UPDATE SET {updates} WHERE {cond}")
        return self._conn.execute(sql, [row[c] for c in cols]).rowcount

    def _split_around(self, entry: DispatchEntry, among: Callable[[DispatchEntry], bool]) -> int:
        """Inside a transaction: the one place rows give way to a written entry. Each other row of the
        entry's (target, backend, block) that overlaps it and that `among(row)` accepts is replaced by what
        of it lies outside the entry (`coverage.outside`: none, one or two rows, every field but the bucket kept).
        A remainder whose key a row of other versions already holds (rows of other versions may overlap)
        keeps the newer of the two. Returns how many rows were trimmed or went."""
        where = " AND ".join(f"{c} = ?" for c in PK)
        overlapping = [DispatchEntry.from_row(r) for r in self.db.query(
            f"SELECT {', '.join(COLUMNS)} FROM {TABLE} WHERE target = ? AND backend = ? AND signature = ? "
            "AND bucket_lo <= ? AND bucket_hi >= ? AND NOT (bucket_lo = ? AND bucket_hi = ?)",
            [entry.target, entry.backend, entry.signature, entry.bucket_hi, entry.bucket_lo,
             entry.bucket_lo, entry.bucket_hi])]
        n = 0
        for old in overlapping:
            if not among(old):
                continue
            self._conn.execute(f"DELETE FROM {TABLE} WHERE {where}",
                               [old.target, old.backend, old.signature, old.bucket_lo, old.bucket_hi])
            for part in outside(old, entry.bucket_lo, entry.bucket_hi):
                self._upsert(part, precedence(part, f"excluded.tuned_at > {TABLE}.tuned_at"))
            n += 1
        return n

    # reading
    def entries(self, target: str | None = None, backend: str | None = None,
                signature: str | None = None) -> list[DispatchEntry]:
        if self.source is None:
            return []
        where, args = [], []
        for col, val in (("target", target), ("backend", backend), ("signature", signature)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        absent = lacking(self.db, self.source)
        cols = ", ".join(f"NULL AS {c}" if c in absent else c for c in COLUMNS)
        sql = (f"SELECT {cols} FROM {self.source}" + (f" WHERE {' AND '.join(where)}" if where else "")
               + " ORDER BY target, backend, signature, bucket_lo")
        try:
            return [DispatchEntry.from_row(typed(self.path, r)) for r in self.db.query(sql, args)]
        except (sqlite3.Error, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CacheError(f"dispatch table {self.path}: unreadable rows ({type(e).__name__}: {e})") from e

    def get(self, target: str, backend: str, signature: str, lo: int, hi: int) -> DispatchEntry | None:
        for e in self.entries(target, backend, signature):
            if (e.bucket_lo, e.bucket_hi) == (lo, hi):
                return e
        return None

    def parts(self, target: str, backend: str, signature: str, lo: int, hi: int) -> list[DispatchEntry]:
        """The entries that tile bucket [lo, hi] exactly, in order: [its own entry], or the parts the tuner
        split it into (study.split_parts); [] when the stored rows do not cover it that way."""
        inside = [e for e in self.entries(target, backend, signature) if lo <= e.bucket_lo and e.bucket_hi <= hi]
        nxt, out = lo, []
        for e in sorted(inside, key=lambda e: (e.bucket_lo, -e.bucket_hi)):
            if e.bucket_lo == nxt:
                out.append(e)
                nxt = e.bucket_hi + 1
        return out if nxt == hi + 1 else []

    def lookup(self, block: MoEBlock, target: str, backend: str, *, versions: Versions | None = None,
               device: str = "cpu") -> Lookup:
        """The entries of this block on (target, backend) that may be used here, and those that may
        not (foreign device, stale kernel sources, unbuildable schedule) with the reason; an entry timed with
        another version of the backend's library on the same kernel sources is used, and said. An estimate is
        used only where no usable measured entry overlaps it, and is listed in `estimated`."""
        current = versions or Versions.current(backend, device)
        usable, rejected, retime, estimated, measured = [], [], [], [], set()
        # Tuning runs over different token ranges bucket differently: where entries overlap, the most
        # recently tuned one is kept (a schedule is never borrowed across buckets); measured entries first.
        newest_first = sorted(self.entries(target, backend, block.signature_hash()),
                              key=lambda e: (not e.estimated, e.tuned_at, e.bucket_lo), reverse=True)
        for e in newest_first:
            why = judge(e, current)
            clash = next(((lo, hi) for lo, hi, _ in usable if lo <= e.bucket_hi and e.bucket_lo <= hi), None)
            if serves(why) and clash is not None:
                why = (f"an estimate overlapping the measured entry [{clash[0]},{clash[1]}], which is preferred"
                       if e.estimated and clash in measured else f"overlaps [{clash[0]},{clash[1]}], which was "
                       "tuned later")
            if serves(why):
                try:
                    usable.append((e.bucket_lo, e.bucket_hi, e.schedule(block)))
                    if why is not None:
                        retime.append((e, why))
                    if e.estimated:
                        estimated.append(e)
                    else:
                        measured.add(e.bucket)
                    continue
                except CacheError as err:
                    why = f"stale: {err}"
            rejected.append((e, why))
        usable.sort(key=lambda u: u[0])
        rejected.sort(key=lambda r: r[0].bucket_lo)
        retime.sort(key=lambda r: r[0].bucket_lo)
        estimated.sort(key=lambda e: e.bucket_lo)
        return Lookup(tuple(usable), tuple(rejected), str(self.path), tuple(retime), tuple(estimated))


def table_path(cache: str | os.PathLike, target: str) -> Path:
    """The table file a compiled model on `target` reads: `cache` itself, or `cache/<target>.sqlite` when `cache`
    is a folder (a deployment ships one table per GPU, e.g. cache/h100.sqlite and cache/h200.sqlite)."""
    p = Path(cache)
    return p / f"{target}.sqlite" if p.is_dir() else p


def load_entries(path: str | os.PathLike, block: MoEBlock, target: str, backend: str, *,
                 versions: Versions | None = None, device: str = "cpu",
                 notes: list[str] | None = None,
                 estimated: list[tuple[int, int]] | None = None) -> list[tuple[int, int, Schedule]]:
    """The runtime's call: usable (lo, hi, Schedule) of `block` in the file at `path`; the (lo, hi) of those
    that are cost-model estimates (used where no measured entry covers them) are appended to `estimated`.

    A missing file gives no entries; foreign or stale entries are left out, entries timed with another
    version of the backend's library are used; each is said in one CacheWarning, or appended to `notes`
    when the caller folds it into a warning of its own (the compiled model gives one warning per block).
    A corrupt or unreadable file raises CacheError naming it."""
    def say(msg: str) -> None:
        if notes is None:
            warnings.warn(msg, CacheWarning, stacklevel=3)
        else:
            notes.append(msg)

    p = table_path(path, target)
    if not p.exists():
        here = ", ".join(sorted(q.name for q in p.parent.glob("*.sqlite"))) if Path(path).is_dir() else ""
        held = f" (the folder holds {here})" if here else ""
        say(f"dispatch table {p}: no such file{held}; every bucket uses the default schedule")
        return []
    with DispatchTable(p, create=False) as table:
        if table.foreign_version:
            say(f"dispatch table {p}: holds {table.foreign_version}, this moetune reads {TABLE} and {V1}; "
                "not used")
            return []
        found = table.lookup(block, target, backend, versions=versions, device=device)
    msg = found.warning()
    if msg:
        say(msg)
    if estimated is not None:
        estimated.extend(e.bucket for e in found.estimated)
    return list(found.usable)
