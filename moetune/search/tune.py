"""Tuning a block: every bucket the passes make of it gets a share of the budget and a study, and its
winner goes to the dispatch table.

    tune_block(block, "torch", "cpu", tokens=(1, 64), table=DispatchTable(path))   # every bucket
    tune_bucket(block, backend, "cpu", bucket, inputs, timer, options)              # one bucket

A bucket's tuning:
1. The default heuristic schedules (the backend's `default` for every candidate kind, and the runtime's
   choice among them) are enqueued first, then the seeds: the table's earlier winner of this bucket and
   the winners of the two neighbouring buckets (seeds.py).
2. Rounds of candidates are built, checked and timed until one stop reason holds (loop.py).
3. The best few are re-timed beside the default, at the bucket's other token counts too; the one that
   holds best wins, or the bucket is split into parts (finalists.py). A winner that does not beat the
   default by more than the spread of those re-timings is not written: the bucket keeps the default, and
   its result says why; where no usable entry of the table covers the bucket, the default itself is written
   as its entry (the table then covers every bucket tuned, and a resumed run skips it), and so it is where the
   bucket's own entry was timed here (a seed) and lost to the default: it replaces that entry. Else the winner is
   written to the table with its time at the representative count, floor, default time, baseline time
   and that spread; a written entry replaces the older entries it overlaps.

The budget is kept as a whole: `tune_block` gives each bucket still to tune an equal share of what is
left, a bucket whose one candidate would not fit in its share (estimated from the buckets before it) is
reported "not tuned: budget spent", and each bucket's loop and final round fit in its share.

With `storage` (an RDB URL or a journal file) several `moetune tune` workers share each study: each
asks its own trials, skips points another worker already scored; the first to finish a study writes its
winner, and a later one only a winner that beat the written one in its own final round (`study.WriteClaim`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..codegen.backend import Backend, for_target
from ..ir import Bucket, CacheError, ConfigError, IRError, MoEBlock, Schedule, TunerUnavailable, UnsupportedSchedule
from ..passes.policy import representative_tokens
from ..passes.roofline import floor as target_floor
from ..runtime.default import backend_device, machine_backend
from ..runtime.entry import DispatchEntry
from ..runtime.table import DispatchTable
from ..runtime.versions import Versions
from .baseline import baseline_fn, default_baseline
from .finalists import FinalRound, final_round, probe_counts, split_parts
from .loop import Progress, Share, run_rounds
from .objective import Objective, Outcome, RoutingSampler, expert_tensors, make_cases, routing_sampler
from .options import BucketResult, TuneOptions
from .progress import Display
from .seeds import default_schedules, runtime_default, seeds
from .space import SearchSpace, build_space, cap_space, key
from .study import Study, require_optuna
from .timing import Case, Timer, timer_for


@dataclass(frozen=True)
class BucketInputs:
    """What a bucket's candidates run on: timing cases at `tokens`, checks at `check_tokens`."""

    tokens: int
    cases: tuple[Case, ...]
    check_tokens: tuple[int, ...]
    sampler: RoutingSampler | None = None


def _work(block: MoEBlock, target: str, bucket: Bucket) -> tuple[float, float]:
    """What one candidate's cost in a bucket is scaled by across buckets: the roofline floors of its
    timing count and check counts (their token counts on a target without roofs), and those counts."""
    counts = (representative_tokens(bucket.lo, bucket.hi), bucket.lo, bucket.hi)
    try:
        floors = math.fsum(target_floor(block, target, t).time_s for t in counts)
    except IRError:
        floors = float(sum(counts))
    return floors, float(sum(counts))


def bucket_inputs(block: MoEBlock, bucket: Bucket, w, *, routings: int, seed: int = 0,
                  sampler: RoutingSampler | None = None) -> BucketInputs:
    T = representative_tokens(bucket.lo, bucket.hi)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + bucket.lo)
    cases = make_cases(block, w, T, routings, gen, sampler)
    return BucketInputs(T, tuple(cases), tuple(sorted({bucket.lo, T, bucket.hi})), sampler)


