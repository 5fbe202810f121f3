"""The dispatch table: tuned winners per (target, backend, block signature, token bucket), in SQLite.

One versioned table, `dispatch_v1`, with typed columns (sqlite-utils), in WAL mode:

    key     target, backend, signature (MoEBlock.signature_hash()), bucket_lo, bucket_hi
    winner  kind, row_threshold, params_type, params (JSON), fusion (JSON)
    timing  time_us, floor_us, pct_of_floor, default_time_us, baseline_time_us, baseline, timer, trials
    context signature_text, moetune, kernel_hash, backend_version, torch, device, capability, tuned_at

An entry is replaced only by a faster one (`put`), or by any new one when the stored entry was measured
with another kernel source, backend version or device (it no longer says anything about this code), or
when the tuner that writes it measured the stored winner itself, on the same cases, and chose against it
(`put(..., replace=True)`: its choice also weighs the bucket's edges, so its time may be the higher).
Several tuners may write one file at once: each `put` is one atomic statement and waits for the lock.

This module is what a deployment reads: it imports neither the search nor Optuna.

    table = DispatchTable("cache/cpu-tiny.sqlite")
    found = table.lookup(block, target="cpu", backend="torch")     # usable + rejected (with reasons)
    entries = load_entries(path, block, "cpu", "torch")             # [(lo, hi, Schedule)], warns once
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import hashlib
import json
import os
import platform
import re
import sqlite3
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..ir import SCHEDULE_KINDS, CacheError, Fusion, MoEBlock, MoetuneError, Schedule

TABLE = "dispatch_v1"
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
    "fusion": str,
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
}
NOT_NULL = set(PK) | {"signature_text", "kind", "fusion", "time_us", "kernel_hash", "backend_version",
                      "device", "capability", "tuned_at"}
_VERSION_COLUMNS = ("kernel_hash", "backend_version", "device", "capability")
_SQL_TYPES = {str: "TEXT", int: "INTEGER", float: "REAL"}


class CacheWarning(UserWarning):
    """A dispatch table (or some of its entries) could not be used; the model falls back to defaults."""


# ----------------------------------------------------------------------------------------- versions


@dataclass(frozen=True)
class Versions:
    """What a measurement depends on besides the block: code, libraries and the device."""

    moetune: str
    kernel_hash: str  # sha256 of the backend's kernel sources, per schedule kind (`folder_hash`)
    backend_version: str  # triton / jax version; torch's for the torch backend
    torch: str
    device: str  # "NVIDIA H200", "cpu: AMD EPYC 7B13", ...
    capability: str  # "sm_90", "x86_64", ...

    @classmethod
    def current(cls, backend: str, device: str = "cpu") -> Versions:
        import torch

        from .. import __version__

        name, cap = device_identity(device)
        return cls(__version__, kernel_source_hash(backend), backend_version(backend), torch.__version__,
                   name, cap)


_BACKEND_PACKAGES = {"torch": "torch", "triton": "triton", "pallas": "pallas"}


@functools.cache
def kernel_source_hash(backend: str) -> str:
    """The hash of the backend's kernel sources that a tuned timing depends on (see `folder_hash`):
    a changed kernel makes its old timings stale."""
    codegen = Path(__file__).resolve().parent.parent / "codegen"
    folder = codegen / _BACKEND_PACKAGES.get(backend, backend)
    if not folder.is_dir():  # a backend registered from elsewhere: the folder of its module
        import sys

        from ..codegen.backend import get

        try:
            folder = Path(sys.modules[type(get(backend)).__module__].__file__).resolve().parent
        except (MoetuneError, KeyError, TypeError) as e:
            raise CacheError(f"backend {backend!r}: no kernel sources found ({e})") from e
    return folder_hash(folder, [codegen / "common.py"])


def folder_hash(folder: Path, shared: Iterable[Path] = ()) -> str:
    """sha256[:16] of a backend folder's *.py files and `shared`, per schedule kind where the backend
    keeps a kind in a file of its own (`<kind>.py`): "grouped_gemm=…;hybrid=…;stream_gemv=…". A kind's
    part covers every file except the other kinds' own files (unless its file imports one), so editing
    one kind's kernel leaves the tuned entries of the other kinds current. Without such files: one hash."""
    files = sorted({*folder.rglob("*.py"), *shared})

    def digest(fs) -> str:
        h = hashlib.sha256()
        for f in fs:
            h.update(f.name.encode())
            h.update(f.read_bytes())
        return h.hexdigest()[:16]

    own = {f.stem: f for f in files if f.parent == folder and f.stem in SCHEDULE_KINDS}
    if not own:
        return digest(files)
    parts = []
    for kind, f in sorted(own.items()):
        text = f.read_text()
        uses = {k for k in own if re.search(rf"from \.{k}\b|from \. import [^\n]*\b{k}\b", text)}
        parts.append(f"{kind}={digest(g for g in files if g not in own.values() or g.stem in uses | {kind})}")
    return ";".join(parts)


