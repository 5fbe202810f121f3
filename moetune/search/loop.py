"""The round loop of one bucket's study, and the share of the budget it runs in.

Each round TPE asks a batch of candidates; they are built in a thread pool ahead of timing (a backend that
compiles at first launch compiles there, with `warm_in_build`), and each is checked and timed on this
thread as soon as its build is done. Before every evaluation the loop asks its `Share` whether the next
one still fits: the estimate is what this bucket measured so far (check and timing, plus the build when
it is not done yet), or before the first one what earlier buckets measured, scaled to this one's token
counts. The loop stops for one reason, `stop_reason`, which says what happened.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..ir import UnsupportedSchedule
from .objective import Built, Objective, Outcome
from .options import TuneOptions
from .seeds import Untried, climb
from .space import SearchSpace, key
from .study import Study, placeholder
from .watchdog import CandidateTimeout, Job, Pool


class Share:
    """One bucket's share of the budget: its end, and what its evaluations and timer calls cost here."""

    def __init__(self, seconds: float, first_estimate: float | None = None, clock=time.monotonic):
        self.clock = clock
        self.start = clock()
        self.seconds = seconds
        self.end = self.start + seconds
        self.first_estimate = first_estimate  # one candidate here, from earlier buckets (None: none measured)
        self.evals: list[float] = []  # wall time of each check + timing
        self.builds: list[float] = []  # build seconds (in the pool)
        self.timings: list[float] = []  # wall time of each timer call (the objective's `timer_wall`)

    def left(self) -> float:
        return self.end - self.clock()

    def spent(self) -> float:
        return self.clock() - self.start

    def eval_s(self) -> float:
        """The expected wall time of the next check + timing (0 before anything was measured)."""
        if self.evals:
            return statistics.fmean(self.evals[-8:])
        return self.first_estimate or 0.0

    def build_s(self) -> float:
        return statistics.fmean(self.builds[-8:]) if self.builds else 0.0

    def timing_s(self) -> float:
        """The expected wall time of one timer call at the representative count."""
        if self.timings:
            return statistics.fmean(self.timings[-8:])
        return self.eval_s()

    def fits(self, seconds: float, reserve: float = 0.0) -> bool:
        return self.clock() + seconds <= self.end - reserve

    def reserve(self, finalists: int, rounds: int, counts: int) -> float:
        """What the final round is expected to take (re-time, edge counts, baseline), at most a third of
        the share: the loop leaves it free."""
        calls = finalists * (rounds + counts) + 1
        return min(calls * self.timing_s(), self.seconds / 3)


