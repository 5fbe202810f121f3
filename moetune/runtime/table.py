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

This module is what a deployment reads: it imports neither the search nor Optuna.

    table = DispatchTable("cache/cpu-tiny.sqlite")
    found = table.lookup(block, target="cpu", backend="torch")     # usable + rejected (with reasons)
    entries = load_entries(path, block, "cpu", "torch")             # [(lo, hi, Schedule)], warns once
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import sqlite3
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..ir import CacheError, MoEBlock, MoetuneError, Schedule
from .versions import Versions, judge, serves

TABLE = "dispatch_v2"
V1 = "dispatch_v1"  # read as it is; moved to TABLE when opened for writing
PK = ("target", "backend", "signature", "bucket_lo", "bucket_hi")
COLUMNS: dict[str, type] = {
    "target": str,
    "backend": str,
    "signature": str,
    "bucket_lo": int,
    "bucket_hi": int,
    "signature_text": str,
    "kind": str,
    "row_threshold": int,
    "params_type": str,
    "params": str,
    "time_us": float,
    "floor_us": float,
    "pct_of_floor": float,
    "default_time_us": float,
    "baseline_time_us": float,
    "baseline": str,
    "timer": str,
    "trials": int,
    "moetune": str,
    "kernel_hash": str,
    "backend_version": str,
    "torch": str,
    "device": str,
    "capability": str,
    "tuned_at": str,
    "spread_us": float,
    "estimated": int,
}
# nullable columns added to TABLE after its first files: NULL where a file lacks them
ADDED = ("spread_us", "estimated")
V1_COLUMNS = {**{c: t for c, t in COLUMNS.items() if c not in ADDED}, "fusion": str}
NOT_NULL = set(PK) | {"signature_text", "kind", "time_us", "kernel_hash", "backend_version",
                      "device", "capability", "tuned_at"}
_VERSION_COLUMNS = ("kernel_hash", "backend_version", "device", "capability")
_SQL_TYPES = {str: "TEXT", int: "INTEGER", float: "REAL"}
_CREATE = (f"CREATE TABLE IF NOT EXISTS [{TABLE}] ("
           + ", ".join(f"[{c}] {_SQL_TYPES[t]}{' NOT NULL' if c in NOT_NULL else ''}" for c, t in COLUMNS.items())
           + f", PRIMARY KEY ({', '.join(f'[{c}]' for c in PK)}))")


class CacheWarning(UserWarning):
    """A dispatch table (or some of its entries) could not be used; the model falls back to defaults."""


# ------------------------------------------------------------------------------------------ entries


def _tuplify(v):
    if isinstance(v, list):
        return tuple(_tuplify(x) for x in v)
    return v