def tune_bucket(block: MoEBlock, backend: Backend, target: str, bucket: Bucket, inputs: BucketInputs,
                timer: Timer, options: TuneOptions, *, table: DispatchTable | None = None,
                versions: Versions | None = None, progress: Progress | None = None,
                seeds: Sequence[Schedule] = (), first_only: bool = False, share: Share | None = None,
                event: dict | None = None, baseline: tuple | None = None) -> BucketResult:
    """Tune one bucket (see the module doc) within `share` (default: `options.budget_s` from now); write
    the winner to `table` when given. `seeds` (those inside this bucket's space) are tried right after the
    defaults; with `first_only`, nothing else is (`--revalidate` re-checks a stale winner, no search).
    `baseline`: (function, label) from `baseline_fn`, made once by `tune_block`."""
    share = share or Share(options.budget_s)
    space = build_space(block, backend, bucket)
    default = runtime_default(block, backend, target, bucket)
    if options.space_cap:  # the same sub-grid for TPE and --exhaustive: centred on the defaults
        space = cap_space(space, options.space_cap,
                          default_schedules(block, backend, space, inputs.tokens, first=default))
    objective = Objective(block, backend, timer, inputs.cases, inputs.check_tokens, sampler=inputs.sampler,
                          seed=options.seed + bucket.lo, strict=options.strict, keep_going=options.keep_going,
                          warm_in_build=options.warm_in_build, timeout_s=options.candidate_timeout_s)
    share.timings = objective.timer_wall
    floor_s = bucket.floor.time_s if bucket.floor is not None else 0.0
    name = f"moetune:{target}:{backend.name}:{block.signature_hash()}:{bucket.lo}-{bucket.hi}"
    if options.space_cap and space.full_size is not None:  # a capped space is a study of its own
        name += f":cap{options.space_cap}"
    st = Study(name, space, options)
    first = default_schedules(block, backend, space, inputs.tokens, first=default)
    first += [s for s in seeds if space.contains(s)]
    st.enqueue(first)
    if options.exhaustive:
        st.enqueue([s for s in space.grid() if isinstance(s, Schedule)])
    counts = (probe_counts(bucket.lo, bucket.hi, inputs.tokens, options.interior_counts)
              if options.edge_timing and bucket.lo < bucket.hi else [])
    batch = len({key(s) for s in first}) if first_only else options.batch or max(2, options.build_workers)
    loop = run_rounds(st, space, objective, options, share, batch=batch, first_only=first_only, floor_s=floor_s,
                      reserve=lambda: share.reserve(options.retime + 1, options.retime_rounds, len(counts)),
                      progress=progress, event={"bucket": (bucket.lo, bucket.hi), **(event or {})})
    outcomes, notes = loop.outcomes, []
    if default is not None and key(default) not in outcomes:  # outside the space: measured all the same
        if share.fits(share.eval_s() + share.build_s()) or not outcomes:
            outcomes[key(default)] = objective.evaluate(default)
        else:
            notes.append("the default (outside the space) not timed (budget)")
    gen = torch.Generator().manual_seed(options.seed * 1_000_003 + bucket.hi + 17)
    fr = final_round(st, objective, outcomes, default, options, share, rep=inputs.tokens, counts=counts,
                     cases_at=lambda t: make_cases(block, objective.w, t, len(inputs.cases), gen, inputs.sampler),
                     keep_s=share.timing_s())
    base_s, blabel = _baseline(block, objective, options, share, baseline)
    result = BucketResult(
        bucket=(bucket.lo, bucket.hi), tokens=inputs.tokens, winner=fr.winner, time_s=fr.time_s, floor=bucket.floor,
        default=default, default_time_s=fr.default_time_s, baseline=blabel, baseline_time_s=base_s,
        trials=len(st.trials), evaluated=len(outcomes), failures=loop.failures,
        stopped="; ".join(x for x in (loop.stopped, *notes, *fr.notes, fr.kept) if x), space=space.describe(),
        finalists=fr.finals, elapsed_s=share.spent(), spread_s=fr.spread_s)
    claim = st.claim(table.path, fr.winner, [f for f, _, _ in fr.finals]) if table is not None else None
    if fr.kept:  # the default serves the bucket: written as its entry where no usable entry covers it
        if table is not None and fr.winner is not None and fr.default_time_s is not None:
            versions = versions or Versions.current(backend.name, objective.device)
            holes = _holes(table, block, target, backend.name, bucket, versions, objective.device)
            beaten = _beaten_here(table, block, target, backend.name, bucket, outcomes, default)
            if beaten:  # the bucket's own entry lost to the default here: the default replaces it
                holes = [(bucket.lo, bucket.hi)]
            if holes:
                whole = holes == [(bucket.lo, bucket.hi)]
                held = dataclasses.replace(result, parts=() if whole else tuple(
                    (lo, hi, fr.winner, fr.time_s, inputs.tokens) for lo, hi in holes))
                written = _write(table, held, block, target, versions, timer, fr, outcomes, space, default, claim)
                said = ("the default written as the bucket's entry, replacing the stored entry it beat here"
                        if beaten else
                        "the default written as the bucket's entry (no usable entry covered it)" if whole else
                        "the default written where no usable entry covered the bucket: "
                        + ", ".join(f"[{lo},{hi}]" for lo, hi in holes)) if written else ""
                said = "; ".join(x for x in (claim.said if claim is not None else "", said) if x)
                result = dataclasses.replace(result, written=written, elapsed_s=share.spent(),
                                             stopped="; ".join(x for x in (result.stopped, said) if x))
        return result
    split = options.split if options.split is not None else objective.device.startswith("cuda")
    if split and fr.winner is not None:
        result = dataclasses.replace(result, parts=split_parts(bucket.lo, bucket.hi, inputs.tokens, fr.finals,
                                                               options.split_loss))
    if table is not None and fr.winner is not None:
        versions = versions or Versions.current(backend.name, objective.device)
        written = _write(table, result, block, target, versions, timer, fr, outcomes, space, default, claim)
        said = claim.said if claim is not None else ""
        result = dataclasses.replace(result, written=written, elapsed_s=share.spent(),
                                     stopped="; ".join(x for x in (result.stopped, said) if x))
    return result


