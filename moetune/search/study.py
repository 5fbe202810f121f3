"""Studies: one Optuna study per (target, backend, block signature, bucket), winners into the table.

    tune_block(block, "torch", "cpu", tokens=(1, 64), table=DispatchTable(path))   # every bucket
    tune_bucket(block, backend, "cpu", bucket, inputs, timer, options)              # one bucket

A bucket's study:
1. The default heuristic schedules (the backend's `default` for every candidate kind, and the runtime's
   choice among them) are enqueued first, so the study starts from what a model gets untuned; then the
   seeds: tune_block passes the table's earlier winner of this bucket (current or stale: a re-tune after
   a kernel change starts from it) and the winners of the two neighbouring buckets.
2. TPE (multivariate, grouped for the conditional kind → parameters space, constant liar) asks a batch
   of candidates; they are built in parallel on the CPU cores (a thread pool over `build`), then each
   is checked against the float32 reference and timed one after the other (objective.py).
   After each round, a new fastest candidate's one-knob neighbours (one more stage, split-K on, the
   next tile size: `SearchSpace.neighbours`) are enqueued ahead of TPE's next points: a local search
   from the incumbent, which TPE alone reaches slowly in a space of a dozen knobs.
3. It stops when the best is within `margin` of the bucket's floor, when `patience` trials in a row
   bring no improvement, when every point of the space has been tried, or when its budget is spent.
4. The best few are re-timed back to back with the default (`retime_rounds` rounds, every other one in
   reverse order; a finalist's time is the median of its search time and those rounds: two timings of
   one kernel differ by up to 3 % on the H200, e.g. 1194.0 and 1230.0 µs for mixtral-8x7b's default at
   T = 806), and timed at the bucket's first and last token counts too, and in a bucket spanning ≥ 1.5×
   at `interior_counts` more between them: the one that loses least against the fastest at each count
   is the winner (a bucket can straddle a tile boundary: mixtral-8x7b [305, 633] spans 76–158 rows per
   expert around the 128-row tile). It is written to the
   dispatch table with its time at the representative count, floor, % of floor, default time and
   baseline time. On a GPU, where the winner is still `split_loss` (5 %) slower than another finalist at
   some count, the bucket is written as 2 or 3 parts instead, each with the finalist fastest over its
   counts (`split_parts`; deepseek-v3 [590, 1024] on the H200: the winner 4 % faster at T = 590, 7 % slower
   at T = 1024). A written entry replaces the older entries it overlaps (a bucket split, or re-tuned whole).

With `storage` (an RDB URL or a journal file) several `moetune tune` workers share each study: each
asks its own trials, skips points another worker already scored, and writes the study's winner.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import socket
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..codegen.backend import Backend, get
from ..ir import Bucket, IRError, MoEBlock, Roofline, Schedule, UnsupportedSchedule
from ..passes.targets import floor as target_floor
from ..runtime.table import DispatchEntry, DispatchTable
from ..runtime.versions import Versions
from .baseline import baseline_fn, default_baseline
from .objective import Objective, Outcome, RoutingSampler, expert_tensors, make_cases, trace_sampler
from .space import SearchSpace, build_space, cap_space, key
from .timing import Case, Timer, timer_for


@dataclass(frozen=True)
class TuneOptions:
    budget_s: float = 60.0  # per bucket (tune_block splits its total)
    margin: float = 0.1  # stop once the best reaches (1 - margin) of the floor
    patience: int = 24  # stop after this many trials in a row without a 1 % improvement
    min_gain: float = 0.01
    max_trials: int = 400
    build_workers: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    batch: int = 0  # candidates asked per round (0: build_workers, at least 2)
    routings: int = 0  # timing cases rotated through (0: 32 on a GPU, 8 on CPU)
    retime: int = 3  # best candidates re-timed against the default at the end
    retime_rounds: int = 2  # back-to-back rounds of that re-time (order reversed every other round)
    baseline: str | None = None  # transformers experts function (None: batched_mm on GPU, grouped_mm on CPU)
    seed: int = 0
    strict: bool = False
    keep_going: bool = False
    storage: object = None  # RDB URL, journal file, or an optuna storage; shared by workers
    exhaustive: bool = False  # every point of the space, no early stop (to check TPE against a grid)
    space_cap: int | None = None  # tune a sub-grid of ≤ this many points per bucket (space.cap_space)
    warm_in_build: bool | None = None  # launch each candidate once in the build pool (None: on GPUs)
    device: str | None = None  # None: cuda for GPU backends, cpu for torch
    resume: bool = False  # keep buckets whose table entry is current here (same device, kernels, version)
    revalidate: bool = False  # as resume, and a stale entry's winner is re-checked beside the defaults, no search
    time_limit_s: float | None = None  # wall clock of a whole tune_block: no bucket starts that would pass it
    edge_timing: bool = True  # finalists also timed at the bucket's first and last T; least total loss wins
    interior_counts: int = 2  # with edge_timing, in a bucket spanning ≥ 1.5×: this many counts between too
    split_loss: float = 0.05  # with edge_timing: where the winner is this much slower than another finalist
    # at a count timed, the bucket is cut in 2 or 3 parts with a finalist each (split_parts)
    split: bool | None = None  # whether to (None: on a GPU only; CPU timings vary by more than split_loss)
    local_search: bool = True  # each new incumbent's one-knob neighbours are tried before TPE's next points

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise UnsupportedSchedule(f"TuneOptions.margin = {self.margin}: need 0 ≤ margin < 1")
        if self.budget_s <= 0:
            raise UnsupportedSchedule(f"TuneOptions.budget_s = {self.budget_s}: need a positive budget")
        if self.retime_rounds < 1:
            raise UnsupportedSchedule(f"TuneOptions.retime_rounds = {self.retime_rounds}: need ≥ 1")
        if self.interior_counts < 0:
            raise UnsupportedSchedule(f"TuneOptions.interior_counts = {self.interior_counts}: need ≥ 0")
        if self.split_loss <= 0:
            raise UnsupportedSchedule(f"TuneOptions.split_loss = {self.split_loss}: need > 0 (split=False: never)")
        if self.space_cap is not None and self.space_cap < 1:
            raise UnsupportedSchedule(f"TuneOptions.space_cap = {self.space_cap}: need at least 1 point "
                                      "(None: the whole space)")


@dataclass(frozen=True)
class BucketResult:
    bucket: tuple[int, int]
    tokens: int  # the token count timed (the floor's)
    winner: Schedule | None
    time_s: float
    floor: Roofline | None
    default: Schedule | None
    default_time_s: float | None
    baseline: str
    baseline_time_s: float | None
    trials: int  # trials of the study (all workers)
    evaluated: int  # candidates this worker built, checked and timed
    failures: dict[str, int]
    stopped: str
    space: str
    written: bool = False
    # the final round: (candidate, time at the representative T, {edge T: time}), winner first
    finalists: tuple[tuple[Schedule, float, dict[int, float]], ...] = ()
    # a split bucket (TuneOptions.split_loss): every part as (lo, hi, its winner, its time, the T timed), in
    # order; these are the table's entries then. Empty: the bucket was not split.
    parts: tuple[tuple[int, int, Schedule, float, int], ...] = ()

    @property
    def pct_of_floor(self) -> float | None:
        if self.floor is None or not math.isfinite(self.time_s):
            return None
        return 100.0 * self.floor.time_s / self.time_s


@dataclass(frozen=True)
class BucketInputs:
    """What a bucket's candidates run on: timing cases at `tokens`, checks at `check_tokens`."""

    tokens: int
    cases: tuple[Case, ...]
    check_tokens: tuple[int, ...]
    sampler: RoutingSampler | None = None


