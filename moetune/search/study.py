"""The Optuna side of a bucket's tuning: one study per (target, backend, block signature, bucket), driven
with ask/tell, in memory or in a storage that several `moetune tune` workers share (`open_storage`).

On an RDB storage (PostgreSQL, MySQL, SQLite URLs) each worker's running trials send heartbeats from a
thread of its own; before each ask, a trial whose worker has been silent for the grace period (killed,
its host lost) is marked failed and Optuna's retry callback enqueues its parameters again, so another
worker times that point: it is neither lost nor counted twice (a failed trial has no value). A journal
file has no heartbeats: a killed worker's trial stays running there, counted by nobody, unless that worker
ran on this host: a study opened here tells the trial a worker of this host was evaluating when its process
ended as `inf` (status "died"), so that a candidate which took its process down (a fault of the device
context, a crash in a kernel) is not run again by the resumed tune; the trials it had asked and not started
are failed and their points enqueued again, and the trials that finished are kept."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import warnings
from collections.abc import Sequence

from ..ir import ConfigError, Schedule, TunerUnavailable, UnsupportedSchedule
from ..runtime.coverage import same_versions
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


# the heartbeats of a Study's trials are its own (`Study.heartbeat`), ask() outside Study.optimize or not: Optuna's
# warning about that is said once a trial otherwise (one filter, set at import: a catch_warnings per ask() would
# swap the process's filters under the heartbeat threads)
warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with Study.optimize")

_OPENED: dict[tuple, object] = {}  # (process, URL, heartbeat) → its storage: one engine and heartbeat per process


def open_storage(storage, heartbeat_s: int = 10):
    """None → in memory (this study only); "sqlite:///…", "postgresql://…" → RDB, with heartbeats every
    `heartbeat_s` and a trial silent for 3× that retried (up to 3 times), opened once per process; another
    string → a journal file; an Optuna storage object is used as it is."""
    if storage is None or not isinstance(storage, str | os.PathLike):
        return storage
    storage = str(storage)
    if "://" in storage:
        at = (os.getpid(), storage, heartbeat_s)
        if at not in _OPENED:
            _OPENED[at] = _open_rdb(storage, heartbeat_s)
        return _OPENED[at]
    optuna = require_optuna()
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))


def _open_rdb(storage: str, heartbeat_s: int):
    """An RDB storage with heartbeats every `heartbeat_s` s, a grace of 3× that and stale trials retried."""
    optuna = require_optuna()
    beat = max(1, int(heartbeat_s))
    # Workers starting together may race to create the schema: the loser retries.
    deadline = time.monotonic() + 60
    while True:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3)
                return optuna.storages.RDBStorage(storage, heartbeat_interval=beat, grace_period=3 * beat,
                                                  heartbeat_stale_trial_callback=retry)
        except Exception:  # noqa: BLE001 - sqlalchemy's errors; re-raised once the minute is spent
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1 + 0.2 * (os.getpid() % 5) / 5)


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
        storage = open_storage(options.storage, options.heartbeat_s)
        self.study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, direction="minimize",
                                         load_if_exists=True)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.shared = storage is not None and not isinstance(storage, optuna.storages.InMemoryStorage)
        self._check_resumed(name, options.storage)
        self.heartbeat = Heartbeat.of(storage)
        self._marks = storage is not None and self.heartbeat is None  # a stored study without heartbeats
        if self._marks:
            self._tell_dead()

    def _tell_dead(self) -> None:
        """The running trials of the workers of this host whose processes are gone: the one each was evaluating
        (`evaluating`) told inf, status "died"; the others failed, their points enqueued again."""
        host, store = socket.gethostname(), self.study._storage
        running = (self.optuna.trial.TrialState.RUNNING,)
        for t in self.study.get_trials(deepcopy=False, states=running):
            at, _, pid = str(t.user_attrs.get("worker", "")).rpartition(":")
            if at != host or not pid.isdigit() or _alive(int(pid)):
                continue
            try:
                if t.user_attrs.get("evaluating"):
                    store.set_trial_user_attr(t._trial_id, "status", "died")
                    store.set_trial_user_attr(t._trial_id, "reason", f"worker {at}:{pid} ended while it evaluated "
                                              "this candidate; not run again")
                    self.study.tell(t.number, float("inf"))
                else:
                    self.study.tell(t.number, state=self.optuna.trial.TrialState.FAIL)
                    self.study.enqueue_trial(t.params)
            except (ValueError, self.optuna.exceptions.UpdateFinishedTrialError):
                pass  # another worker told it first

    def evaluating(self, trial) -> None:
        """Mark `trial` as the one this worker evaluates now (on a stored study without heartbeats: should the
        process end in it, `_tell_dead` tells it as the candidate that ended it)."""
        if self._marks:
            trial.set_user_attr("evaluating", True)

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
        """The next trial, this worker's name on it; stale trials of killed workers failed (and so retried)
        first."""
        if self.heartbeat is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", self.optuna.exceptions.ExperimentalWarning)
                self.optuna.storages.fail_stale_trials(self.study)
        trial = self.study.ask()
        if self.heartbeat is not None:
            self.heartbeat.add(trial._trial_id)
        try:
            trial.set_user_attr("worker", self.worker)
        except self.optuna.exceptions.UpdateFinishedTrialError:
            self._done(trial)  # an RDB storage on SQLite handed this enqueued trial to another worker, who told it
        return trial

    def _done(self, trial) -> None:
        if self.heartbeat is not None:
            self.heartbeat.discard(trial._trial_id)

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

    def claim(self, table_path, winner: Schedule | None, finalists: Sequence[Schedule]) -> WriteClaim | None:
        """On a shared study: who of its workers writes its winner to the table at `table_path`
        (`WriteClaim`); None on a study of this process alone."""
        if not self.shared:
            return None
        return WriteClaim(self, table_path, winner, finalists)

    def fail(self, trial) -> None:
        try:
            self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
        except (ValueError, self.optuna.exceptions.UpdateFinishedTrialError):
            pass
        self._done(trial)

    def tell(self, trial, outcome: Outcome, duplicate: bool = False) -> None:
        try:
            self._tell(trial, outcome, duplicate)
        except (ValueError, self.optuna.exceptions.UpdateFinishedTrialError):
            # An RDB storage on SQLite can hand one enqueued trial to two workers; the other one told it.
            pass
        self._done(trial)

    def _tell(self, trial, outcome: Outcome, duplicate: bool) -> None:
        trial.set_user_attr("status", outcome.status)
        trial.set_user_attr("schedule", outcome.schedule.describe())
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


class WriteClaim:
    """The write of a shared study's winner to one table, once: the first worker to finish writes it and
    records what it wrote in the study (a user attribute per table file and host). A worker finishing after it
    writes nothing when its winner is the recorded one, or when it did not time the recorded one beside its
    own; it replaces the recorded write only when the recorded winner was among its finalists and lost
    there. A recorded write whose rows the table no longer holds as written (the writer died before its
    commit, the table was rewritten since, or it was measured with other kernels or on another device) does
    not count. `DispatchTable.put_all` asks `free` and calls `take` inside its transaction: the workers
    writing one file do so one at a time."""

    def __init__(self, study: Study, table_path, winner: Schedule | None, finalists: Sequence[Schedule]):
        place = f"{socket.gethostname()}:{os.path.realpath(table_path)}"
        self.attr = "written@" + hashlib.sha1(place.encode()).hexdigest()[:16]
        self.study, self.mine = study, key(winner) if winner is not None else None
        self.timed = {key(s) for s in finalists}
        self.said = ""  # why nothing was written, or whose write this one replaced

    def _recorded(self, table, entries) -> dict | None:
        """The recorded write where the table holds its rows as written, with the versions of `entries`."""
        rec = self.study.study.user_attrs.get(self.attr)
        if not rec or not entries:
            return None
        held = all((e := table.get(*r["key"])) is not None and e.tuned_at == r["tuned_at"]
                   and same_versions(e, entries[0]) for r in rec["rows"])
        return rec if held else None

    def free(self, table, entries) -> bool:
        rec = self._recorded(table, entries)
        if rec is None:
            return True
        if rec["schedule"] == self.mine:
            self.said = f"the study's winner was written by worker {rec['by']}"
            return False
        if rec["schedule"] not in self.timed:
            self.said = (f"worker {rec['by']} wrote the study's winner ({rec['described']}), not among this "
                         "worker's finalists: kept")
            return False
        self.said = f"replaced worker {rec['by']}'s write ({rec['described']}: slower in this worker's final round)"
        return True

    def take(self, table, written) -> None:
        e = written[0]
        self.study.study.set_user_attr(self.attr, {
            "by": self.study.worker, "schedule": self.mine, "described": f"{e.kind} {e.time_us:.1f} µs",
            "rows": [{"key": [w.target, w.backend, w.signature, w.bucket_lo, w.bucket_hi], "tuned_at": w.tuned_at}
                     for w in written]})


_BEATS: dict[tuple, Heartbeat] = {}  # (process, storage) → its heartbeat thread


class Heartbeat:
    """A daemon thread recording a heartbeat for each running trial of this worker every interval of the
    storage, so that the others can tell a live trial from a killed worker's."""

    def __init__(self, storage, interval_s: float) -> None:
        self.storage, self.interval_s = storage, interval_s
        self.trials: set[int] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="moetune-heartbeat", daemon=True).start()

    @classmethod
    def of(cls, storage) -> Heartbeat | None:
        """The heartbeat of `storage` in this process where it keeps them (an RDB storage with an
        interval), else None."""
        from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled

        if not isinstance(storage, BaseHeartbeat) or not is_heartbeat_enabled(storage):
            return None
        at = (os.getpid(), id(storage))
        if at not in _BEATS:
            _BEATS[at] = cls(storage, float(storage.get_heartbeat_interval()))
        return _BEATS[at]

    def add(self, trial_id: int) -> None:
        self.storage.record_heartbeat(trial_id)
        with self.lock:
            self.trials.add(trial_id)

    def discard(self, trial_id: int) -> None:
        with self.lock:
            self.trials.discard(trial_id)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self.lock:
                ids = list(self.trials)
            for t in ids:
                try:
                    self.storage.record_heartbeat(t)
                except Exception:  # noqa: BLE001 - a lost connection: the next beat tries again
                    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def placeholder(trial) -> Schedule:
    """A Schedule to hang a refusal on when the sampled parameters could not make one."""
    kind = trial.params.get("kind", "grouped_gemm")
    if kind != "hybrid":
        return Schedule(kind)
    rt = trial.params.get(f"{kind}:row_threshold")
    return Schedule(kind, row_threshold=rt if isinstance(rt, int) and rt >= 2 else 2)