def _baseline(block: MoEBlock, objective: Objective, options: TuneOptions, share: Share,
              made: tuple | None) -> tuple[float | None, str]:
    """The transformers baseline's time here, and its label (why not, when it was not timed)."""
    base_fn, blabel = made or baseline_fn(block, options.baseline or default_baseline(objective.device))
    if base_fn is None:
        return None, f"none ({blabel})"
    if not share.fits(share.timing_s()):
        return None, f"none ({blabel} not timed: budget)"
    try:
        return objective.time_fn(base_fn).median_s, blabel
    except Exception as e:  # noqa: BLE001 - a baseline that cannot be timed here is reported, not fatal
        return None, f"none ({blabel} failed: {type(e).__name__}: {e}"[:200] + ")"


def _write(table: DispatchTable, result: BucketResult, block: MoEBlock, target: str, versions: Versions,
           timer: Timer, fr: FinalRound, outcomes: dict[str, Outcome], space: SearchSpace,
           default: Schedule | None, claim=None) -> bool:
    """Write the winner's entry, or one entry per part of a split bucket (in one transaction); whether any
    was written. What the entries overlap is split around them (`DispatchTable.put_all`); `claim`: on a
    shared study, whether this worker writes (`study.WriteClaim`)."""
    floor_s = result.floor.time_s if result.floor is not None else None
    base_s, rep = result.baseline_time_s, result.tokens

    def entry(bucket, schedule, time_s, T, default_s) -> DispatchEntry:
        return DispatchEntry.of(
            bucket=bucket, schedule=schedule, time_us=time_s * 1e6, target=target, block=block, versions=versions,
            floor_us=(floor_s * 1e6 if floor_s is not None else None) if T == rep else _floor_us(block, target, T),
            default_time_us=None if default_s is None else default_s * 1e6,
            baseline_time_us=base_s * 1e6 if base_s is not None and T == rep else None,
            baseline=result.baseline, timer=getattr(timer, "name", type(timer).__name__), trials=result.trials,
            spread_us=None if fr.spread_s is None else fr.spread_s * 1e6)

    if not result.parts:
        e = entry(result.bucket, fr.winner, fr.time_s, rep, fr.default_time_s)
        return table.put(e, replace=_judged_here(table, e, block, outcomes, space), supersede=True, claim=claim)
    # each part's entry replaces what overlaps it: it was chosen against those finalists here
    d_row = next(({rep: t} | at for f, t, at in fr.finals if default is not None and key(f) == key(default)), {})
    parts = [entry((lo, hi), s, t_s, T, d_row.get(T)) for lo, hi, s, t_s, T in result.parts]
    return any(table.put_all(parts, replace=True, supersede=True, claim=claim))  # together or not at all