@dataclass(frozen=True)
class DispatchEntry:
    """One row of the table; `schedule(block)` rebuilds the winner with the backend's params class."""

    target: str
    backend: str
    signature: str
    bucket_lo: int
    bucket_hi: int
    signature_text: str
    kind: str
    row_threshold: int | None
    params_type: str | None
    params: str | None  # JSON object of the params dataclass's fields
    time_us: float
    floor_us: float | None
    pct_of_floor: float | None
    default_time_us: float | None
    baseline_time_us: float | None
    baseline: str | None
    timer: str | None
    trials: int | None
    versions: Versions
    tuned_at: str
    spread_us: float | None = None  # the spread of the re-timings the winner beat the default by more than
    estimated: bool = False  # time_us (and default_time_us) are cost-model estimates, not measurements

    def __post_init__(self) -> None:
        object.__setattr__(self, "estimated", bool(self.estimated))  # the column reads 1, 0 or NULL

    @classmethod
    def of(
        cls, *, target: str, block: MoEBlock, bucket: tuple[int, int], schedule: Schedule, time_us: float,
        versions: Versions, floor_us: float | None = None, default_time_us: float | None = None,
        baseline_time_us: float | None = None, baseline: str | None = None, timer: str | None = None,
        trials: int | None = None, tuned_at: str | None = None, spread_us: float | None = None,
        estimated: bool = False,
    ) -> DispatchEntry:
        if schedule.backend is None:
            raise CacheError(f"entry {target}/{bucket}: schedule {schedule.describe()} names no backend")
        p = schedule.params
        return cls(
            target=target, backend=schedule.backend, signature=block.signature_hash(),
            bucket_lo=int(bucket[0]), bucket_hi=int(bucket[1]), signature_text=block.signature(),
            kind=schedule.kind, row_threshold=schedule.row_threshold,
            params_type=None if p is None else type(p).__name__,
            params=None if p is None else json.dumps(dataclasses.asdict(p), sort_keys=True),
            time_us=float(time_us), floor_us=floor_us,
            pct_of_floor=None if not floor_us else 100.0 * floor_us / time_us,
            default_time_us=default_time_us, baseline_time_us=baseline_time_us, baseline=baseline,
            timer=timer, trials=trials, versions=versions,
            tuned_at=tuned_at or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), spread_us=spread_us,
            estimated=estimated,
        )

    @property
    def bucket(self) -> tuple[int, int]:
        return (self.bucket_lo, self.bucket_hi)

    def schedule(self, block: MoEBlock) -> Schedule:
        """The stored winner as a Schedule; the params dataclass comes from the backend's ParamSpace.

        Raises CacheError when the backend no longer offers that kind, params class or fields."""
        where = f"entry {self.target}/{self.backend} {self.bucket}"
        try:
            params = None
            if self.params is not None:
                from ..codegen.backend import get

                space = get(self.backend).space(block, self.kind)
                ptype = space.params_type
                if ptype.__name__ != self.params_type:
                    raise CacheError(f"{where}: params class {self.params_type}, "
                                     f"backend now has {ptype.__name__}")
                values = json.loads(self.params)
                if not isinstance(values, dict):
                    raise CacheError(f"{where}: params {self.params[:60]!r} is not a JSON object")
                values = {k: _tuplify(v) for k, v in values.items()}
                params = ptype(**values)
            return Schedule(self.kind, row_threshold=self.row_threshold, backend=self.backend, params=params)
        except CacheError:
            raise
        except (MoetuneError, TypeError, ValueError, KeyError, ImportError) as e:
            raise CacheError(f"{where}: cannot rebuild its schedule ({type(e).__name__}: {e})") from e

    def row(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "versions"}
        d.update(dataclasses.asdict(self.versions))
        return d

    @classmethod
    def from_row(cls, row: dict) -> DispatchEntry:
        v = Versions(**{f.name: row[f.name] for f in dataclasses.fields(Versions)})
        names = {f.name for f in dataclasses.fields(cls)} - {"versions"}
        return cls(versions=v, **{n: row[n] for n in names})

    def describe(self) -> str:
        s = self.kind + (f"(R={self.row_threshold})" if self.row_threshold is not None else "")
        if self.params:
            s += " [" + ", ".join(f"{k}={v}" for k, v in json.loads(self.params).items()) + "]"
        return s + (" (estimate)" if self.estimated else "")


@dataclass(frozen=True)
class Lookup:
    """What a table holds for one (target, backend, block): usable entries, rejected ones with reasons, and
    the usable ones whose timing was measured with another version of the backend's library."""

    usable: tuple[tuple[int, int, Schedule], ...]
    rejected: tuple[tuple[DispatchEntry, str], ...]
    path: str
    retime: tuple[tuple[DispatchEntry, str], ...] = ()
    estimated: tuple[DispatchEntry, ...] = ()  # the usable entries whose times are cost-model estimates

    @property
    def measured(self) -> tuple[tuple[int, int, Schedule], ...]:
        """The usable entries that were measured (the estimates left out)."""
        est = {e.bucket for e in self.estimated}
        return tuple(u for u in self.usable if (u[0], u[1]) not in est)

    def warning(self) -> str | None:
        said = []
        for entries, what in ((self.rejected, "not used"), (self.retime, "used, to be re-timed")):
            if entries:
                parts = [f"[{e.bucket_lo},{e.bucket_hi}] {why}" for e, why in entries]
                noun = "entry" if len(parts) == 1 else "entries"
                said.append(f"{len(parts)} {noun} {what}: " + "; ".join(parts))
        if self.estimated:
            spans = ", ".join(f"[{e.bucket_lo},{e.bucket_hi}]" for e in self.estimated)
            noun = "entry" if len(self.estimated) == 1 else "entries"
            said.append(f"{len(self.estimated)} {noun} used as cost-model estimates, not measured (no measured "
                        f"entry covers them): {spans}")
        return f"dispatch table {self.path}: " + "; ".join(said) if said else None


def _precedence(entry: DispatchEntry, cond: str) -> str:
    """The upsert condition `cond` of `entry` over the stored row of its key, with what holds whatever the
    times: an estimate never replaces a measured row, a measured entry always replaces an estimate."""
    if entry.estimated:
        return f"{TABLE}.estimated = 1 AND ({cond})"
    return f"({cond}) OR {TABLE}.estimated = 1"