def representative_tokens(bucket: Bucket) -> int:
    """The token count a bucket is timed at: its floor's (or its statistics'), else the geometric middle."""
    if bucket.floor is not None and bucket.floor.tokens in bucket:
        return bucket.floor.tokens
    if bucket.stats is not None:
        return bucket.stats.tokens
    return max(bucket.lo, min(bucket.hi, round(math.sqrt(bucket.lo * bucket.hi))))


def bucket_inputs(block: MoEBlock, bucket: Bucket, w, *, routings: int, seed: int = 0,
                  sampler: RoutingSampler | None = None) -> BucketInputs:
    T = representative_tokens(bucket)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + bucket.lo)
    cases = make_cases(block, w, T, routings, gen, sampler)
    return BucketInputs(T, tuple(cases), tuple(sorted({bucket.lo, T, bucket.hi})), sampler)


def open_storage(storage):
    """None → in memory (this study only); "sqlite:///…", "postgresql://…" → RDB; another string → a
    journal file; an Optuna storage object is used as it is."""
    if storage is None or not isinstance(storage, str | os.PathLike):
        return storage
    import optuna

    storage = str(storage)
    if "://" in storage:
        # Workers starting together may race to create the schema: the loser retries.
        deadline = time.monotonic() + 60
        while True:
            try:
                return optuna.storages.RDBStorage(storage)
            except Exception:  # noqa: BLE001 - sqlalchemy's errors; re-raised once the minute is spent
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1 + 0.2 * (os.getpid() % 5) / 5)

    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))


