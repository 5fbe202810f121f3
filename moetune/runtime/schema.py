"""The dispatch table's file format: its columns and keys, the earlier version it reads and moves, and how a file
is opened. `moetune.runtime.table.DispatchTable` is the one reader and writer of these files.

    TABLE      dispatch_v2, typed columns `COLUMNS`, primary key `PK`; the columns of `ADDED` came later and read
               as NULL in a file that lacks them, which gains them when opened for writing
    V1         dispatch_v1: `V1_COLUMNS` (no column of ADDED, and a `fusion` one no kernel reads); read as it is,
               moved to TABLE in one transaction when opened for writing (`create`)
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

from ..ir import CacheError

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
VERSION_COLUMNS = ("kernel_hash", "backend_version", "device", "capability")
SQL_TYPES = {str: "TEXT", int: "INTEGER", float: "REAL"}
CREATE = (f"CREATE TABLE IF NOT EXISTS [{TABLE}] ("
           + ", ".join(f"[{c}] {SQL_TYPES[t]}{' NOT NULL' if c in NOT_NULL else ''}" for c, t in COLUMNS.items())
           + f", PRIMARY KEY ({', '.join(f'[{c}]' for c in PK)}))")


def lacking(db, name: str) -> tuple[str, ...]:
    """The columns of `ADDED` that table `name` of `db` (a sqlite_utils.Database) does not have (a file written
    before they existed)."""
    have = {c.name for c in db[name].columns}
    return tuple(c for c in ADDED if c not in have)


def check_columns(db, path: Path, name: str, want: dict[str, type]) -> None:
    """Table `name` has the columns `want` (those of `ADDED` may be missing: they read as NULL)."""
    have = {c.name: c.type.upper() for c in db[name].columns}
    want_sql = {c: SQL_TYPES[t] for c, t in want.items() if c in have or c not in ADDED}
    if have != want_sql:
        diff = sorted(set(have.items()) ^ set(want_sql.items()))
        raise CacheError(f"dispatch table {path}: table {name} has other columns than expected: {diff}")


def create(conn: sqlite3.Connection, db, path: Path) -> bool:
    """Create `TABLE` (and the columns of `ADDED` it lacks) and move the rows of a `V1` table into it (their fusion
    column dropped, a row `TABLE` already holds kept), in one transaction: a reader sees either table whole.
    Whether anything was written."""
    names = set(db.table_names())
    if TABLE in names and V1 not in names and not lacking(db, TABLE):
        return False
    conn.execute("BEGIN IMMEDIATE")
    try:
        names = set(db.table_names())  # another writer may have moved them meanwhile
        for name, want in ((TABLE, COLUMNS), (V1, V1_COLUMNS)):
            if name in names:
                check_columns(db, path, name, want)
        conn.execute(CREATE)
        for c in lacking(db, TABLE):
            conn.execute(f"ALTER TABLE [{TABLE}] ADD COLUMN [{c}] {SQL_TYPES[COLUMNS[c]]}")
        if V1 in names:
            cols = ", ".join(c for c in COLUMNS if c not in ADDED)  # the added ones NULL
            conn.execute(f"INSERT OR IGNORE INTO {TABLE} ({cols}) SELECT {cols} FROM {V1}")
            conn.execute(f"DROP TABLE {V1}")
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return True


def rollback(conn: sqlite3.Connection) -> None:
    """End the open transaction, if SQLite has not ended it itself (a failed COMMIT may or may not)."""
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def typed(path: Path, row: dict) -> dict:
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
            raise CacheError(f"dispatch table {path}: corrupt row ({key}): column {c} holds "
                             f"{v!r:.60}, expected {SQL_TYPES[want]}")
    return row


def connect(path: Path, create: bool) -> sqlite3.Connection:
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
        raise CacheError(f"dispatch table {path}: cannot be written: {no_writes(folder)}; nothing was written")
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


def no_writes(folder: Path) -> str:
    """Why `folder` takes no new files."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only file system"
    except OSError:
        pass
    return f"no permission to write in {folder}"


def write_failed(path: Path, e: sqlite3.Error) -> CacheError:
    """The one error of a write that SQLite refused: the file, what SQLite said, and that nothing of it was
    written (the transaction rolled back)."""
    name = getattr(e, "sqlite_errorname", "") or type(e).__name__
    cause = ("the disk is full; " if name == "SQLITE_FULL" else
             "the file is read-only; " if name.startswith("SQLITE_READONLY") else "")
    return CacheError(f"dispatch table {path}: write failed, nothing was written ({cause}{name}: {e})")