def _holes(table: DispatchTable, block: MoEBlock, target: str, backend: str, bucket: Bucket, versions: Versions,
           device: str) -> list[tuple[int, int]]:
    """The token ranges of `bucket` no usable entry of the table covers (`DispatchTable.lookup` with
    `versions`), in order. A bucket that keeps its default gets the default there, so the table covers every
    bucket tuned (a compiled model finds an entry, a resumed run does not tune it again) and a stale entry
    there is split away; the usable entries are left as they are."""
    try:
        usable = table.lookup(block, target, backend, versions=versions, device=device).measured
    except CacheError:
        usable = ()
    out, nxt = [], bucket.lo
    for lo, hi, _ in sorted(usable):
        if hi < nxt or lo > bucket.hi:
            continue
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt <= bucket.hi:
        out.append((nxt, bucket.hi))
    return out


def _beaten_here(table: DispatchTable, block: MoEBlock, target: str, backend: str, bucket: Bucket,
                 outcomes: dict[str, Outcome], default: Schedule | None) -> bool:
    """Whether the table's entry of exactly this bucket is another schedule than the default and this study
    timed it (it is a seed): the bucket keeping its default then means the default beat it, and it is replaced,
    not left to serve the bucket."""
    old = table.get(target, backend, block.signature_hash(), bucket.lo, bucket.hi)
    if old is None or default is None:
        return False
    try:
        k = key(old.schedule(block))
    except CacheError:
        return False
    return k != key(default) and k in outcomes


def _floor_us(block: MoEBlock, target: str, tokens: int) -> float | None:
    """The roofline floor at `tokens` on a known target (uniform routing), µs; None for another target.
    For a split bucket's parts away from the representative T (that part keeps the bucket's own floor)."""
    try:
        return target_floor(block, target, tokens).time_s * 1e6
    except IRError:
        return None


def _judged_here(table: DispatchTable, entry: DispatchEntry, block: MoEBlock, outcomes: dict[str, Outcome],
                 space: SearchSpace) -> bool:
    """Whether this study measured the table's stored winner of the entry's bucket itself (it is a seed):
    then its own winner replaces it even when slower at the representative T (chosen over the edges too)."""
    old = table.get(entry.target, entry.backend, entry.signature, entry.bucket_lo, entry.bucket_hi)
    if old is None:
        return False
    try:
        return key(old.schedule(block)) in outcomes
    except CacheError:
        return False


