"""The Optuna side of a bucket's tuning: one study per (target, backend, block signature, bucket), driven
with ask/tell, in memory or in a storage that several `moetune tune` workers share (`open_storage`)."""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Sequence

from ..ir import ConfigError, Schedule, TunerUnavailable, UnsupportedSchedule
from .objective import Outcome
from .options import TuneOptions
from .space import SearchSpace, key


def require_optuna():
    """The optuna module, or TunerUnavailable saying how to install it."""
    try:
        import optuna
    except ImportError as e:
        raise TunerUnavailable("moetune tune needs Optuna, which is not installed here: "
                               f"pip install 'moetune[tune]' ({e})") from e
    return optuna


def open_storage(storage):
    """None → in memory (this study only); "sqlite:///…", "postgresql://…" → RDB; another string → a
    journal file; an Optuna storage object is used as it is."""
    if storage is None or not isinstance(storage, str | os.PathLike):
        return storage
    optuna = require_optuna()
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


class Study:
    """One bucket's Optuna study driven with ask/tell: TPE, multivariate and grouped for the conditional
    kind → parameters space, with a constant liar so that a round's candidates differ."""

    def __init__(self, name: str, space: SearchSpace, options: TuneOptions):
        optuna = require_optuna()
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
                    raise ConfigError(
                        f"--storage {storage}: study {name!r} sampled {n} over {tuple(d.choices)}, this "
                        f"moetune's search space has {ours[n]} (its kernels' spaces changed since); tune "
                        "into a new storage file")

    @property
    def trials(self) -> list:
        return self.study.trials

    def enqueue(self, schedules: Sequence[Schedule]) -> None:
        for s in schedules:
            self.study.enqueue_trial(self.space.params_of(s), skip_if_exists=True)

    def ask(self):
        return self.study.ask()

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

    def ranked(self, n: int) -> list[Schedule]:
        """The `n` fastest distinct schedules of the study (every worker's trials)."""
        done = sorted((t for t in self.study.trials if t.value is not None and t.value < float("inf")),
                      key=lambda t: t.value)
        out: dict[str, Schedule] = {}
        for t in done:
            if len(out) >= n:
                break
            try:
                s = self.space.schedule_of(t.params)
            except (UnsupportedSchedule, KeyError, ValueError):
                continue
            out.setdefault(key(s), s)
        return list(out.values())

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


def placeholder(trial) -> Schedule:
    """A Schedule to hang a refusal on when the sampled parameters could not make one."""
    kind = trial.params.get("kind", "grouped_gemm")
    if kind != "hybrid":
        return Schedule(kind)
    rt = trial.params.get(f"{kind}:row_threshold")
    return Schedule(kind, row_threshold=rt if isinstance(rt, int) and rt >= 2 else 2)