def kernel_hash_part(kernel_hash: str, kind: str) -> str:
    """What an entry of schedule `kind` depends on in a kernel hash: its kind's part of a per-kind hash,
    else the whole hash (an older one-part hash)."""
    for part in kernel_hash.split(";"):
        k, sep, h = part.partition("=")
        if sep and k == kind:
            return h
    return kernel_hash


def backend_version(backend: str) -> str:
    """The version of the library that compiles the backend's kernels ("none" where it is absent)."""
    lib = {"torch": "torch", "triton": "triton", "pallas": "jax"}.get(backend, backend)
    try:
        mod = __import__(lib)
    except ImportError:
        return "none"
    return f"{lib} {mod.__version__}"


@functools.cache
def device_identity(device: str = "cpu") -> tuple[str, str]:
    """(device name, compute capability) of "cpu", "cuda[:i]" or "tpu"."""
    if device.startswith("cuda"):
        import torch

        idx = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        return torch.cuda.get_device_name(idx), f"sm_{major}{minor}"
    if device.startswith("tpu"):
        import jax

        d = jax.devices()[0]
        return d.device_kind, d.platform
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {name}", platform.machine()


def judge(entry: DispatchEntry, current: Versions) -> str | None:
    """Why `entry` must not be used here ("foreign: …" / "stale: …"), or None when it is sound."""
    v = entry.versions
    if (v.device, v.capability) != (current.device, current.capability):
        return (f"foreign: tuned on {v.device} ({v.capability}), "
                f"this is {current.device} ({current.capability})")
    was, now = kernel_hash_part(v.kernel_hash, entry.kind), kernel_hash_part(current.kernel_hash, entry.kind)
    if was != now:
        return f"stale: {entry.kind} kernel sources {was} changed to {now}"
    if v.backend_version != current.backend_version:
        return f"stale: tuned with {v.backend_version}, this is {current.backend_version}"
    return None


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
    fusion: str  # JSON object of Fusion's fields
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

    @classmethod
    def of(
        cls, *, target: str, block: MoEBlock, bucket: tuple[int, int], schedule: Schedule, time_us: float,
        versions: Versions, floor_us: float | None = None, default_time_us: float | None = None,
        baseline_time_us: float | None = None, baseline: str | None = None, timer: str | None = None,
        trials: int | None = None, tuned_at: str | None = None,
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
            fusion=json.dumps(dataclasses.asdict(schedule.fusion), sort_keys=True),
            time_us=float(time_us), floor_us=floor_us,
            pct_of_floor=None if not floor_us else 100.0 * floor_us / time_us,
            default_time_us=default_time_us, baseline_time_us=baseline_time_us, baseline=baseline,
            timer=timer, trials=trials, versions=versions,
            tuned_at=tuned_at or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
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
                values = {k: _tuplify(v) for k, v in json.loads(self.params).items()}
                params = ptype(**values)
            fusion = Fusion(**json.loads(self.fusion))
            return Schedule(self.kind, row_threshold=self.row_threshold, fusion=fusion, backend=self.backend,
                            params=params)
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
        return s


@dataclass(frozen=True)
class Lookup:
    """What a table holds for one (target, backend, block): usable entries and rejected ones with reasons."""

    usable: tuple[tuple[int, int, Schedule], ...]
    rejected: tuple[tuple[DispatchEntry, str], ...]
    path: str

    def warning(self) -> str | None:
        if not self.rejected:
            return None
        parts = [f"[{e.bucket_lo},{e.bucket_hi}] {why}" for e, why in self.rejected]
        noun = "entry" if len(parts) == 1 else "entries"
        return f"dispatch table {self.path}: {len(parts)} {noun} not used: " + "; ".join(parts)


# -------------------------------------------------------------------------------------------- table


def _connect(path: Path, create: bool) -> sqlite3.Connection:
    if not create and not path.exists():
        raise CacheError(f"dispatch table {path}: no such file")
    if path.is_dir():
        raise CacheError(f"dispatch table {path}: is a folder, not a file")
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), timeout=60.0, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 60000")
        return conn
    except (sqlite3.Error, OSError) as e:
        raise CacheError(f"dispatch table {path}: cannot open ({e})") from e