def default_schedules(block: MoEBlock, backend: Backend, space: SearchSpace, tokens: int,
                      first: Schedule | None = None) -> list[Schedule]:
    """The backend's heuristic schedule of every kind in the space (those inside it), `first` first. A
    hybrid default takes the bucket's row threshold nearest its own (the passes choose R per bucket)."""
    out = [first] if first is not None and space.contains(first) else []
    for ks in space.kinds:
        try:
            s = backend.default(block, ks.kind, tokens)
        except UnsupportedSchedule:
            continue
        s = _fit(space, s)
        if ks.row_thresholds and s.row_threshold is not None and s.row_threshold not in ks.row_thresholds:
            nearest = min(ks.row_thresholds, key=lambda r, own=s.row_threshold: abs(r - own))
            s = dataclasses.replace(s, row_threshold=nearest)
        if space.contains(s) and s not in out:
            out.append(s)
    return out


def runtime_default(block: MoEBlock, backend: Backend, bucket: Bucket) -> Schedule | None:
    """What a compiled model runs in `bucket` with no table entry (moetune.runtime.default), or, where
    that module is absent, the backend's parameters for the passes' default kind."""
    try:
        from ..runtime import default as rd

        return rd.default_schedule(block, backend, rd.representative_tokens(bucket.lo, bucket.hi))
    except (ImportError, AttributeError):
        pass
    except UnsupportedSchedule:
        return None
    if bucket.schedule is None:
        return None
    try:
        s = backend.default(block, bucket.schedule.kind, representative_tokens(bucket))
    except UnsupportedSchedule:
        return None
    if bucket.schedule.row_threshold is not None:
        s = dataclasses.replace(s, row_threshold=bucket.schedule.row_threshold)
    return s


class _Study:
    """One bucket's Optuna study driven with ask/tell."""

    def __init__(self, name: str, space: SearchSpace, options: TuneOptions):
        try:
            import optuna
        except ImportError as e:
            raise UnsupportedSchedule("moetune tune needs Optuna: pip install 'moetune[tune]' "
                                      f"(optuna==5.0.0); {e}") from e

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(seed=options.seed, multivariate=True, group=True,
                                                 constant_liar=True, n_startup_trials=8)
        self.optuna = optuna
        self.space = space
        self.study = optuna.create_study(study_name=name, storage=open_storage(options.storage),
                                         sampler=sampler, direction="minimize", load_if_exists=True)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self._check_resumed(name, options.storage)

    def _check_resumed(self, name: str, storage) -> None:
        """A study resumed from `storage` must have been sampled over this search space: Optuna cannot
        widen a categorical, and its own error names neither the study nor the file."""
        ours = self.space.distributions()
        for t in self.study.get_trials(deepcopy=False):
            for n, d in t.distributions.items():
                if n in ours and tuple(getattr(d, "choices", ())) != ours[n]:
                    raise UnsupportedSchedule(
                        f"--storage {storage}: study {name!r} sampled {n} over {tuple(d.choices)}, this "
                        f"moetune's search space has {ours[n]} (its kernels' spaces changed since); tune "
                        "into a new storage file")

    def enqueue(self, schedules: Sequence[Schedule]) -> None:
        for s in schedules:
            self.study.enqueue_trial(self.space.params_of(s), skip_if_exists=True)

    def scored(self) -> dict[str, float]:
        """key → value of every completed trial of the study (every worker's)."""
        out = {}
        states = (self.optuna.trial.TrialState.COMPLETE,)
        for t in self.study.get_trials(deepcopy=False, states=states):
            try:
                out.setdefault(key(self.space.schedule_of(t.params)), t.value)
            except (UnsupportedSchedule, KeyError, ValueError):
                continue
        return out

    def fail(self, trial) -> None:
        try:
            self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
        except (ValueError, self.optuna.exceptions.UpdateFinishedTrialError):
            pass

    def tell(self, trial, outcome: Outcome, duplicate: bool = False) -> None:
        try:
            self._tell(trial, outcome, duplicate)
        except (ValueError, self.optuna.exceptions.UpdateFinishedTrialError):
            # An RDB storage on SQLite can hand one enqueued trial to two workers; the other one told it.
            pass

    def _tell(self, trial, outcome: Outcome, duplicate: bool) -> None:
        trial.set_user_attr("status", outcome.status)
        trial.set_user_attr("schedule", outcome.schedule.describe())
        trial.set_user_attr("worker", self.worker)
        if outcome.reason:
            trial.set_user_attr("reason", outcome.reason[:4000])
        if outcome.rel_err is not None:
            trial.set_user_attr("rel_err", outcome.rel_err)
        if duplicate:
            trial.set_user_attr("duplicate", True)
        if outcome.timing is not None:
            trial.set_user_attr("spread_us", outcome.timing.spread_s * 1e6)
            trial.set_user_attr("build_s", outcome.build_s)
        self.study.tell(trial, outcome.time_s)


