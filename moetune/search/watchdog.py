"""Candidates' calls bounded in time: a build, or a check and its timing, that runs past
`TuneOptions.candidate_timeout_s` ends its job with `CandidateTimeout`, and the study goes on.

    pool = Pool(workers=4, timeout_s=300)
    job = pool.submit(objective.build, schedule)   # on a daemon thread, at most 4 at once
    built = job.result()                           # its value, its exception, or CandidateTimeout

Python cannot stop a thread: a call past its time is left to finish (or hang) on its own. It gives its slot
back when its time is up, so a hung build does not hold the others up, and its thread is a daemon one, so it
does not hold the process at exit. A candidate that hangs a device (a kernel that never returns) holds that
device for the candidates after it, which then time out too; the process ends, and a resumed tune
(`--storage`) does not redo the trials that finished.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..ir import MoetuneError


class CandidateTimeout(MoetuneError):
    """A candidate's call ran past its time limit; `seconds` is the limit."""

    def __init__(self, what: str, seconds: float):
        self.seconds = seconds
        super().__init__(f"{what} did not finish within {seconds:g} s (TuneOptions.candidate_timeout_s; "
                         "None: no limit)")


class Job:
    """One call on a pool's daemon thread: `result()` waits for its value, its exception or its timeout."""

    def __init__(self, pool: Pool, fn: Callable, args: tuple, what: str):
        self._pool, self._fn, self._args, self._what = pool, fn, args, what
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._value = self._error = None
        self._cancelled = self._released = False
        threading.Thread(target=self._run, name="moetune-candidate", daemon=True).start()

    def _run(self) -> None:
        self._pool._slots.acquire()
        if self._cancelled:
            self._end(None, None)
            return
        limit = self._pool.timeout_s
        timer = None
        if limit is not None:
            timer = threading.Timer(limit, self._end, (None, CandidateTimeout(self._what, limit)))
            timer.daemon = True
            timer.start()
        value = error = None
        try:
            value = self._fn(*self._args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of result()
            error = e
        if timer is not None:
            timer.cancel()
        self._end(value, error)

    def _end(self, value, error) -> None:
        """The first end wins (the call's own, or its timeout); the slot is given back once."""
        with self._lock:
            if self._finished.is_set():
                return
            self._value, self._error = value, error
            self._finished.set()
            if not self._released:
                self._released = True
                self._pool._slots.release()

    def done(self) -> bool:
        return self._finished.is_set()

    def cancel(self) -> None:
        """A job not started yet never runs; one running is left to end on its own."""
        self._cancelled = True

    def result(self):
        self._finished.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Pool:
    """Daemon threads running at most `workers` calls at once, each for at most `timeout_s` (None: no limit)."""

    def __init__(self, workers: int, timeout_s: float | None):
        self.timeout_s = timeout_s
        self._slots = threading.Semaphore(max(1, workers))
        self._jobs: list[Job] = []

    def submit(self, fn: Callable, *args, what: str = "the call") -> Job:
        job = Job(self, fn, args, what)
        self._jobs.append(job)
        return job

    def shutdown(self) -> None:
        """The jobs not started yet never run."""
        for job in self._jobs:
            job.cancel()
        self._jobs.clear()


def call(fn: Callable, timeout_s: float | None, *args, what: str = "the call"):
    """`fn(*args)` on a daemon thread, its value or exception, or CandidateTimeout past `timeout_s`."""
    if timeout_s is None:
        return fn(*args)
    return Pool(1, timeout_s).submit(fn, *args, what=what).result()