@dataclass
class LoopState:
    """What the round loop leaves for the final round."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    stopped: str = ""


Progress = Callable[[dict], None]


def run_rounds(st: Study, space: SearchSpace, objective: Objective, options: TuneOptions, share: Share, *,
               batch: int, first_only: bool, floor_s: float, reserve: Callable[[], float],
               progress: Progress | None = None, event: dict | None = None) -> LoopState:
    """Ask, build, check and time rounds of candidates until one stop reason holds (see the module doc).
    `reserve()`: the seconds to leave free for the final round, as measured so far."""
    state = LoopState()
    outcomes, failures = state.outcomes, state.failures
    refused: set[str] = set()  # parameter combinations the backend's params class refuses
    best, since_best = math.inf, 0
    untried = Untried(st, space, options.seed)
    climbed: set[str] = set()  # incumbents whose neighbours were enqueued
    pool = Pool(options.build_workers, options.candidate_timeout_s)  # a hung build gives its slot back

    def budget_stop(next_s: float) -> str:
        if share.left() <= 0:
            return _spent(share, len(outcomes))
        return (f"budget: this bucket's {share.seconds:.1f} s share ends in {max(share.left(), 0):.1f} s, "
                f"the next candidate takes about {next_s:.1f} s; stopped after {_n(len(outcomes))}")

    try:
        while not state.stopped:
            per = share.eval_s() + share.build_s() / max(1, options.build_workers)
            if outcomes and not first_only and not share.fits(per, reserve()):
                state.stopped = budget_stop(per)
                break
            n = batch if first_only or per <= 0 else max(1, min(batch, int((share.left() - reserve()) / per)))
            scored = st.scored() if options.storage else {}
            todo: list[tuple] = []  # (trial, schedule, key, build future) to check and time this round
            for _ in range(n):
                trial = st.ask()
                try:
                    s = space.suggest(trial)
                except st.optuna.exceptions.UpdateFinishedTrialError:
                    continue  # an RDB storage on SQLite handed this enqueued trial to another worker, who told it
                except UnsupportedSchedule as e:
                    st.tell(trial, Outcome(placeholder(trial), "refused", reason=str(e)))
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
                    job = pool.submit(objective.build, s, what=f"candidate {s.describe()}: its build")
                    todo.append((trial, s, k, job))  # built ahead of timing
            told = 0
            try:
                for trial, s, k, fut in todo:
                    est = share.eval_s() + (0.0 if fut.done() else share.build_s())
                    if outcomes and not first_only and not share.fits(est, reserve()):
                        state.stopped = budget_stop(est)
                        break
                    st.evaluating(trial)
                    out = _evaluate(objective, s, fut, share)
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
                        progress({**(event or {}), "evaluated": len(outcomes), "best_s": best, "floor_s": floor_s,
                                  "last": out, "share_s": share.seconds, "bucket_left_s": max(share.left(), 0.0)})
            finally:
                for trial, _, _, fut in todo[told:]:
                    fut.cancel()
                    st.fail(trial)
            if state.stopped:
                break
            if options.local_search and not first_only and not options.exhaustive:
                climb(st, space, outcomes, scored, climbed)
            tried = len(set(outcomes) | set(scored))
            if untried.size == space.size():  # not listed: params refusals count as tried points
                tried += len(refused)
            state.stopped = stop_reason(options, first_only=first_only, best=best, floor_s=floor_s,
                                        since_best=since_best, tried=tried, size=untried.size,
                                        trials=len(st.trials), share=share, evaluated=len(outcomes))
    finally:
        pool.shutdown()
    return state


def _evaluate(objective: Objective, s, job: Job, share: Share) -> Outcome:
    """Check and time the candidate built by `job`; a build or an evaluation past its time limit is scored and
    left out of the estimates of the next candidates' cost."""
    try:
        built = job.result()
    except CandidateTimeout as e:
        built = Built(s, None, e, e.seconds)
    else:
        share.builds.append(built.seconds)
    t0 = share.clock()
    out = objective.evaluate(s, built)
    if out.status != "timeout":
        share.evals.append(share.clock() - t0)
    return out


def stop_reason(options: TuneOptions, *, first_only: bool, best: float, floor_s: float, since_best: int,
                tried: int, size: int, trials: int, share: Share, evaluated: int) -> str:
    """Why the loop stops after this round ("" while it goes on)."""
    if first_only:
        return "revalidated: the stored winner re-checked and re-timed beside the defaults, no search"
    if options.exhaustive:
        if tried >= size:
            return f"space exhausted ({size} points)"
    elif floor_s and best <= floor_s / (1 - options.margin):
        return f"within {options.margin:.0%} of the floor"
    elif since_best >= options.patience:
        return f"no {options.min_gain:.0%} gain in {since_best} trials"
    elif tried >= size:
        return f"space exhausted ({size} points)"
    elif trials >= options.max_trials:
        return f"{trials} trials"
    if share.left() <= 0:
        return _spent(share, evaluated)
    return ""


def _n(candidates: int) -> str:
    return f"{candidates} candidate{'s' if candidates != 1 else ''}"


def _spent(share: Share, candidates: int) -> str:
    return f"budget: this bucket's {share.seconds:.1f} s share spent after {_n(candidates)}"