def _gives_way(old: DispatchEntry, entry: DispatchEntry, supersede: bool) -> bool:
    """Whether row `old` is split around the written `entry` (`DispatchTable._split_around`): a row of the same
    versions, or any with `supersede`; an estimate splits only estimates, a measured entry splits every estimate."""
    if entry.estimated and not old.estimated:
        return False
    return supersede or same_versions(old, entry) or (old.estimated and not entry.estimated)


def same_versions(a: DispatchEntry, b: DispatchEntry) -> bool:
    """Whether `a` and `b` were measured with the same kernels, backend version and device."""
    return all(getattr(a.versions, c) == getattr(b.versions, c) for c in _VERSION_COLUMNS)


def _rank(e: DispatchEntry) -> tuple:
    """The order writes give way in: an entry tuned later (then one of a higher bucket) wins, as in `lookup`."""
    return (e.tuned_at, e.bucket_lo, e.bucket_hi)


def _outside(e: DispatchEntry, lo: int, hi: int) -> list[DispatchEntry]:
    """What of `e` lies outside [lo, hi]: up to two entries, its schedule, timing and versions kept."""
    out = []
    if e.bucket_lo < lo:
        out.append(dataclasses.replace(e, bucket_hi=min(e.bucket_hi, lo - 1)))
    if e.bucket_hi > hi:
        out.append(dataclasses.replace(e, bucket_lo=max(e.bucket_lo, hi + 1)))
    return out


# -------------------------------------------------------------------------------------------- table


