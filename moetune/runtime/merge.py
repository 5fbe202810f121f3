"""Merging dispatch tables: `merge(inputs, output)`, every token count any input covered still covered.

Written to a file beside `output` and renamed over it once complete, so a failed merge leaves `output` as
it was; the counts it returns are taken from the file it wrote.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from ..ir.errors import CacheError
from .coverage import rank
from .entry import DispatchEntry
from .schema import PK
from .table import DispatchTable
from .versions import kernel_source_hash, stale_on


class Merged(NamedTuple):
    """What a merge read and what the file it wrote holds (counted from that file)."""

    read: int  # rows read from the inputs
    held: int  # rows the output file held before, merged with them
    rows: int  # rows the output file holds now
    trimmed: int  # rows read or held of which the output keeps a part: split around newer entries
    replaced: int  # rows read or held of which it keeps nothing: a faster entry of their bucket, or newer ones over it


def merge(inputs: Iterable[str | os.PathLike], output: str | os.PathLike) -> Merged:
    """Merge tables into `output` (with the rows it already holds): the faster entry of each key (a measured
    one over a cost-model estimate, and one timed on this tree's kernel sources over a stale one, whatever
    their times), written oldest first, so that where entries of the same versions overlap the newer one
    splits the older (`DispatchTable.put_all`), and the current entries after the stale ones, each splitting
    the stale rows it overlaps: every token count any of them covered stays covered, by the newest entry
    covering it, and by a current one wherever one covers it. The result is written to a file beside
    `output` and renamed over it once complete: a merge that fails (an unreadable input) leaves `output` as
    it was."""
    output = Path(output)
    held = _rows_of(output) if output.exists() else []
    read = [e for src in inputs for e in _rows_of(src)]
    stale = _stale_here(held + read)

    def precedence(e: DispatchEntry) -> tuple:  # measured, then current, then faster (a tie keeps the first)
        return e.estimated, stale(e), e.time_us

    best: dict[tuple, DispatchEntry] = {}
    for e in held + read:
        k = tuple(getattr(e, c) for c in PK)
        if k not in best or precedence(e) < precedence(best[k]):
            best[k] = e
    old = sorted((e for e in best.values() if stale(e)), key=rank)
    current = sorted((e for e in best.values() if not stale(e)), key=rank)
    part = output.with_name(f".{output.name}.merging-{os.getpid()}")
    try:
        with DispatchTable(part) as out:
            out.db.execute("PRAGMA synchronous = OFF")  # a file no one reads yet: synced once, below
            out.put_all(old, replace=True)  # a key met again is a remainder's
            out.put_all(current, replace=True, split=stale)  # each splits the stale rows it overlaps
        _fsync(part)
        os.replace(part, output)
        _fsync(output.parent)
    finally:
        for side in ("", "-wal", "-shm"):
            Path(f"{part}{side}").unlink(missing_ok=True)
    now = _rows_of(output)
    trimmed, replaced = _fates(held + read, now)
    return Merged(len(read), len(held), len(now), trimmed, replaced)


def _stale_here(entries: list[DispatchEntry]) -> Callable[[DispatchEntry], bool]:
    """Whether an entry was timed on other kernel sources than this tree's (`versions.stale_on`): such a row
    serves no lookup here, so it never wins a key over a current one, and a current row overlapping it splits
    it. A backend whose sources cannot be read here judges nothing stale."""
    def source_hash(backend: str) -> str | None:
        try:
            return kernel_source_hash(backend)
        except CacheError:
            return None

    now = {b: source_hash(b) for b in {e.backend for e in entries}}
    return lambda e: now[e.backend] is not None and stale_on(e, now[e.backend])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rows_of(path: str | os.PathLike) -> list[DispatchEntry]:
    with DispatchTable(path, create=False) as t:
        return t.entries()


def _fates(before: list[DispatchEntry], after: list[DispatchEntry]) -> tuple[int, int]:
    """Of the distinct rows `before`: how many `after` keeps a part of only (its rows of the same fields
    but the bucket, inside it), and how many it keeps nothing of."""
    def fields(e: DispatchEntry) -> tuple:
        return tuple(v for c, v in e.row().items() if c not in ("bucket_lo", "bucket_hi"))

    whole = {tuple(e.row().values()) for e in after}
    buckets: dict[tuple, list[tuple[int, int]]] = {}
    for e in after:
        buckets.setdefault(fields(e), []).append(e.bucket)
    trimmed = replaced = 0
    for e in {tuple(e.row().values()): e for e in before}.values():
        if tuple(e.row().values()) in whole:
            continue
        if any(e.bucket_lo <= lo and hi <= e.bucket_hi for lo, hi in buckets.get(fields(e), ())):
            trimmed += 1
        else:
            replaced += 1
    return trimmed, replaced