class _Costs:
    """One candidate's measured wall time per bucket: the next buckets' estimates. A candidate costs its
    build (compile: the same in every bucket) and its evaluation (check and timing), which grows with the
    bucket. The evaluation is scaled by whichever grows faster, the roofline floors or the token counts (a
    kernel far from its roofs grows with the work, not with the bytes): a + b·work fitted to the buckets
    measured. From one bucket alone there is no line to fit, and the token counts would extrapolate the
    fixed costs of a small bucket's evaluation (launches, graph capture, the reference) a hundredfold into a
    large one: its evaluation is scaled by the floors only."""

    def __init__(self) -> None:
        self.points: list[tuple[tuple[float, float], float, float]] = []  # (work, evaluation s, build s)

    def add(self, work: tuple[float, float], share: Share) -> None:
        if share.evals:
            self.points.append((work, max(share.evals), share.build_s()))

    def estimate(self, work: tuple[float, float]) -> float | None:
        if not self.points:
            return None
        build = max(b for _, _, b in self.points)
        axes = range(2) if len({w for w, _, _ in self.points}) > 1 else range(1)
        return build + max(_fit_line([(w[i], s) for w, s, _ in self.points], work[i]) for i in axes)


def _fit_line(points: list[tuple[float, float]], x: float) -> float:
    """The least-squares line through `points` (slope ≥ 0) at `x`; through 0 with one distinct x."""
    xs = {p for p, _ in points}
    if len(xs) == 1:
        x0, s0 = max(points)
        return s0 * max(1.0, x / x0) if x0 > 0 else s0
    n = len(points)
    mx, my = math.fsum(p for p, _ in points) / n, math.fsum(s for _, s in points) / n
    b = max(0.0, math.fsum((p - mx) * (s - my) for p, s in points) / math.fsum((p - mx) ** 2 for p, _ in points))
    near = max(s for p, s in points if p <= x) if any(p <= x for p, _ in points) else 0.0
    return max(my + b * (x - mx), near)


def _share(left_s: float, ests: list[float | None]) -> float | None:
    """The first bucket's share of `left_s` among the buckets still to tune (their one-candidate cost
    estimates, this one first): an equal part, or more where one candidate costs more (a part
    proportional to its cost among the cheapest buckets whose costs fit together); None when it is not
    one of those."""
    if ests[0] is None:
        return left_s / len(ests)
    fits, total = [], 0.0
    for e in sorted(e for e in ests if e is not None):
        if total + e > left_s:
            break
        fits.append(e)
        total += e
    if not fits or ests[0] > fits[-1]:
        return None
    return max(left_s / len(ests), left_s * ests[0] / total)


