"""The search space of one bucket: the passes' candidate schedules × the backend's kernel parameters.

The passes say which schedule kinds are worth trying in a bucket and with which IR-level knobs
(`CandidateSpace`: kind, hybrid row thresholds); the backend says what its kernel for each
kind can tune (`ParamSpace`: tiles, warps, stages, split-K). A `SearchSpace` crosses the two into a
conditional Optuna space:

    kind                      categorical over the kinds both sides accept
    <kind>:row_threshold      hybrid only, thresholds ≤ the bucket's largest token count
    <kind>:<param>            the backend's parameters of that kind

and maps Optuna's parameter dicts to Schedules and back (to enqueue the default heuristics).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..codegen.backend import Backend
from ..codegen.space import ParamSpace
from ..ir import Bucket, MoEBlock, Schedule, UnsupportedSchedule

_PRIMITIVE = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class KindSpace:
    """One schedule kind of a bucket: its IR knobs from the passes and its kernel's ParamSpace."""

    kind: str
    row_thresholds: tuple[int, ...]
    params: ParamSpace
    rule: str = ""

    def size(self) -> int:
        return max(1, len(self.row_thresholds)) * self.params.size()

    def choices(self) -> tuple[tuple[str, tuple], ...]:
        """(Optuna name, values) in suggestion order."""
        out = []
        if self.row_thresholds:
            out.append((f"{self.kind}:row_threshold", self.row_thresholds))
        out += [(f"{self.kind}:{n}", vals) for n, vals in self.params.choices]
        return tuple(out)


def _encode(values: tuple) -> tuple:
    """Optuna categoricals take None/bool/int/float/str; anything else is offered by its repr."""
    return values if all(isinstance(v, _PRIMITIVE) for v in values) else tuple(repr(v) for v in values)


def _decode(values: tuple, chosen):
    if all(isinstance(v, _PRIMITIVE) for v in values):
        return chosen
    return values[[repr(v) for v in values].index(chosen)]


