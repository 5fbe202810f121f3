"""What a tuning run is asked to do (`TuneOptions`) and what one bucket's tuning gave (`BucketResult`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..ir import Bucket, ConfigError, Roofline, Schedule
from ..passes.policy import representative_tokens


@dataclass(frozen=True)
class TuneOptions:
    budget_s: float = 60.0  # per bucket (tune_block splits its total)
    margin: float = 0.1  # stop once the best reaches (1 - margin) of the floor
    patience: int = 24  # stop after this many trials in a row without a `min_gain` improvement
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
    heartbeat_s: int = 10  # RDB storage: a worker's running trials beat this often; silent 3× as long, retried
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
    candidate_timeout_s: float | None = 300.0  # a candidate's build, or its check and timing, running longer
    # fails its trial (status timeout) and the study goes on (None: no limit)

    def __post_init__(self) -> None:
        def bad(name: str, need: str) -> None:
            raise ConfigError(f"TuneOptions.{name} = {getattr(self, name)!r}: need {need}")

        if not 0 <= self.margin < 1:
            bad("margin", "0 ≤ margin < 1")
        if not self.budget_s > 0:
            bad("budget_s", "a positive budget")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            bad("time_limit_s", "a positive limit (None: no limit)")
        if self.candidate_timeout_s is not None and not self.candidate_timeout_s > 0:
            bad("candidate_timeout_s", "a positive limit (None: no limit)")
        for name in ("patience", "max_trials", "build_workers", "retime_rounds"):
            if getattr(self, name) < 1:
                bad(name, "≥ 1")
        for name in ("batch", "routings", "retime", "interior_counts"):
            if getattr(self, name) < 0:
                bad(name, "≥ 0 (0: the default)" if name in ("batch", "routings") else "≥ 0")
        if not self.min_gain >= 0:
            bad("min_gain", "≥ 0")
        if not self.split_loss > 0:
            bad("split_loss", "> 0 (split=False: never)")
        if self.space_cap is not None and self.space_cap < 1:
            bad("space_cap", "at least 1 point (None: the whole space)")


@dataclass(frozen=True)
class BucketResult:
    bucket: tuple[int, int]
    tokens: int  # the token count timed (the floor's)
    winner: Schedule | None
    time_s: float
    floor: Roofline | None
    default: Schedule | None = None
    default_time_s: float | None = None
    baseline: str = "–"
    baseline_time_s: float | None = None
    trials: int = 0  # trials of the study (all workers)
    evaluated: int = 0  # candidates this worker built, checked and timed
    failures: dict[str, int] = field(default_factory=dict)
    stopped: str = ""
    space: str = ""
    written: bool = False
    # the final round: (candidate, time at the representative T, {edge T: time}), winner first
    finalists: tuple[tuple[Schedule, float, dict[int, float]], ...] = ()
    # a split bucket (TuneOptions.split_loss): every part as (lo, hi, its winner, its time, the T timed), in
    # order; these are the table's entries then. Empty: the bucket was not split.
    parts: tuple[tuple[int, int, Schedule, float, int], ...] = ()
    elapsed_s: float = 0.0  # wall time this bucket took
    spread_s: float | None = None  # the spread of the winner's and the default's final timings (finalists.spread)
    left: bool = False  # not tuned for want of time (the budget or the time limit): a resume tunes it

    @classmethod
    def untuned(cls, bucket: Bucket, tokens: int, why: str, elapsed_s: float = 0.0, *,
                left: bool = False) -> BucketResult:
        """A bucket left to the runtime's default: `why` says what happened; `left`: for want of time."""
        return cls((bucket.lo, bucket.hi), tokens, None, math.inf, bucket.floor, stopped=f"not tuned: {why}",
                   elapsed_s=elapsed_s, left=left)

    @classmethod
    def kept(cls, bucket: Bucket, tokens: int, entries, block) -> BucketResult:
        """A bucket whose current table entry (or a split bucket's entries) is kept as it is."""
        e = next(p for p in entries if p.bucket_lo <= tokens <= p.bucket_hi)
        parts = () if len(entries) == 1 else tuple(
            (p.bucket_lo, p.bucket_hi, p.schedule(block), p.time_us * 1e-6,
             tokens if p is e else representative_tokens(p.bucket_lo, p.bucket_hi)) for p in entries)
        return cls((bucket.lo, bucket.hi), tokens, e.schedule(block), e.time_us * 1e-6, bucket.floor,
                   default_time_s=_s(e.default_time_us), baseline=e.baseline or "–",
                   baseline_time_s=_s(e.baseline_time_us), trials=e.trials or 0, spread_s=_s(e.spread_us),
                   stopped=f"kept: current table entr{'ies' if parts else 'y'} tuned {e.tuned_at}", parts=parts)

    @property
    def pct_of_floor(self) -> float | None:
        if self.floor is None or not math.isfinite(self.time_s):
            return None
        return 100.0 * self.floor.time_s / self.time_s


def _s(us: float | None) -> float | None:
    return None if us is None else us * 1e-6