def tune_bucket(block: MoEBlock, backend: Backend, target: str, bucket: Bucket, inputs: BucketInputs,
                timer: Timer, options: TuneOptions, *, table: DispatchTable | None = None,
                versions: Versions | None = None,
                progress: Callable[[dict], None] | None = None,
                seeds: Sequence[Schedule] = (), first_only: bool = False) -> BucketResult:
    """Tune one bucket (see the module doc); write the winner to `table` when given. `seeds` (those inside
    this bucket's space) are tried right after the defaults; with `first_only`, nothing else is (no
    search: `--revalidate` re-checks and re-times a stale winner beside the defaults)."""
    t_start = time.monotonic()
    deadline = t_start + options.budget_s
    space = build_space(block, backend, bucket)
    default = _fit(space, runtime_default(block, backend, bucket))
    if options.space_cap:  # the same sub-grid for TPE and --exhaustive: centred on the defaults
        space = cap_space(space, options.space_cap,
                          default_schedules(block, backend, space, inputs.tokens, first=default))
    objective = Objective(block, backend, timer, inputs.cases, inputs.check_tokens, sampler=inputs.sampler,
                          seed=options.seed + bucket.lo, strict=options.strict, keep_going=options.keep_going,
                          warm_in_build=options.warm_in_build)
    floor = bucket.floor
    floor_s = floor.time_s if floor is not None else 0.0
    name = f"moetune:{target}:{backend.name}:{block.signature_hash()}:{bucket.lo}-{bucket.hi}"
    if options.space_cap and space.full_size is not None:  # a capped space is a study of its own
        name += f":cap{options.space_cap}"
    st = _Study(name, space, options)
    first = default_schedules(block, backend, space, inputs.tokens, first=default)
    first += [_fit(space, s) for s in seeds if space.contains(s)]
    st.enqueue(first)
    if options.exhaustive:
        st.enqueue([s for s in space.grid() if isinstance(s, Schedule)])

    outcomes: dict[str, Outcome] = {}
    refused: set[str] = set()  # parameter combinations the backend's params class refuses
    failures: dict[str, int] = {}
    best, since_best, stopped = math.inf, 0, ""
    untried = _Untried(st, space, options.seed)
    climbed: set[str] = set()  # incumbents whose neighbours were enqueued
    batch = len({key(s) for s in first}) if first_only else options.batch or max(2, options.build_workers)
    pool = ThreadPoolExecutor(max_workers=options.build_workers, thread_name_prefix="moetune-build")
    try:
        while not stopped:
            scored = st.scored() if options.storage else {}
            todo: list[tuple] = []  # (trial, schedule, key) to build, check and time this round
            for _ in range(batch):
                trial = st.study.ask()
                try:
                    s = space.suggest(trial)
                except st.optuna.exceptions.UpdateFinishedTrialError:
                    continue  # an RDB storage on SQLite handed this enqueued trial to another worker, who told it
                except UnsupportedSchedule as e:
                    st.tell(trial, Outcome(_placeholder(trial), "refused", reason=str(e)))
                    if repr(sorted(trial.params.items())) not in refused:
                        refused.add(repr(sorted(trial.params.items())))
                        failures["refused"] = failures.get("refused", 0) + 1
                    since_best += 1
                    continue
                k = key(s)
                if k in outcomes or k in scored:
                    prior = outcomes.get(k) or Outcome(s, "scored elsewhere", scored[k])
                    st.tell(trial, prior, duplicate=True)
                    untried.suggest_one(set(outcomes) | set(scored) | {t[2] for t in todo})
                else:
                    todo.append((trial, s, k))
            builds = list(pool.map(objective.build, [s for _, s, _ in todo]))  # parallel, ahead of timing
            told = 0
            try:
                for (trial, s, k), built in zip(todo, builds, strict=True):
                    out = objective.evaluate(s, built)
                    outcomes[k] = out
                    st.tell(trial, out)
                    told += 1
                    if not out.ok:
                        failures[out.status] = failures.get(out.status, 0) + 1
                    if out.time_s < best * (1 - options.min_gain):
                        best, since_best = out.time_s, 0
                    else:
                        since_best += 1
                        best = min(best, out.time_s)
                    if progress:
                        progress({"bucket": (bucket.lo, bucket.hi), "evaluated": len(outcomes),
                                  "best_s": best, "floor_s": floor_s, "last": out})
            except BaseException:
                for trial, _, _ in todo[told:]:
                    st.fail(trial)
                raise
            if options.local_search and not first_only and not options.exhaustive:
                _climb(st, space, outcomes, scored, climbed)
            n_trials = len(st.study.trials)
            tried = len(set(outcomes) | set(scored))
            if untried.size == space.size():  # not listed: params refusals count as tried points
                tried += len(refused)
            if first_only:
                stopped = "revalidated: the stored winner re-checked and re-timed beside the defaults, no search"
            elif floor_s and best <= floor_s / (1 - options.margin) and not options.exhaustive:
                stopped = f"within {options.margin:.0%} of the floor"
            elif since_best >= options.patience and not options.exhaustive:
                stopped = f"no {options.min_gain:.0%} gain in {since_best} trials"
            elif tried >= untried.size:
                stopped = f"space exhausted ({untried.size} points)"
            elif n_trials >= options.max_trials and not options.exhaustive:
                stopped = f"{n_trials} trials"
            elif time.monotonic() >= deadline:
                stopped = f"budget {options.budget_s:.0f} s spent"
    finally:
        pool.shutdown(wait=True)
    if default is not None and key(default) not in outcomes:  # outside the space: measured all the same
        outcomes[key(default)] = objective.evaluate(default)

    edges = None
    if options.edge_timing and bucket.lo < bucket.hi:
        gen = torch.Generator().manual_seed(options.seed * 1_000_003 + bucket.hi + 17)
        edges = {t: make_cases(block, objective.w, t, len(inputs.cases), gen, inputs.sampler)
                 for t in probe_counts(bucket.lo, bucket.hi, inputs.tokens, options.interior_counts)}
    winner, win_s, default_s, finals = _final(st, space, objective, outcomes, default, options, edges)
    bname = options.baseline or default_baseline(objective.device)
    base_fn, blabel = baseline_fn(block, bname)
    base_s = None
    if base_fn is not None:
        try:
            base_s = objective.time_fn(base_fn).median_s
        except Exception as e:  # noqa: BLE001 - a baseline that cannot be timed here is reported, not fatal
            base_fn, blabel = None, f"{blabel} failed: {type(e).__name__}: {e}"[:200]
    result = BucketResult(
        bucket=(bucket.lo, bucket.hi), tokens=inputs.tokens, winner=winner, time_s=win_s, floor=floor,
        default=default, default_time_s=default_s,
        baseline=blabel if base_fn is not None else f"none ({blabel})",
        baseline_time_s=base_s, trials=len(st.study.trials), evaluated=len(outcomes), failures=failures,
        stopped=stopped, space=space.describe(), finalists=finals,
    )
    split = options.split if options.split is not None else objective.device.startswith("cuda")
    if split and winner is not None:
        result = _replace(result, parts=split_parts(bucket.lo, bucket.hi, inputs.tokens, finals, options.split_loss))
    if table is not None and winner is not None:
        versions = versions or Versions.current(backend.name, objective.device)
        common = dict(target=target, block=block, versions=versions, baseline=result.baseline,
                      timer=getattr(timer, "name", type(timer).__name__), trials=result.trials)
        if not result.parts:
            entry = DispatchEntry.of(
                bucket=result.bucket, schedule=winner, time_us=win_s * 1e6,
                floor_us=floor_s * 1e6 if floor is not None else None,
                default_time_us=None if default_s is None else default_s * 1e6,
                baseline_time_us=None if base_s is None else base_s * 1e6, **common)
            replace = _judged_here(table, entry, block, outcomes, space)
            result = _replace(result, written=table.put(entry, replace=replace, supersede=True))
        else:  # each part's entry replaces what overlaps it: it was chosen against those finalists here
            d_row = next(({inputs.tokens: t} | e for f, t, e in finals
                          if default is not None and key(f) == key(default)), {})
            written = False
            for lo, hi, s, t_s, T in result.parts:
                d_at = d_row.get(T)
                entry = DispatchEntry.of(
                    bucket=(lo, hi), schedule=s, time_us=t_s * 1e6,
                    floor_us=floor_s * 1e6 if floor is not None and T == inputs.tokens else _floor_us(block, target, T),
                    default_time_us=None if d_at is None else d_at * 1e6,
                    baseline_time_us=base_s * 1e6 if base_s is not None and T == inputs.tokens else None, **common)
                written = table.put(entry, replace=True, supersede=True) or written
            result = _replace(result, written=written)
    return result