class DispatchTable:
    """One dispatch-table file. `create=False` opens an existing file only (the runtime's way)."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True):
        import sqlite_utils

        self.path = Path(path)
        self._conn = _connect(self.path, create)
        try:
            self.db = sqlite_utils.Database(self._conn)
            status = self._conn.execute("PRAGMA quick_check").fetchone()[0]
            if status != "ok":
                raise CacheError(f"dispatch table {self.path}: corrupt ({status})")
            if create:
                self._setup()
            self._check_schema()
        except CacheError:
            self._conn.close()
            raise
        except sqlite3.Error as e:
            self._conn.close()
            raise CacheError(f"dispatch table {self.path}: not a readable SQLite file ({e})") from e

    def _setup(self, wait_s: float = 60.0) -> None:
        """WAL mode and the table. Switching the journal mode may answer "locked" at once, without
        waiting (another tuner is creating the same file): retry until `wait_s` is spent."""
        import time

        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.db.enable_wal()
                self.db[TABLE].create(dict(COLUMNS), pk=PK, not_null=NOT_NULL, if_not_exists=True)
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _check_schema(self) -> None:
        if TABLE not in self.db.table_names():
            others = [t for t in self.db.table_names() if t.startswith("dispatch_")]
            self.foreign_version = others[0] if others else None
            return
        self.foreign_version = None
        have = {c.name: c.type.upper() for c in self.db[TABLE].columns}
        want = {c: _SQL_TYPES[t] for c, t in COLUMNS.items()}
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))
            raise CacheError(f"dispatch table {self.path}: table {TABLE} has other columns than expected: "
                             f"{diff}")

    # context management
    def close(self) -> None:
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
            supersede: bool = False) -> bool:
        """Insert, or replace the stored entry of the same key when `entry` is faster (or, with
        `replace_stale`, when the stored one was measured with other kernels, libraries or device; with
        `replace`, always). With `supersede`, a written entry also deletes the entries of other buckets of
        its (target, backend, block) that overlap it (a bucket re-tuned whole, or split in parts: the
        lookup would reject those older rows anyway). Returns whether the row was written."""
        row = entry.row()
        cols = list(COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in cols if c not in PK)
        cond = "1" if replace else f"excluded.time_us < {TABLE}.time_us"
        if replace_stale:
            cond += "".join(f" OR excluded.{c} IS NOT {TABLE}.{c}" for c in _VERSION_COLUMNS)
        sql = (f"INSERT INTO {TABLE} ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)}) "
               f"ON CONFLICT ({', '.join(PK)}) DO UPDATE SET {updates} WHERE {cond}")
        try:
            cur = self.db.execute(sql, [row[c] for c in cols])
        except sqlite3.Error as e:
            raise CacheError(f"dispatch table {self.path}: write failed ({e})") from e
        if cur.rowcount > 0 and supersede:
            try:
                self.db.execute(
                    f"DELETE FROM {TABLE} WHERE target = ? AND backend = ? AND signature = ? AND bucket_lo <= ? "
                    "AND bucket_hi >= ? AND NOT (bucket_lo = ? AND bucket_hi = ?)",
                    [entry.target, entry.backend, entry.signature, entry.bucket_hi, entry.bucket_lo,
                     entry.bucket_lo, entry.bucket_hi])
            except sqlite3.Error as e:
                raise CacheError(f"dispatch table {self.path}: write failed ({e})") from e
        if cur.rowcount > 0:
            self._checkpoint()
        return cur.rowcount > 0

    def prune_overlapped(self) -> int:
        """Delete the rows no lookup can use: those overlapping a newer row of their (target, backend,
        block) measured with the same kernels, backend version and device (where the older one is usable,
        the newer one is too, and the lookup keeps the newer). Returns how many rows went."""
        groups: dict[tuple, list[DispatchEntry]] = {}
        for e in self.entries():
            groups.setdefault((e.target, e.backend, e.signature), []).append(e)
        gone = []
        for es in groups.values():
            kept: list[DispatchEntry] = []
            for e in sorted(es, key=lambda e: (e.tuned_at, e.bucket_lo), reverse=True):  # as `lookup` ranks them
                same = [k for k in kept
                        if all(getattr(k.versions, c) == getattr(e.versions, c) for c in _VERSION_COLUMNS)]
                if any(k.bucket_lo <= e.bucket_hi and e.bucket_lo <= k.bucket_hi for k in same):
                    gone.append(e)
                else:
                    kept.append(e)
        try:
            for e in gone:
                self.db.execute(f"DELETE FROM {TABLE} WHERE {' AND '.join(f'{c} = ?' for c in PK)}",
                                [e.target, e.backend, e.signature, e.bucket_lo, e.bucket_hi])
        except sqlite3.Error as err:
            raise CacheError(f"dispatch table {self.path}: write failed ({err})") from err
        if gone:
            self._checkpoint()
        return len(gone)

    # reading
    def entries(self, target: str | None = None, backend: str | None = None,
                signature: str | None = None) -> list[DispatchEntry]:
        if TABLE not in self.db.table_names():
            return []
        where, args = [], []
        for col, val in (("target", target), ("backend", backend), ("signature", signature)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        sql = f"SELECT * FROM {TABLE}" + (f" WHERE {' AND '.join(where)}" if where else "") + \
            " ORDER BY target, backend, signature, bucket_lo"
        try:
            return [DispatchEntry.from_row(r) for r in self.db.query(sql, args)]
        except (sqlite3.Error, KeyError, TypeError) as e:
            raise CacheError(f"dispatch table {self.path}: unreadable rows ({e})") from e

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
        not (foreign device, stale kernel or backend version, unbuildable schedule) with the reason."""
        current = versions or Versions.current(backend, device)
        usable, rejected = [], []
        # Tuning runs over different token ranges bucket differently: where entries overlap, the most
        # recently tuned one is kept (a schedule is never borrowed across buckets).
        newest_first = sorted(self.entries(target, backend, block.signature_hash()),
                              key=lambda e: (e.tuned_at, e.bucket_lo), reverse=True)
        for e in newest_first:
            why = judge(e, current)
            clash = next(((lo, hi) for lo, hi, _ in usable if lo <= e.bucket_hi and e.bucket_lo <= hi), None)
            if why is None and clash is not None:
                why = f"overlaps [{clash[0]},{clash[1]}], which was tuned later"
            if why is None:
                try:
                    usable.append((e.bucket_lo, e.bucket_hi, e.schedule(block)))
                    continue
                except CacheError as err:
                    why = f"stale: {err}"
            rejected.append((e, why))
        usable.sort(key=lambda u: u[0])
        rejected.sort(key=lambda r: r[0].bucket_lo)
        return Lookup(tuple(usable), tuple(rejected), str(self.path))