@dataclass(frozen=True)
class SearchSpace:
    block: MoEBlock
    backend: str
    bucket: tuple[int, int]
    kinds: tuple[KindSpace, ...]
    refusals: tuple[tuple[str, str], ...] = ()  # (kind, reason) left out of the space
    full_size: int | None = None  # the points of the space this one was capped from (cap_space)

    def kind(self, name: str) -> KindSpace:
        for ks in self.kinds:
            if ks.kind == name:
                return ks
        raise UnsupportedSchedule(f"bucket {self.bucket}: kind {name!r} is not in the search space "
                                  f"({', '.join(k.kind for k in self.kinds)})")

    def size(self) -> int:
        return sum(ks.size() for ks in self.kinds)

    # Optuna side
    def suggest(self, trial) -> Schedule:
        """Sample one candidate with `trial` (an optuna Trial) and return it as a Schedule.

        Raises UnsupportedSchedule when the backend's params class refuses the combination."""
        kind = trial.suggest_categorical("kind", [ks.kind for ks in self.kinds])
        ks = self.kind(kind)
        values = {}
        for name, vals in ks.choices():
            values[name] = _decode(vals, trial.suggest_categorical(name, list(_encode(vals))))
        return self._schedule(ks, values)

    def distributions(self) -> dict[str, tuple]:
        """Optuna name → the categorical choices `suggest` offers for it (as Optuna stores them)."""
        out: dict[str, tuple] = {"kind": tuple(ks.kind for ks in self.kinds)}
        for ks in self.kinds:
            out.update((name, tuple(_encode(vals))) for name, vals in ks.choices())
        return out

    def schedule_of(self, params: dict) -> Schedule:
        """A trial's parameter dict (as Optuna stores it) → Schedule."""
        ks = self.kind(params["kind"])
        return self._schedule(ks, {n: _decode(vals, params[n]) for n, vals in ks.choices()})

    def params_of(self, schedule: Schedule) -> dict:
        """Schedule → the parameter dict Optuna would have sampled for it (to enqueue it)."""
        ks = self.kind(schedule.kind)
        d: dict = {"kind": schedule.kind}
        if ks.row_thresholds:
            d[f"{ks.kind}:row_threshold"] = schedule.row_threshold
        p = schedule.params
        for n, _ in ks.params.choices:
            d[f"{ks.kind}:{n}"] = getattr(p, n)
        for name, vals in ks.choices():
            if d[name] not in vals:
                raise UnsupportedSchedule(f"bucket {self.bucket}: {schedule.describe()} has "
                                          f"{name} = {d[name]!r}, outside the search space {vals}")
            d[name] = _encode(vals)[vals.index(d[name])]
        return d

    def contains(self, schedule: Schedule) -> bool:
        try:
            self.params_of(schedule)
            return True
        except UnsupportedSchedule:
            return False

    def neighbours(self, schedule: Schedule) -> list[Schedule]:
        """The points one parameter away from `schedule` in its kind (each other value of each knob, the
        values next to its own first), those the params class accepts; [] when it is outside the space.
        The tuner's local search: kernel parameters interact little, so a single-knob move from the
        incumbent (one more pipeline stage, split-K on, a wider group) is where the next gain usually is.
        A move the params class refuses is taken with the first other knob one value away (lower, then higher)
        that makes it valid, if any: a wider K step that no longer fits the shared memory with a stage less, a
        tile narrower than what its epilogue needs with the knob that frees it: such trades are two knobs
        apart."""
        try:
            params = self.params_of(schedule)
        except UnsupportedSchedule:
            return []
        ks = self.kind(schedule.kind)
        moves, beside = [], []  # beside: each knob's next value down, then up
        for name, vals in ks.choices():
            i = _encode(vals).index(params[name])
            moves += [(abs(j - i), name, vals[j]) for j in range(len(vals)) if j != i]
            beside += [(name, vals[j]) for j in (i - 1, i + 1) if 0 <= j < len(vals)]
        own = {n: _decode(vals, params[n]) for n, vals in ks.choices()}
        out, seen = [], set()
        for _, name, v in sorted(moves, key=lambda m: m[0]):
            for other in [{}, *({n: u} for n, u in beside if n != name)]:
                try:
                    s = self._schedule(ks, {**own, name: v, **other})
                except UnsupportedSchedule:
                    continue
                if key(s) not in seen:
                    seen.add(key(s))
                    out.append(s)
                break
        return out

    def _schedule(self, ks: KindSpace, values: dict) -> Schedule:
        rt = values.pop(f"{ks.kind}:row_threshold", None)
        params = ks.params.make(**{n.split(":", 1)[1]: v for n, v in values.items()})
        return Schedule(ks.kind, row_threshold=rt, backend=self.backend, params=params)

    def grid(self) -> Iterator[Schedule | UnsupportedSchedule]:
        """Every point of the space in order; a combination the params class refuses yields the error."""
        for ks in self.kinds:
            names = [n for n, _ in ks.choices()]
            for combo in itertools.product(*(vals for _, vals in ks.choices())):
                try:
                    yield self._schedule(ks, dict(zip(names, combo, strict=True)))
                except UnsupportedSchedule as e:
                    yield e

    def describe(self) -> str:
        parts = []
        for ks in self.kinds:
            dims = [f"{n.split(':', 1)[1]}∈{list(v)}" for n, v in ks.choices()]
            parts.append(f"{ks.kind} ({ks.size()}: {', '.join(dims) or 'no knobs'})")
        s = f"bucket [{self.bucket[0]},{self.bucket[1]}] {self.backend}: {self.size()} points"
        if self.full_size is not None:
            s += f" (a sub-grid of {self.full_size})"
        s += ": " + "; ".join(parts)
        if self.refusals:
            s += "  refused: " + "; ".join(f"{k}: {r}" for k, r in self.refusals)
        return s


def key(schedule: Schedule) -> str:
    """A stable identity of a candidate (to avoid timing the same point twice)."""
    p = schedule.params
    pv = () if p is None else tuple((f.name, getattr(p, f.name)) for f in dataclasses.fields(p))
    return repr((schedule.backend, schedule.kind, schedule.row_threshold, pv))


def _window(values: tuple, anchor, width: int) -> tuple[int, int]:
    """[lo, hi) indices of the anchor's value (its middle value when absent)."""
    i = values.index(anchor) if anchor in values else (len(values) - 1) // 2
    return i, i + width