def _floor_us(block: MoEBlock, target: str, tokens: int) -> float | None:
    """The roofline floor at `tokens` on a known target (uniform routing), µs; None for another target.
    For a split bucket's parts away from the representative T (that part keeps the bucket's own floor)."""
    try:
        return target_floor(block, target, tokens).time_s * 1e6
    except IRError:
        return None


def split_parts(lo: int, hi: int, rep: int, finals, loss: float) -> tuple[tuple[int, int, Schedule, float, int], ...]:
    """Parts of bucket [lo, hi] from its final round (`_final`'s finals: (schedule, time at rep, {T: time}),
    the winner first), when the winner is more than `loss` slower than another finalist at some count timed.
    The counts are then cut into 2 or 3 runs, each served by the finalist with the least total log-loss at
    its counts: the fewest runs that bring every count within `loss` of its fastest finalist, else the cut
    with the smallest worst loss (only if it is smaller than the winner's). Each part is timed at its middle
    count (the part holding `rep` at `rep`); boundaries fall at the geometric middle between neighbouring
    counts; neighbouring runs with one finalist are one part. () when the bucket stays whole (one part).
    On the H200, deepseek-v3 [590, 1024]'s winner was 4 % faster than the default at T = 590 and 7 % slower
    at T = 1024 (bench/results/NOTES.md, session 9)."""
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