def load_entries(path: str | os.PathLike, block: MoEBlock, target: str, backend: str, *,
                 versions: Versions | None = None, device: str = "cpu",
                 notes: list[str] | None = None) -> list[tuple[int, int, Schedule]]:
    """The runtime's call: usable (lo, hi, Schedule) of `block` in the file at `path`.

    A missing file gives no entries; foreign or stale entries are left out; either is said in one
    CacheWarning, or appended to `notes` when the caller folds it into a warning of its own (the
    compiled model gives one warning per block). A corrupt or unreadable file raises CacheError
    naming it."""
    def say(msg: str) -> None:
        if notes is None:
            warnings.warn(msg, CacheWarning, stacklevel=3)
        else:
            notes.append(msg)

    p = Path(path)
    if not p.exists():
        say(f"dispatch table {p}: no such file; every bucket uses the default schedule")
        return []
    with DispatchTable(p, create=False) as table:
        if table.foreign_version:
            say(f"dispatch table {p}: holds {table.foreign_version}, this moetune reads {TABLE}; not used")
            return []
        found = table.lookup(block, target, backend, versions=versions, device=device)
    msg = found.warning()
    if msg:
        say(msg)
    return list(found.usable)


def merge(inputs: Iterable[str | os.PathLike], output: str | os.PathLike) -> tuple[int, int, int]:
    """Merge tables into `output`, keeping the faster entry of each key, then dropping the rows a newer
    overlapping one of the same versions makes unusable (a bucket split in one table, whole in the other:
    `DispatchTable.prune_overlapped`); (rows read, rows written, rows dropped)."""
    read = written = 0
    with DispatchTable(output) as out:
        for src in inputs:
            with DispatchTable(src, create=False) as t:
                for e in t.entries():
                    read += 1
                    written += out.put(e, replace_stale=False)
        dropped = out.prune_overlapped()
    return read, written, dropped

