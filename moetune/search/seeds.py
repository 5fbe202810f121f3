"""Where a bucket's study starts and how it walks: the heuristic defaults, the table's earlier winners of
this bucket and its neighbours (`seeds`), a local search from each new incumbent (`climb`), and random
untried points when TPE keeps proposing scored ones (`Untried`)."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from ..codegen.backend import Backend
from ..ir import Bucket, CacheError, MoEBlock, MoetuneError, Schedule, UnsupportedSchedule
from ..passes.policy import hybrid_threshold, rows_per_active
from ..runtime.default import default_for
from ..runtime.entry import DispatchEntry
from ..runtime.table import DispatchTable
from .objective import Outcome
from .options import BucketResult
from .space import SearchSpace, key
from .study import Study


def default_schedules(block: MoEBlock, backend: Backend, space: SearchSpace, tokens: int,
                      first: Schedule | None = None) -> list[Schedule]:
    """The backend's heuristic schedule of every kind in the space (those inside it), `first` first. A
    hybrid default takes the policy's threshold among the ones the hybrid rule kept in this bucket."""
    out = [first] if first is not None and space.contains(first) else []
    for ks in space.kinds:
        try:
            s = backend.default(block, ks.kind, tokens)
        except UnsupportedSchedule:
            continue
        if ks.row_thresholds and s.row_threshold is not None and s.row_threshold not in ks.row_thresholds:
            R = hybrid_threshold(rows_per_active(block, tokens), ks.row_thresholds)
            s = dataclasses.replace(s, row_threshold=R)
        for q in [s, *quantized_variants(s, ks)]:
            for v in [q, *launch_twins(q)]:
                if space.contains(v) and v not in out:
                    out.append(v)
    return out


LAUNCH_KNOBS = ("pdl",)  # parameters that change how a schedule's kernels are launched, never what they compute


def launch_twins(s: Schedule) -> list[Schedule]:
    """`s` with each launch knob its parameters have flipped (a chain of programmatic launches in place of
    plain ones, or back): the same kernels, whose launch gaps only a timing tells apart, so each default and
    each stored winner is timed beside its twin. Twins the parameters refuse are left out; the caller keeps
    those inside its space."""
    out = []
    for knob in LAUNCH_KNOBS:
        if s.params is None or not isinstance(getattr(s.params, knob, None), bool):
            continue
        try:
            out.append(dataclasses.replace(s, params=dataclasses.replace(s.params, **{knob: not getattr(s.params,
                                                                                                        knob)})))
        except UnsupportedSchedule:
            continue
    return out


def quantized_variants(s: Schedule, ks) -> list[Schedule]:
    """`s` with each other activation quantisation its kind's space offers (the w8a8 default's weight-only twin,
    a weight-only default's w8a8 one): where a study of FP8 weights starts on that side."""
    if s.params is None or not hasattr(s.params, "act_quant"):
        return []
    offered = dict(ks.params.choices).get("act_quant", ())
    out = []
    for q in offered:
        if q == s.params.act_quant:
            continue
        try:
            out.append(dataclasses.replace(s, params=ks.params.admit(dataclasses.replace(s.params, act_quant=q))))
        except UnsupportedSchedule:
            continue
    return out


def runtime_default(block: MoEBlock, backend: Backend, target: str, bucket: Bucket) -> Schedule | None:
    """What a compiled model on `target` runs in `bucket` with no table entry (moetune.runtime.default)."""
    try:
        return default_for(block, backend, target, bucket.lo, bucket.hi)
    except MoetuneError:
        return None


def seeds(block: MoEBlock, table: DispatchTable | None, target: str, backend: str, every: Sequence[Bucket],
          b: Bucket, results: Sequence[BucketResult]) -> list[Schedule]:
    """Schedules worth trying first in bucket b: its own earlier winner(s) in the table (current or stale;
    a split bucket's parts) each followed by its launch twins, then the winners of the buckets just below and
    above it in `every` (this run's result, else the table's entries). Entries whose schedule the backend can
    no longer rebuild are skipped."""
    done = {r.bucket: r.winner for r in results if r.winner is not None}
    i = next(j for j, c in enumerate(every) if (c.lo, c.hi) == (b.lo, b.hi))
    out: list[tuple[bool, Schedule | DispatchEntry | None]] = []  # (its own, schedule or entry)
    for j in (i, i - 1, i + 1):
        if not 0 <= j < len(every):
            continue
        c = every[j]
        if j != i and (c.lo, c.hi) in done:
            out.append((False, done[(c.lo, c.hi)]))
        elif table is not None:  # its entry, or the parts of a split bucket
            out.extend((j == i, e) for e in table.parts(target, backend, block.signature_hash(), c.lo, c.hi))
    found, seen = [], set()
    for own, s in out:
        if isinstance(s, DispatchEntry):
            try:
                s = s.schedule(block)
            except CacheError:
                continue
        for v in ([s, *launch_twins(s)] if own and s is not None else [s]):
            if v is not None and key(v) not in seen:
                seen.add(key(v))
                found.append(v)
    return found


def climb(st: Study, space: SearchSpace, outcomes: dict[str, Outcome], scored: dict, climbed: set[str]) -> None:
    """Local search: when the fastest candidate so far is new, enqueue its untried one-knob neighbours
    (space.neighbours), so that the next rounds walk downhill from it before TPE samples again; a better
    neighbour becomes the next incumbent and is climbed in turn (coordinate descent inside the study)."""
    ok = [o for o in outcomes.values() if o.ok and math.isfinite(o.time_s)]
    if not ok:
        return
    best = min(ok, key=lambda o: o.time_s)
    k = key(best.schedule)
    if k in climbed:
        return
    climbed.add(k)
    todo = [s for s in space.neighbours(best.schedule) if key(s) not in outcomes and key(s) not in scored]
    if todo:
        st.enqueue(todo)


class Untried:
    """When TPE proposes a point already scored, enqueue a random untried one instead (small spaces)."""

    LIMIT = 20000

    def __init__(self, st: Study, space: SearchSpace, seed: int):
        self.st, self.space, self.rng = st, space, random.Random(seed)
        self.points: list[tuple[str, Schedule]] = []
        self.size = space.size()  # points the backend accepts (all of them when too many to list)
        if self.size <= self.LIMIT:
            self.points = [(key(s), s) for s in space.grid() if isinstance(s, Schedule)]
            self.size = len(self.points)
            self.rng.shuffle(self.points)
        self.enqueued: set[str] = set()

    def suggest_one(self, tried: set[str]) -> None:
        while self.points:
            k, s = self.points.pop()
            if k not in tried and k not in self.enqueued:
                self.enqueued.add(k)
                self.st.enqueue([s])
                return