def _cap_kind(ks: KindSpace, cap: int, anchor: Schedule | None) -> KindSpace:
    """The sub-grid of `ks` around `anchor` with at most `cap` points (see cap_space)."""
    names = [n for n, _ in ks.choices()]
    vals = [v for _, v in ks.choices()]
    if anchor is not None:
        got = {f"{ks.kind}:row_threshold": anchor.row_threshold}
        got.update({f"{ks.kind}:{n}": getattr(anchor.params, n, None) for n in ks.params.names()})
    else:
        got = {}
    win = [list(_window(v, got.get(n), 1)) for n, v in zip(names, vals, strict=True)]
    up = [True] * len(win)  # the side each field widens to next: up first, then alternating

    def size() -> int:
        n = 1
        for lo, hi in win:
            n *= hi - lo
        return n

    grew = True
    while grew:
        grew = False
        for f, v in enumerate(vals):
            lo, hi = win[f]
            sides = [up[f], not up[f]]
            for side in sides:
                if side and hi < len(v):
                    new = [lo, hi + 1]
                elif not side and lo > 0:
                    new = [lo - 1, hi]
                else:
                    continue
                old, win[f] = win[f], new
                if size() <= cap:
                    up[f] = not side
                    grew = True
                else:
                    win[f] = old
                break
    sub = {n: v[lo:hi] for n, v, (lo, hi) in zip(names, vals, win, strict=True)}
    rts = sub.pop(f"{ks.kind}:row_threshold", ())
    choices = tuple((n, sub[f"{ks.kind}:{n}"]) for n in ks.params.names())
    return dataclasses.replace(ks, row_thresholds=rts, params=dataclasses.replace(ks.params, choices=choices))


def cap_space(space: SearchSpace, cap: int, anchors: Sequence[Schedule] = ()) -> SearchSpace:
    """A deterministic sub-grid of `space` with at most `cap` points (a few more only when `cap` is
    below one point per kind), for checking the search against an exhaustive grid of the same space.

    Each kind gets an equal share of `cap` (at least one point). Its sub-grid starts from the first
    anchor of that kind (the default heuristic; a value outside the space, or no anchor: the field's
    middle value) and widens field by field in the space's order (row threshold, then the backend's
    parameters), each time by the next value above, then below, alternating, as long as the kind's
    product stays within its share. So the default is always a point of the sub-grid, and the fields
    the backend lists first (tiles) vary before the later ones.
    """
    if cap < 1:
        raise UnsupportedSchedule(f"space cap {cap}: need at least 1 point")
    if space.size() <= cap:
        return space
    share = max(1, cap // len(space.kinds))
    first = {}
    for s in anchors:
        if s is not None:
            first.setdefault(s.kind, s)
    kinds = tuple(_cap_kind(ks, share, first.get(ks.kind)) for ks in space.kinds)
    return dataclasses.replace(space, kinds=kinds, full_size=space.full_size or space.size())


def build_space(block: MoEBlock, backend: Backend, bucket: Bucket) -> SearchSpace:
    """Cross the bucket's candidate spaces with the backend's kernels; refusals from either side are
    kept with their reasons. Raises UnsupportedSchedule when nothing is left to try."""
    accepted = backend.kinds(block)
    kinds, refusals = [], [(r.kind, f"{r.rule}: {r.reason}") for r in bucket.refusals]
    for cand in bucket.candidates:
        why = accepted.get(cand.kind, f"backend {backend.name} has no {cand.kind} kernel")
        if why is not None:
            refusals.append((cand.kind, f"backend {backend.name}: {why}"))
            continue
        rts: tuple[int, ...] = ()
        if cand.kind == "hybrid":
            rts = tuple(r for r in cand.row_thresholds if 2 <= r <= bucket.hi)
            if not rts:
                refusals.append((cand.kind, f"no row threshold in {cand.row_thresholds} is reachable in "
                                            f"{bucket.label} (need 2 ≤ R ≤ {bucket.hi})"))
                continue
        if any(ks.kind == cand.kind for ks in kinds):
            refusals.append((cand.kind, f"rule {cand.rule}: duplicate candidate of kind {cand.kind}, "
                                        "first kept"))
            continue
        kinds.append(KindSpace(cand.kind, rts, backend.space(block, cand.kind), cand.rule))
    if not kinds:
        reasons = "; ".join(f"{k}: {r}" for k, r in refusals) or "the passes proposed no candidate"
        raise UnsupportedSchedule(f"bucket {bucket.label} of {block.name or block.signature_hash()}: "
                                  f"nothing to tune on backend {backend.name} ({reasons})")
    return SearchSpace(block, backend.name, (bucket.lo, bucket.hi), tuple(kinds), tuple(refusals))