def tune_block(block: MoEBlock, backend: str, target: str, tokens: tuple[int, int] = (1, 1024), *,
               trace=None, timer: Timer | None = None, table: DispatchTable | None = None,
               options: TuneOptions | None = None, budget_s: float | None = None,
               progress: Progress | None = None,
               on_bucket: Callable[[int, int, BucketResult], None] | None = None,
               at_tokens: Sequence[int] | None = None, display: bool | None = None,
               started: float | None = None) -> list[BucketResult]:
    """Tune every bucket the passes make of `block` on `tokens` within `budget_s` in all (wall clock from
    `started`, a time.monotonic() reading, default this call: a command passes `process_started()`; the
    compile of candidates included; default `options.budget_s` per bucket). With
    `at_tokens`, only the buckets (of the whole range) holding one of those token counts. `display`
    (default on) writes a progress line with an ETA per bucket and overall to stderr."""
    from ..ir.trace import Trace
    from ..passes.pipeline import schedule_block

    t0 = time.monotonic() if started is None else started
    options = options or TuneOptions()
    if budget_s is not None and not budget_s > 0:
        raise ConfigError(f"tune_block budget_s = {budget_s!r}: need a positive budget (seconds)")
    require_optuna()
    be = for_target(backend, target)
    why = be.available()
    if why:
        raise TunerUnavailable(f"backend {backend} is not usable here: {why}")
    device = options.device or backend_device(backend)
    timer = timer or timer_for(device, be)
    block = block.replace(T_max=max(block.T_max, tokens[1])) if block.T_max < tokens[1] else block
    sb = schedule_block(block, target, trace=trace, tokens=tokens)
    buckets = [b for b in sb.buckets if b.hi >= tokens[0] and b.lo <= tokens[1]]
    every = list(buckets)  # before --at-tokens: the neighbours a bucket is seeded from
    if at_tokens is not None:
        buckets = [b for b in buckets if any(b.lo <= t <= b.hi for t in at_tokens)]
    if isinstance(trace, str | os.PathLike):
        trace = Trace.load(trace)
    sampler = routing_sampler(block, trace)
    w = expert_tensors(block, device, seed=options.seed)
    routings = options.routings or (32 if device.startswith("cuda") else 8)
    versions = Versions.current(be.name, device) if table is not None else None
    total = budget_s if budget_s is not None else options.budget_s * len(buckets)
    end = t0 + total
    kept = _kept(block, table, target, be.name, buckets, versions, options) if at_tokens is None else {}
    base = baseline_fn(block, options.baseline or default_baseline(device))  # imports transformers: once, here
    todo = [b for b in buckets if (b.lo, b.hi) not in kept]
    works = {(b.lo, b.hi): _work(block, target, b) for b in todo}
    show = Display(len(buckets), total, t0) if display is not False else None
    costs, results, last_s = _Costs(), [], 0.0
    for i, b in enumerate(buckets):
        now = time.monotonic()
        rep = representative_tokens(b.lo, b.hi)
        if (b.lo, b.hi) in kept:  # resumed: the table already holds this bucket's current winner(s)
            r = BucketResult.kept(b, rep, kept[(b.lo, b.hi)], block)
        elif options.time_limit_s is not None and results and now - t0 + last_s > options.time_limit_s:
            r = BucketResult.untuned(b, rep, f"time limit {options.time_limit_s:.0f} s (the last bucket took "
                                     f"{last_s:.1f} s, {now - t0:.1f} s spent); rerun with resume", left=True)
        else:
            left_s = end - time.monotonic()
            ests = [costs.estimate(works[(c.lo, c.hi)]) for c in todo[todo.index(b):]]
            est, share_s = ests[0], _share(left_s, ests)
            if share_s is None:  # its one candidate does not fit beside the cheaper buckets still to tune
                share_s = left_s / len(ests)
            if options.time_limit_s is not None:  # the first bucket runs all the same: a resume makes progress
                share_s = min(share_s, t0 + options.time_limit_s - time.monotonic())
                share_s = share_s if costs.points else max(share_s, 1e-3)
            if share_s <= 0 or (est is not None and est > share_s):
                spent = time.monotonic() - t0
                one = f"one candidate here takes about {est:.1f} s, " if est is not None else ""
                r = BucketResult.untuned(b, rep, f"budget spent: {one}this bucket's share is {max(share_s, 0):.1f} s "
                                         f"({spent:.1f} s of the {total:.1f} s budget used, {len(ests)} bucket"
                                         f"{'s' if len(ests) != 1 else ''} left)", left=True)
            else:
                inputs = bucket_inputs(block, b, w, routings=routings, seed=options.seed, sampler=sampler)
                share = Share(max(share_s - (left_s - (end - time.monotonic())), 1e-3), est)
                r = _tune_one(block, be, target, b, inputs, timer, options, table, versions, share, every,
                              results, device, progress=_tee(progress, show),
                              event={"index": i, "buckets": len(buckets)}, baseline=base)
                costs.add(works[(b.lo, b.hi)], share)
                last_s = r.elapsed_s
        results.append(r)
        if show:
            show.bucket_done(i, r)
        if on_bucket:
            on_bucket(i, len(buckets), r)
    if show:
        show.close()
    return results


