"""How a written row and the rows it overlaps share the token counts: which row gives way to a write, in what
order, and what of it stays (the rules `moetune.runtime.table.DispatchTable` writes by; module doc there)."""

from __future__ import annotations

import dataclasses

from .entry import DispatchEntry
from .schema import TABLE, VERSION_COLUMNS


def precedence(entry: DispatchEntry, cond: str) -> str:
    """The upsert condition `cond` of `entry` over the stored row of its key, with what holds whatever the
    times: an estimate never replaces a measured row, a measured entry always replaces an estimate."""
    if entry.estimated:
        return f"{TABLE}.estimated = 1 AND ({cond})"
    return f"({cond}) OR {TABLE}.estimated = 1"


def gives_way(old: DispatchEntry, entry: DispatchEntry, supersede: bool) -> bool:
    """Whether row `old` is split around the written `entry` (`DispatchTable._split_around`): a row of the same
    versions, or any with `supersede`; an estimate splits only estimates, a measured entry splits every estimate."""
    if entry.estimated and not old.estimated:
        return False
    return supersede or same_versions(old, entry) or (old.estimated and not entry.estimated)


def same_versions(a: DispatchEntry, b: DispatchEntry) -> bool:
    """Whether `a` and `b` were measured with the same kernels, backend version and device."""
    return all(getattr(a.versions, c) == getattr(b.versions, c) for c in VERSION_COLUMNS)


def rank(e: DispatchEntry) -> tuple:
    """The order writes give way in: an entry tuned later (then one of a higher bucket) wins, as in `lookup`."""
    return (e.tuned_at, e.bucket_lo, e.bucket_hi)


def outside(e: DispatchEntry, lo: int, hi: int) -> list[DispatchEntry]:
    """What of `e` lies outside [lo, hi]: up to two entries, its schedule, timing and versions kept."""
    out = []
    if e.bucket_lo < lo:
        out.append(dataclasses.replace(e, bucket_hi=min(e.bucket_hi, lo - 1)))
    if e.bucket_hi > hi:
        out.append(dataclasses.replace(e, bucket_lo=max(e.bucket_lo, hi + 1)))
    return out