def _climb(st: _Study, space: SearchSpace, outcomes: dict[str, Outcome], scored: dict, climbed: set[str]) -> None:
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


class _Untried:
    """When TPE proposes a point already scored, enqueue a random untried one instead (small spaces)."""

    LIMIT = 20000

    def __init__(self, st: _Study, space: SearchSpace, seed: int):
        import random

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
                self.st.study.enqueue_trial(self.space.params_of(s), skip_if_exists=True)
                return


def _placeholder(trial) -> Schedule:
    """A Schedule to hang a refusal on when the sampled parameters could not make one."""
    kind = trial.params.get("kind", "grouped_gemm")
    rt = trial.params.get(f"{kind}:row_threshold") if kind == "hybrid" else None
    if kind != "hybrid":
        return Schedule(kind)
    return Schedule(kind, row_threshold=rt if isinstance(rt, int) and rt >= 2 else 2)


def _replace(r: BucketResult, **kw) -> BucketResult:
    return dataclasses.replace(r, **kw)


def probe_counts(lo: int, hi: int, rep: int, interior: int) -> list[int]:
    """The token counts a bucket's finalists are timed at besides the representative `rep`: the first
    and the last, and in a bucket spanning ≥ 1.5× `interior` more at even ratios between them, each more
    than 5 % away from `rep`. Tile and wave boundaries fall inside wide buckets: mixtral-8x7b [305, 633]
    (representative 439) holds the 128-row tile boundary at T = 512, where on the H200 its winner timed
    0.94× the best bench variant (bench/results/NOTES.md, session 8)."""
    pts = {lo, hi}
    if interior > 0 and hi >= 1.5 * lo:
        inner = {round(lo * (hi / lo) ** (i / (interior + 1))) for i in range(1, interior + 1)}
        pts |= {t for t in inner if abs(t - rep) > 0.05 * rep}
    pts.discard(rep)
    return sorted(t for t in pts if lo <= t <= hi)