def _connect(path: Path, create: bool) -> sqlite3.Connection:
    """A connection to the file at `path`. A file whose folder takes no new files (a read-only file system, a
    folder without write permission) and that has no write-ahead log beside it is read as immutable: SQLite
    could not create its -shm file there, and no writer can change it (a write needs a -wal or -journal file in
    that folder); opened for writing, it is refused naming the folder."""
    if not create and not path.exists():
        raise CacheError(f"dispatch table {path}: no such file")
    if path.is_dir():
        raise CacheError(f"dispatch table {path}: is a folder, not a file")
    folder = next((p for p in path.parents if p.exists()), Path("."))
    frozen = not os.access(folder, os.W_OK)
    if create and frozen:
        raise CacheError(f"dispatch table {path}: cannot be written: {_no_writes(folder)}; nothing was written")
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        if frozen and not Path(f"{path}-wal").exists():
            conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True, timeout=60.0,
                                   isolation_level=None, check_same_thread=False)
        else:
            conn = sqlite3.connect(str(path), timeout=60.0, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 60000")
        return conn
    except (sqlite3.Error, OSError) as e:
        raise CacheError(f"dispatch table {path}: cannot open ({e})") from e


def _no_writes(folder: Path) -> str:
    """Why `folder` takes no new files."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only file system"
    except OSError:
        pass
    return f"no permission to write in {folder}"


def _write_failed(path: Path, e: sqlite3.Error) -> CacheError:
    """The one error of a write that SQLite refused: the file, what SQLite said, and that nothing of it was
    written (the transaction rolled back)."""
    name = getattr(e, "sqlite_errorname", "") or type(e).__name__
    cause = ("the disk is full; " if name == "SQLITE_FULL" else
             "the file is read-only; " if name.startswith("SQLITE_READONLY") else "")
    return CacheError(f"dispatch table {path}: write failed, nothing was written ({cause}{name}: {e})")


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
        self._conn = _connect(self.path, create)
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
        """Create `TABLE` and move the rows of a `V1` table into it (their fusion column dropped, a row
        `TABLE` already holds kept), in one transaction: a reader sees either table whole."""
        names = set(self.db.table_names())
        if TABLE in names and V1 not in names and not self._lacking(TABLE):
            return
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            names = set(self.db.table_names())  # another writer may have moved them meanwhile
            for name, want in ((TABLE, COLUMNS), (V1, V1_COLUMNS)):
                if name in names:
                    self._check_columns(name, want)
            self._conn.execute(_CREATE)
            for c in self._lacking(TABLE):
                self._conn.execute(f"ALTER TABLE [{TABLE}] ADD COLUMN [{c}] {_SQL_TYPES[COLUMNS[c]]}")
            if V1 in names:
                cols = ", ".join(c for c in COLUMNS if c not in ADDED)  # the added ones NULL
                self._conn.execute(f"INSERT OR IGNORE INTO {TABLE} ({cols}) SELECT {cols} FROM {V1}")
                self._conn.execute(f"DROP TABLE {V1}")
            self._conn.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        self._wrote = True

    def _rollback(self) -> None:
        """End the open transaction, if SQLite has not ended it itself (a failed COMMIT may or may not)."""
        if self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")

    def _lacking(self, name: str) -> tuple[str, ...]:
        """The columns of `ADDED` that table `name` does not have (a file written before they existed)."""
        have = {c.name for c in self.db[name].columns}
        return tuple(c for c in ADDED if c not in have)

    def _check_columns(self, name: str, want: dict[str, type]) -> None:
        """Table `name` has the columns `want` (those of `ADDED` may be missing: they read as NULL)."""
        have = {c.name: c.type.upper() for c in self.db[name].columns}
        want_sql = {c: _SQL_TYPES[t] for c, t in want.items() if c in have or c not in ADDED}
        if have != want_sql:
            diff = sorted(set(have.items()) ^ set(want_sql.items()))
            raise CacheError(f"dispatch table {self.path}: table {name} has other columns than expected: "
                             f"{diff}")

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
        self._check_columns(self.source, COLUMNS if self.source == TABLE else V1_COLUMNS)

    def _writable(self) -> None:
        """Before a write: the file holds `TABLE` with every column (a file opened with create=False may
        hold `V1` only, or a `TABLE` lacking the columns of `ADDED`)."""
        if getattr(self, "source", None) == TABLE and not self._lacking(TABLE):
            return
        try:
            self._setup()
        except sqlite3.Error as e:
            raise _write_failed(self.path, e) from e
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
            for e in sorted(self.entries(), key=_rank):  # oldest first: each row splits the older ones
                if self.get(e.target, e.backend, e.signature, e.bucket_lo, e.bucket_hi) != e:
                    continue
                n += self._split_around(e, lambda old, e=e: same_versions(old, e) and _rank(old) < _rank(e)
                                        and _gives_way(old, e, False))
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
                self._rollback()
                raise
        except sqlite3.Error as e:
            raise _write_failed(self.path, e) from e
        self._wrote = True

    def _write(self, entry: DispatchEntry, replace_stale: bool, replace: bool, supersede: bool,
               split: Callable[[DispatchEntry], bool] | None = None) -> bool:
        """Inside a transaction: the upsert of `put_all`, then the split of what it overlaps."""
        cond = "1" if replace else f"excluded.time_us < {TABLE}.time_us"
        if replace_stale and not replace:
            cond += "".join(f" OR excluded.{c} IS NOT {TABLE}.{c}" for c in _VERSION_COLUMNS)
        if self._upsert(entry, _precedence(entry, cond)) == 0:
            return False
        self._split_around(entry, lambda old: _gives_way(old, entry, supersede or (split is not None and split(old))))
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
        of it lies outside the entry (`_outside`: none, one or two rows, every field but the bucket kept).
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
            for part in _outside(old, entry.bucket_lo, entry.bucket_hi):
                self._upsert(part, _precedence(part, f"excluded.tuned_at > {TABLE}.tuned_at"))
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
        lacking = self._lacking(self.source)
        cols = ", ".join(f"NULL AS {c}" if c in lacking else c for c in COLUMNS)
        sql = (f"SELECT {cols} FROM {self.source}" + (f" WHERE {' AND '.join(where)}" if where else "")
               + " ORDER BY target, backend, signature, bucket_lo")
        try:
            return [DispatchEntry.from_row(self._typed(r)) for r in self.db.query(sql, args)]
        except (sqlite3.Error, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CacheError(f"dispatch table {self.path}: unreadable rows ({type(e).__name__}: {e})") from e

    def _typed(self, row: dict) -> dict:
        """`row` with each value of its column's type (an integer where a real is stored); SQLite keeps what a
        foreign writer put in a typed column, so a value of another type is a corrupt row, named."""
        for c, want in COLUMNS.items():
            v = row[c]
            if v is None and c not in NOT_NULL:
                continue
            if want is float and type(v) is int:
                row[c] = float(v)
            elif type(v) is not want:
                key = ", ".join(f"{k}={row[k]!r}" for k in PK)
                raise CacheError(f"dispatch table {self.path}: corrupt row ({key}): column {c} holds "
                                 f"{v!r:.60}, expected {_SQL_TYPES[want]}")
        return row

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
