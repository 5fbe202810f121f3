"""Merging dispatch tables: `merge(inputs, output)`, every token count any input covered still covered.

Written to a file beside `output` and renamed over it once complete, so a failed merge leaves `output` as
it was; the counts it returns are taken from the file it wrote.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from .table import PK, DispatchEntry, DispatchTable, _rank


class Merged(NamedTuple):
    """What a merge read and what the file it wrote holds (counted from that file)."""

    read: int  # rows read from the inputs
    held: int  # rows the output file held before, merged with them
    rows: int  # rows the output file holds now
    trimmed: int  # rows read or held of which the output keeps a part: split around newer entries
    replaced: int  # rows read or held of which it keeps nothing: a faster entry of their bucket, or newer ones over it


def merge(inputs: Iterable[str | os.PathLike], output: str | os.PathLike) -> Merged:
    """Merge tables into `output` (with the rows it already holds): the faster entry of each key (a measured
    one over a cost-model estimate, whatever their times: `DispatchTable.put_all`'s precedence), written
    oldest first, so that where entries of the same versions overlap the newer one splits the older
    (`DispatchTable.put_all`): every token count any of them covered stays covered, by the newest entry
    covering it. The result is written to a file beside `output` and renamed over it once complete: a
    merge that fails (an unreadable input) leaves `output` as it was."""
    output = Path(output)
    held = _rows_of(output) if output.exists() else []
    read = [e for src in inputs for e in _rows_of(src)]
    best: dict[tuple, DispatchEntry] = {}
    for e in held + read:  # a measured entry over an estimate, then the time (a tie keeps the first)
        k = tuple(getattr(e, c) for c in PK)
        if k not in best or (e.estimated, e.time_us) < (best[k].estimated, best[k].time_us):
            best[k] = e
    part = output.with_name(f".{output.name}.merging-{os.getpid()}")
    try:
        with DispatchTable(part) as out:
            out.db.execute("PRAGMA synchronous = OFF")  # a file no one reads yet: synced once, below
            out.put_all(sorted(best.values(), key=_rank), replace=True)  # a key met again is a remainder's
        _fsync(part)
        os.replace(part, output)
        _fsync(output.parent)
    finally:
        for side in ("", "-wal", "-shm"):
            Path(f"{part}{side}").unlink(missing_ok=True)
    now = _rows_of(output)
    trimmed, replaced = _fates(held + read, now)
    return Merged(len(read), len(held), len(now), trimmed, replaced)


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
