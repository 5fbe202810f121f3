"""The final round of a bucket: its best few candidates re-timed back to back beside the default, timed
at other token counts of the bucket too (`probe_counts`), the one that holds best over the bucket wins
(`robust`), and where no one finalist holds everywhere the bucket is cut into parts (`split_parts`).

A finalist's time is the median of its search time and `retime_rounds` rounds (every other round in
reverse order, so that drift cancels). The round fits in what is left of the bucket's share: rounds,
then token counts, are dropped when the next would not fit, and the notes say so.

The best finalist wins only when it beats the default, re-timed in the same rounds, by more than the
spread of those timings (`spread`, `against_default`); else the bucket keeps the default, and says why.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..ir import Schedule
from .loop import Share
from .objective import Objective, Outcome
from .options import TuneOptions
from .space import key
from .study import Study
from .timing import Case

Finals = tuple[tuple[Schedule, float, dict[int, float]], ...]


@dataclass(frozen=True)
class FinalRound:
    winner: Schedule | None  # the default itself when `kept` says why
    time_s: float
    default_time_s: float | None
    finals: Finals  # (candidate, time at the representative T, {other T: time}), winner first
    notes: tuple[str, ...] = ()  # what the budget cut short
    spread_s: float | None = None  # the larger spread of the winner's and the default's timings (`spread`)
    kept: str = ""  # why the bucket keeps the default (no winner to write): the numbers it was judged by


def spread(times: Sequence[float], iqr_s: Sequence[float] = ()) -> float:
    """How far one candidate's timings in the final round disagree: the range of the medians its time is
    the median of (its search timing and the re-timings), or with one timing only, that timing's
    interquartile range of its reps (`Timing.spread_s`)."""
    ok = [t for t in times if math.isfinite(t)]
    if len(ok) > 1:
        return max(ok) - min(ok)
    return max((s for s in iqr_s if math.isfinite(s)), default=0.0)


def against_default(best_s: float, default_s: float, spread_s: float) -> str:
    """Why a bucket keeps its default when its best finalist (`best_s`) does not beat the default
    (`default_s`) by more than `spread_s`; "" when it does."""
    if default_s - best_s > spread_s:
        return ""
    pct = 100.0 * spread_s / default_s
    if best_s > default_s:
        return (f"kept the default: the best finalist {100.0 * (best_s - default_s) / default_s:.1f} % slower, "
                f"spread {pct:.1f} %")
    return (f"kept the default: the best finalist {100.0 * (default_s - best_s) / default_s:.1f} % faster, "
            f"within the spread {pct:.1f} %")


def probe_counts(lo: int, hi: int, rep: int, interior: int) -> list[int]:
    """The token counts a bucket's finalists are timed at besides the representative `rep`: the first
    and the last, and in a bucket spanning ≥ 1.5× `interior` more at even ratios between them, each more
    than 5 % away from `rep` (a tile or wave boundary can fall inside a wide bucket)."""
    pts = {lo, hi}
    if interior > 0 and hi >= 1.5 * lo:
        inner = {round(lo * (hi / lo) ** (i / (interior + 1))) for i in range(1, interior + 1)}
        pts |= {t for t in inner if abs(t - rep) > 0.05 * rep}
    pts.discard(rep)
    return sorted(t for t in pts if lo <= t <= hi)


def final_round(st: Study, objective: Objective, outcomes: dict[str, Outcome], default: Schedule | None,
                options: TuneOptions, share: Share, *, rep: int, counts: Sequence[int] = (),
                cases_at: Callable[[int], list[Case]] | None = None, keep_s: float = 0.0) -> FinalRound:
    """Re-time the best few (every worker's) beside the default; with `counts` (and `cases_at` to make
    their cases) time each finalist there too, and the one that loses least over all counts wins
    (`robust`); its time is still the representative count's. `keep_s` is left free for the caller."""
    finalists = {key(s): s for s in st.ranked(options.retime)}
    dk = key(default) if default is not None else None
    default_ok = default is not None and dk in outcomes and outcomes[dk].ok
    if default_ok:
        finalists.setdefault(dk, default)
    if not finalists:
        return FinalRound(None, math.inf, None, ())
    notes: list[str] = []
    if default is not None and not default_ok:
        notes.append("not judged against the default: "
                     + (f"it {outcomes[dk].status}" if dk in outcomes else "it was not timed"))
    if len(finalists) == 1 and not options.storage and next(iter(finalists)) in outcomes:
        (k, s), = finalists.items()
        out = outcomes[k]
        sp = spread([out.time_s], [out.timing.spread_s] if out.timing is not None else [])
        kept = "kept the default: the only finalist" if k == dk else ""
        return FinalRound(s, out.time_s, out.time_s if k == dk else None, ((s, out.time_s, {}),), tuple(notes),
                          sp, kept)
    times: dict[str, list[float]] = {}
    iqrs: dict[str, list[float]] = {}
    for k, s in finalists.items():
        out = outcomes.get(k)
        if out is None or not out.ok:  # another worker's candidate: check it here before trusting it
            if not share.fits(share.eval_s() + share.build_s(), keep_s):
                notes.append(f"another worker's finalist not checked here ({share.left():.1f} s left)")
                continue
            out = objective.evaluate(s)
            if not out.ok:
                continue
        times[k] = [out.time_s]
        iqrs[k] = [out.timing.spread_s] if out.timing is not None else []
    if not times:
        return FinalRound(None, math.inf, None, (), tuple(notes))
    call = share.timing_s()
    wide = call * len(times) * sum(c / rep for c in counts)  # the other counts, cost scaled by T
    fit = int((share.left() - keep_s - wide) / (call * len(times))) if call > 0 else options.retime_rounds
    rounds = max(0, min(options.retime_rounds, fit))
    if rounds < options.retime_rounds:
        notes.append(f"finalists re-timed in {rounds} of {options.retime_rounds} rounds (budget)")
    for r in range(rounds):  # back to back, the default among them; every other round in reverse, so drift cancels
        for k in (list(times) if r % 2 == 0 else list(times)[::-1]):
            tm = objective.time_fn(objective.fn_of(finalists[k]), finalists[k])
            times[k].append(tm.median_s)
            iqrs[k].append(tm.spread_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    wk = min(med, key=med.get)
    at: dict[int, dict[str, float]] = {}
    if counts and cases_at is not None and len(med) > 1:
        order = sorted(counts, key=lambda c: (c not in (min(counts), max(counts)), c))  # the edges first
        for c in order:
            if not share.fits(call * len(med) * c / rep, keep_s):
                notes.append(f"not timed at T={', '.join(map(str, sorted(set(counts) - set(at))))} (budget)")
                break
            cases = cases_at(c)
            at[c] = {k: _time_at(objective, finalists[k], cases) for k in med}
        at = dict(sorted(at.items()))
        if at:
            wk = robust(med, at)
    judged = default_ok and dk in med
    sp = max(spread(times[k], iqrs[k]) for k in {wk, dk if judged else wk})
    kept = ""
    if judged:
        kept = "kept the default: it is the fastest finalist" if wk == dk else against_default(med[wk], med[dk], sp)
        if kept:
            wk = dk
    order = [wk] + sorted((k for k in med if k != wk), key=med.get)
    finals = tuple((finalists[k], med[k], {t: r[k] for t, r in at.items()}) for k in order)
    return FinalRound(finalists[wk], med[wk], med[dk] if judged else None, finals, tuple(notes), sp, kept)


def _time_at(objective: Objective, s: Schedule, cases: list[Case]) -> float:
    try:
        return objective.time_fn(objective.fn_of(s), s, cases).median_s
    except Exception:  # noqa: BLE001 - checked at the edges already; a launch failure there only disqualifies
        return math.inf


def robust(at_rep: dict[str, float], at_edges: dict[int, dict[str, float]]) -> str:
    """The finalist with the least geometric-mean slowdown against the fastest at each token count timed
    (the representative one, the bucket's edges and the counts between them): a winner must hold over
    the whole bucket, not only where it was searched. Ties: the faster at the representative count."""
    rows = [r for r in (at_rep, *at_edges.values()) if math.isfinite(min(r.values()))]

    def regret(k: str) -> float:
        return math.fsum(math.log(r[k] / min(r.values())) if math.isfinite(r[k]) else math.inf
                         for r in rows) / len(rows)

    return min(at_rep, key=lambda k: (round(regret(k), 6), at_rep[k]))


Parts = tuple[tuple[int, int, Schedule, float, int], ...]


def split_parts(lo: int, hi: int, rep: int, finals: Finals, loss: float) -> Parts:
    """Parts of bucket [lo, hi] from its final round (the winner first), when the winner is more than
    `loss` slower than another finalist at some count timed. The counts are then cut into 2 or 3 runs,
    each served by the finalist with the least total log-loss at its counts: the fewest runs that bring
    every count within `loss` of its fastest finalist, else the cut with the smallest worst loss (only if
    it is smaller than the winner's). Each part is timed at its middle count (the part holding `rep` at
    `rep`); boundaries fall at the geometric middle between neighbouring counts; neighbouring runs with
    one finalist are one part. () when the bucket stays whole (one part)."""
    if len(finals) < 2 or not finals[0][2]:
        return ()
    rows = [{rep: t} | edge for _, t, edge in finals]
    counts = sorted(rows[0])
    best = {T: min(r.get(T, math.inf) for r in rows) for T in counts}
    if not all(math.isfinite(best[T]) and best[T] > 0 for T in counts):
        return ()

    def lost(f: int, T: int) -> float:
        return math.log(rows[f].get(T, math.inf) / best[T])

    tol = math.log1p(loss)
    worst0 = max(lost(0, T) for T in counts)
    if worst0 <= tol:
        return ()
    options = []
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, len(counts)), c) for c in (1, 2)):
        groups = [counts[i:j] for i, j in zip((0, *cuts), (*cuts, len(counts)), strict=True)]
        picks = [min(range(len(rows)), key=lambda f, g=g: (math.fsum(lost(f, T) for T in g), f)) for g in groups]
        worst = max(lost(f, T) for g, f in zip(groups, picks, strict=True) for T in g)
        total = math.fsum(lost(f, T) for g, f in zip(groups, picks, strict=True) for T in g)
        options.append((worst > tol, worst if worst > tol else 0.0, len(cuts), total, groups, picks))
    over, worst, _, _, groups, picks = min(options, key=lambda o: o[:4])
    if over and worst >= worst0:
        return ()
    runs: list[tuple[list[int], int]] = []
    for g, f in zip(groups, picks, strict=True):
        if runs and runs[-1][1] == f:
            runs[-1] = (runs[-1][0] + g, f)
        else:
            runs.append((g, f))
    if len(runs) == 1:
        return ()
    groups, picks = [g for g, _ in runs], [f for _, f in runs]
    out = []
    for n, (g, f) in enumerate(zip(groups, picks, strict=True)):
        T = rep if rep in g else g[len(g) // 2]
        p_lo = lo if n == 0 else out[-1][1] + 1
        p_hi = hi if n == len(groups) - 1 else round(math.sqrt(g[-1] * groups[n + 1][0])) - 1
        out.append((p_lo, max(p_hi, g[-1]), finals[f][0], rows[f][T], T))
    return tuple(out)
