"""Faults of candidates that a study survives: a build or a kernel that hangs (the candidate's time limit
fails that trial and the study goes on), and a kernel that takes the tuner's process down (a device context
fault): a tune resumed from the same storage runs neither the trials that finished nor that candidate again."""

from __future__ import annotations

import math
import multiprocessing as mp
import time

import optuna
import pytest
import toy_backend as tb
from test_study import FASTEST, run, trials

from moetune.ir import ConfigError
from moetune.search import TuneOptions
from moetune.search.objective import CandidateError
from moetune.search.watchdog import CandidateTimeout, Pool, call

HUNG = {("stream_gemv", 64, 1): "hang_build", ("grouped_gemm", 64, 1): "hang"}


def _hung(storage) -> dict:
    """(kind, tile, stages) → (value, user attrs) of the trial of each hung point."""
    out = {}
    for t in trials(storage, "toy-hang"):
        k = t.params["kind"]
        p = (k, t.params[f"{k}:tile"], t.params[f"{k}:stages"])
        if p in HUNG and not t.user_attrs.get("duplicate"):
            assert p not in out, p
            out[p] = (t.value, t.user_attrs)
    return out


def test_a_hanging_build_or_kernel_fails_its_trial_and_the_study_goes_on():
    be = tb.toy("toy-hang", faults={**HUNG, ("hybrid", 64, 1): "wrong"})
    storage = optuna.storages.InMemoryStorage()
    t0 = time.monotonic()
    r = run(be, storage=storage, candidate_timeout_s=0.5, exhaustive=True)
    took = time.monotonic() - t0
    assert (r.winner.kind, r.winner.params.tile, r.winner.params.stages) == tb.BEST
    hung = _hung(storage)
    assert set(hung) == set(HUNG), hung  # every hung point tried (exhaustive), each scored, none left running
    for p, (value, attrs) in hung.items():
        assert math.isinf(value) and attrs["status"] == "timeout", (p, attrs)
        assert "did not finish within 0.5 s (TuneOptions.candidate_timeout_s" in attrs["reason"]
        assert ("its build" if HUNG[p] == "hang_build" else "check and timing") in attrs["reason"]
    assert r.failures.get("timeout") == len(HUNG)
    assert took < 30, took  # two limits of 0.5 s, not the hour a hung call takes


def test_strict_reraises_a_timeout():
    be = tb.toy("toy-hang-strict", faults={p: "hang" for p in FASTEST})
    with pytest.raises(CandidateError, match="candidate_timeout_s"):
        run(be, candidate_timeout_s=0.5, exhaustive=True, strict=True)


def test_the_watchdog_gives_a_hung_call_s_slot_back():
    """One slot, its call hung: the next call starts once the first one's time is up, and the values and
    exceptions of calls that end in time come back as they are."""
    import threading

    pool = Pool(1, 0.3)
    stuck = pool.submit(threading.Event().wait, 3600.0, what="the stuck call")
    after = pool.submit(lambda: 42)
    assert after.result() == 42
    with pytest.raises(CandidateTimeout, match=r"the stuck call did not finish within 0.3 s"):
        stuck.result()
    with pytest.raises(ZeroDivisionError):
        call(lambda: 1 / 0, 5.0)
    assert call(lambda: "done", None) == "done"
    with pytest.raises(ConfigError, match="candidate_timeout_s"):
        TuneOptions(candidate_timeout_s=0)


# ------------------------------------------------------------------ a candidate that ends the process

DIES = ("grouped_gemm", 64, 1)
DIE_FAULTS = {DIES: "die", ("stream_gemv", 64, 1): "wrong", ("hybrid", 64, 1): "wrong"}


def _tune(journal: str, faults: dict, out) -> None:
    be = tb.toy("toy-dies", faults=faults)
    r = run(be, storage=journal, exhaustive=True)
    out.put((r.winner.kind, r.winner.params.tile, r.winner.params.stages, [s.describe() for s in be.built]))


def test_a_candidate_that_ends_the_process_is_not_run_again_and_the_finished_trials_are_kept(tmp_path):
    """The first tune dies inside one candidate's kernel (as a device context fault takes a process down).
    Resumed from its journal, the tune completes: it builds none of the trials that finished before, and
    the candidate that died is told inf with the reason, never built again."""
    journal = str(tmp_path / "study.log")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    first = ctx.Process(target=_tune, args=(journal, DIE_FAULTS, q))
    first.start()
    first.join(120)
    assert first.exitcode == 70  # died in the candidate
    done_before = {t.user_attrs["schedule"] for t in trials(journal, "toy-dies")
                   if t.state == optuna.trial.TrialState.COMPLETE and not t.user_attrs.get("duplicate")}
    assert done_before, "the first tune died before any trial finished"
    second = ctx.Process(target=_tune, args=(journal, DIE_FAULTS, q))
    second.start()
    got = q.get(timeout=120)
    second.join(60)
    assert second.exitcode == 0
    assert got[:3] == tb.BEST
    rebuilt = set(got[3])  # what the second tune built: its trials and its final round's finalists
    ts = trials(journal, "toy-dies")
    first_worker = {t.user_attrs["worker"] for t in ts if t.user_attrs.get("schedule") in done_before}
    redone = [t.user_attrs["schedule"] for t in ts if t.user_attrs.get("worker") not in first_worker
              and not t.user_attrs.get("duplicate") and t.user_attrs.get("schedule") in done_before]
    assert not redone, redone
    died = [t for t in ts if t.user_attrs.get("status") == "died"]
    assert len(died) == 1 and math.isinf(died[0].value) and "ended while it evaluated this candidate" in \
        died[0].user_attrs["reason"]
    k = died[0].params["kind"]
    assert (k, died[0].params[f"{k}:tile"], died[0].params[f"{k}:stages"]) == DIES
    assert "toy-dies:grouped_gemm [tile=64, stages=1]" not in rebuilt, rebuilt
    assert not [t for t in ts if t.state == optuna.trial.TrialState.RUNNING]