def process_started() -> float:
    """The time.monotonic() reading at which this process started (where /proc says; elsewhere now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


def _tune_one(block, be, target, b, inputs, timer, options, table, versions, share, every, results, device, *,
              progress, event, baseline) -> BucketResult:
    opts = dataclasses.replace(options, budget_s=share.seconds, device=device)
    try:
        recheck = options.revalidate and table is not None and table.get(
            target, be.name, block.signature_hash(), b.lo, b.hi) is not None
        return tune_bucket(block, be, target, b, inputs, timer, opts, table=table, versions=versions,
                           progress=progress, seeds=seeds(block, table, target, be.name, every, b, results),
                           first_only=recheck, share=share, event=event, baseline=baseline)
    except UnsupportedSchedule as e:  # nothing to tune here: the runtime keeps its default
        if options.strict:
            raise
        return BucketResult.untuned(b, inputs.tokens, str(e), share.spent())


def _kept(block, table, target, backend, buckets, versions, options) -> dict:
    """With resume or revalidate: the buckets whose table entries (a split bucket's parts) are current and
    measured (an estimate is tuned again: a timing replaces it)."""
    if not (options.resume or options.revalidate) or table is None:
        return {}
    from ..runtime.versions import judge

    kept = {}
    for b in buckets:
        es = table.parts(target, backend, block.signature_hash(), b.lo, b.hi)
        if es and all(judge(e, versions) is None and not e.estimated for e in es):
            kept[(b.lo, b.hi)] = es
    return kept


def _tee(progress: Progress | None, show: Display | None) -> Progress | None:
    if show is None:
        return progress
    if progress is None:
        return show

    def both(ev: dict) -> None:
        show(ev)
        progress(ev)

    return both


def tune(model, *, backend: str | None = None, target: str | None = None, tokens: tuple[int, int] = (1, 1024),
         budget_s: float = 60.0, cache=None, options: TuneOptions | None = None, **kwargs) -> list[BucketResult]:
    """Tune the dispatch table of `model` on this machine: a torch model (its captured MoE blocks, each
    distinct signature once), a MoEBlock, or a preset name. `backend`: triton on a GPU, else torch;
    `target`: the one `moetune.compile` looks the table up under for this device; `cache`: a table file or
    an open DispatchTable the winners are written to (None: nothing written). The budget is shared by
    every block's buckets. Returns the per-bucket results, block after block; `kwargs` go to `tune_block`."""
    from ..runtime.versions import target_of

    blocks = _blocks(model)
    backend = backend or machine_backend()
    device = (options.device if options and options.device else None) or backend_device(backend)
    target = target or target_of(device)
    if cache is None or isinstance(cache, DispatchTable):
        return _tune_blocks(blocks, backend, target, tokens, budget_s, cache, options, kwargs)
    with DispatchTable(cache) as table:
        return _tune_blocks(blocks, backend, target, tokens, budget_s, table, options, kwargs)


def _tune_blocks(blocks, backend, target, tokens, budget_s, table, options, kwargs) -> list[BucketResult]:
    t0, out = time.monotonic(), []
    for i, b in enumerate(blocks):
        left = budget_s - (time.monotonic() - t0)
        out += tune_block(b, backend, target, tokens, table=table, options=options,
                          budget_s=max(left / (len(blocks) - i), 1e-3), **kwargs)
    return out


def _blocks(model) -> list[MoEBlock]:
    if isinstance(model, MoEBlock):
        return [model]
    if isinstance(model, str):
        from ..ir.presets import preset

        return [preset(model)]
    from ..ir.capture import capture

    found: dict[str, MoEBlock] = {}
    for c in capture(model):
        if c.block is not None:
            found.setdefault(c.block.signature_hash(), c.block)
    if not found:
        raise ConfigError(f"moetune.tune: no MoE block captured in {type(model).__name__}")
    return list(found.values())