def _final(st: _Study, space: SearchSpace, objective: Objective, outcomes: dict[str, Outcome],
           default: Schedule | None, options: TuneOptions, edges: dict[int, list[Case]] | None = None):
    """Re-time the best few (every worker's) beside the default, back to back; the fastest wins. With
    `edges` (cases at the bucket's first and last token counts and, in a wide bucket, some between:
    `probe_counts`), each finalist is timed there too and the one that loses least over all the counts
    wins (`_robust`); its time is still the representative count's."""
    ranked = sorted((t for t in st.study.trials if t.value is not None and math.isfinite(t.value)),
                    key=lambda t: t.value)
    finalists: dict[str, Schedule] = {}
    for t in ranked:
        try:
            s = space.schedule_of(t.params)
        except (UnsupportedSchedule, KeyError, ValueError):
            continue
        finalists.setdefault(key(s), s)
        if len(finalists) >= options.retime:
            break
    dk = key(default) if default is not None else None
    default_ok = default is not None and dk in outcomes and outcomes[dk].ok
    if default_ok:
        finalists.setdefault(dk, default)
    if not finalists:
        return None, math.inf, None, ()
    if len(finalists) == 1 and not options.storage:
        (k, s), = finalists.items()
        t = outcomes[k].time_s if k in outcomes else objective.evaluate(s).time_s
        return s, t, (t if k == dk else None), ((s, t, {}),)
    times: dict[str, list[float]] = {}
    fns = {}
    for k, s in finalists.items():
        out = outcomes.get(k)
        if out is None or not out.ok:  # another worker's candidate: check it here before trusting it
            out = objective.evaluate(s)
            if not out.ok:
                continue
        times[k] = [out.time_s]
        fns[k] = objective.build(s).fn
    for r in range(options.retime_rounds):  # back to back; every other round in reverse, so drift cancels
        for k in (list(times) if r % 2 == 0 else list(times)[::-1]):
            times[k].append(objective.timer(fns[k], objective.timing_cases, finalists[k]).median_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    wk = min(med, key=med.get)
    at_edges: dict[int, dict[str, float]] = {}
    if edges and len(med) > 1:
        def at(k: str, cases) -> float:
            try:
                return objective.timer(fns[k], cases, finalists[k]).median_s
            except Exception:  # noqa: BLE001 - checked at the edges already; a launch failure there only disqualifies
                return math.inf

        at_edges = {t: {k: at(k, cases) for k in med} for t, cases in edges.items()}
        wk = _robust(med, at_edges)
    order = [wk] + sorted((k for k in med if k != wk), key=med.get)
    finals = tuple((finalists[k], med[k], {t: r[k] for t, r in at_edges.items()}) for k in order)
    return finalists[wk], med[wk], (med[dk] if default_ok and dk in med else None), finals


def _robust(at_rep: dict[str, float], at_edges: dict[int, dict[str, float]]) -> str:
    """The finalist with the least geometric-mean slowdown against the fastest at each token count timed
    (the representative one, the bucket's edges and the counts between them): a winner must hold over
    the whole bucket, not only where it was searched (a tile boundary inside a bucket can flip the order).
    Ties: the faster at the representative count."""
    rows = [r for r in (at_rep, *at_edges.values()) if math.isfinite(min(r.values()))]

    def regret(k: str) -> float:
        return math.fsum(math.log(r[k] / min(r.values())) if math.isfinite(r[k]) else math.inf
                         for r in rows) / len(rows)

    return min(at_rep, key=lambda k: (round(regret(k), 6), at_rep[k]))


def tune_block(block: MoEBlock, backend: str, target: str, tokens: tuple[int, int] = (1, 1024), *,
               trace=None, timer: Timer | None = None, table: DispatchTable | None = None,
               options: TuneOptions | None = None, budget_s: float | None = None,
               progress: Callable[[dict], None] | None = None,
               on_bucket: Callable[[int, int, BucketResult], None] | None = None,
               at_tokens: Sequence[int] | None = None) -> list[BucketResult]:
    """Tune every bucket the passes make of `block` on `tokens`; `budget_s` is shared by all buckets.
    With `at_tokens`, only the buckets (of the whole range) holding one of those token counts."""
    from ..passes.pipeline import schedule_block
    from ..passes.trace import Trace

    options = options or TuneOptions()
    be = get(backend)
    why = be.available()
    if why:
        raise UnsupportedSchedule(f"backend {backend} is not usable here: {why}")
    device = options.device or ("cpu" if backend == "torch" else "cuda")
    timer = timer or timer_for(device)
    block = block.replace(T_max=max(block.T_max, tokens[1])) if block.T_max < tokens[1] else block
    sb = schedule_block(block, target, trace=trace, tokens=tokens)
    buckets = [b for b in sb.buckets if b.hi >= tokens[0] and b.lo <= tokens[1]]
    every = list(buckets)  # before --at-tokens: the neighbours a bucket is seeded from
    if at_tokens is not None:
        buckets = [b for b in buckets if any(b.lo <= t <= b.hi for t in at_tokens)]
    sampler = None
    if isinstance(trace, str | os.PathLike):
        trace = Trace.load(trace)
    if trace is not None:
        import numpy as np

        sampler = trace_sampler(block, torch.from_numpy(np.concatenate(trace.pools()).astype(np.int64)))
    w = expert_tensors(block, device, seed=options.seed)
    routings = options.routings or (32 if device.startswith("cuda") else 8)
    versions = Versions.current(be.name, device) if table is not None else None
    total = budget_s if budget_s is not None else options.budget_s * len(buckets)
    t0 = time.monotonic()
    results = []
    kept = {}
    if (options.resume or options.revalidate) and table is not None:
        from ..runtime.versions import judge

        for b in buckets:
            es = table.parts(target, be.name, block.signature_hash(), b.lo, b.hi)  # its entry, or a split's parts
            if es and all(judge(e, versions) is None for e in es):
                kept[(b.lo, b.hi)] = es
    last_s = 0.0  # wall time of the last bucket tuned: the estimate of the next one
    for i, b in enumerate(buckets):
        now = time.monotonic() - t0
        if (options.time_limit_s is not None and (b.lo, b.hi) not in kept and results
                and now + last_s > options.time_limit_s):
            r = BucketResult((b.lo, b.hi), representative_tokens(b), None, math.inf, b.floor, None, None, "–",
                             None, 0, 0, {}, f"not tuned: time limit {options.time_limit_s:.0f} s "
                             f"(the last bucket took {last_s:.0f} s, {now:.0f} s spent); rerun with resume", "")
            results.append(r)
            if on_bucket:
                on_bucket(i, len(buckets), r)
            continue
        if (b.lo, b.hi) in kept:  # resumed: the table already holds this bucket's current winner(s)
            es, rep = kept[(b.lo, b.hi)], representative_tokens(b)
            e = next(p for p in es if p.bucket_lo <= rep <= p.bucket_hi)
            parts = () if len(es) == 1 else tuple(
                (p.bucket_lo, p.bucket_hi, p.schedule(block), p.time_us * 1e-6,
                 rep if p is e else round(math.sqrt(p.bucket_lo * p.bucket_hi))) for p in es)
            r = BucketResult((b.lo, b.hi), rep, e.schedule(block), e.time_us * 1e-6, b.floor, None,
                             None if e.default_time_us is None else e.default_time_us * 1e-6,
                             e.baseline or "–", None if e.baseline_time_us is None else e.baseline_time_us * 1e-6,
                             e.trials or 0, 0, {}, f"kept: current table entr{'ies' if parts else 'y'} tuned "
                             f"{e.tuned_at}", "", parts=parts)
            results.append(r)
            if on_bucket:
                on_bucket(i, len(buckets), r)
            continue
        left = total - (time.monotonic() - t0)
        share = max(left / sum(1 for c in buckets[i:] if (c.lo, c.hi) not in kept), 1e-3)
        if options.time_limit_s is not None:
            share = max(min(share, options.time_limit_s - now), 1e-3)
        t_bucket = time.monotonic()
        opts = _replace_opts(options, budget_s=share, device=device)
        inputs = bucket_inputs(block, b, w, routings=routings, seed=options.seed, sampler=sampler)
        try:
            recheck = options.revalidate and table is not None and table.get(
                target, be.name, block.signature_hash(), b.lo, b.hi) is not None
            r = tune_bucket(block, be, target, b, inputs, timer, opts, table=table, versions=versions,
                            progress=progress, seeds=_seeds(block, table, target, be.name, every, b, results),
                            first_only=recheck)
        except UnsupportedSchedule as e:  # nothing to tune here: the runtime keeps its default
            if options.strict:
                raise
            r = BucketResult((b.lo, b.hi), inputs.tokens, None, math.inf, b.floor, None, None, "–", None,
                             0, 0, {}, f"not tuned: {e}", "")
        results.append(r)
        last_s = time.monotonic() - t_bucket
        if on_bucket:
            on_bucket(i, len(buckets), r)
    return results


def _fit(space: SearchSpace, s: Schedule | None) -> Schedule | None:
    """`s` with the fusion the passes chose for its kind in this bucket. Fusion is the IR's record of
    which steps share a kernel, decided per bucket by the fusion pass, not a knob of the kernels: a stored
    winner or the runtime's default labelled otherwise is the same kernel, and timed once, not twice."""
    if s is None or not any(ks.kind == s.kind for ks in space.kinds):
        return s
    f = space.kind(s.kind).fusion
    return s if s.fusion == f else dataclasses.replace(s, fusion=f)


def _judged_here(table: DispatchTable, entry: DispatchEntry, block: MoEBlock, outcomes: dict[str, Outcome],
                 space: SearchSpace) -> bool:
    """Whether this study measured the table's stored winner of the entry's bucket itself (it is a seed):
    then its own winner replaces it even when slower at the representative T (chosen over the edges too)."""
    from ..runtime.table import CacheError

    old = table.get(entry.target, entry.backend, entry.signature, entry.bucket_lo, entry.bucket_hi)
    if old is None:
        return False
    try:
        return key(_fit(space, old.schedule(block))) in outcomes
    except CacheError:
        return False


def _seeds(block: MoEBlock, table: DispatchTable | None, target: str, backend: str, every: Sequence[Bucket],
           b: Bucket, results: Sequence[BucketResult]) -> list[Schedule]:
    """Schedules worth trying first in bucket b: its own earlier winner(s) in the table (current or stale;
    a split bucket's parts), then the winners of the buckets just below and above it in `every` (this
    run's result, else the table's entries). Entries whose schedule the backend can no longer rebuild are skipped."""
    from ..runtime.table import CacheError

    done = {r.bucket: r.winner for r in results if r.winner is not None}
    i = next(j for j, c in enumerate(every) if (c.lo, c.hi) == (b.lo, b.hi))
    out: list[Schedule | DispatchEntry | None] = []
    for j in (i, i - 1, i + 1):
        if not 0 <= j < len(every):
            continue
        c = every[j]
        if j != i and (c.lo, c.hi) in done:
            out.append(done[(c.lo, c.hi)])
        elif table is not None:  # its entry, or the parts of a split bucket
            out.extend(table.parts(target, backend, block.signature_hash(), c.lo, c.hi))
    seeds, seen = [], set()
    for s in out:
        if isinstance(s, DispatchEntry):
            try:
                s = s.schedule(block)
            except CacheError:
                continue
        if s is not None and key(s) not in seen:
            seen.add(key(s))
            seeds.append(s)
    return seeds


def _replace_opts(o: TuneOptions, **kw) -> TuneOptions:
    return dataclasses.replace(o, **kw)
