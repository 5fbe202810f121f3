"""Studies on a backend with planted faults and a fake timer: the known best wins, broken candidates never
do, failures keep their reasons, early stops, and two workers sharing one Optuna journal and one table."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import signal
import socket
import time
import uuid

import optuna
import pytest
import torch
import toy_backend as tb

from moetune.ir import ConfigError, UnsupportedSchedule
from moetune.runtime.entry import DispatchEntry
from moetune.runtime.table import DispatchTable
from moetune.runtime.versions import Versions
from moetune.search import TuneOptions, bucket_inputs, tune_bucket
from moetune.search.objective import CandidateError, expert_tensors, trace_sampler
from moetune.search.study import open_storage
from moetune.search.timing import FakeTimer

VERSIONS = Versions("0.1.0", "toyhash", "toy 1", torch.__version__, "toy device", "toy")
FASTEST = {("stream_gemv", 64, 1), ("grouped_gemm", 64, 1), ("hybrid", 64, 1)}  # cost 1 µs: tb.cost


def run(backend, *, bucket=None, cost=tb.cost, table=None, **opts):
    b = bucket or tb.bucket()
    w = expert_tensors(tb.BLOCK)
    inputs = bucket_inputs(tb.BLOCK, b, w, routings=2)
    options = TuneOptions(**{"budget_s": 60, **opts})
    return tune_bucket(tb.BLOCK, backend, "toy-target", b, inputs, FakeTimer(cost), options, table=table,
                       versions=VERSIONS)


def study_name(backend: str, bucket=(1, 8)) -> str:
    return f"moetune:toy-target:{backend}:{tb.BLOCK.signature_hash()}:{bucket[0]}-{bucket[1]}"


def _storage(storage):
    """A journal file's storage; an RDB URL or a storage object as it is."""
    if isinstance(storage, str) and "://" not in storage:
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))
    return storage


def trials(storage, backend: str, bucket=(1, 8)) -> list:
    """The trials of a bucket's study in `storage` (a journal file, an RDB URL or a storage object)."""
    return optuna.load_study(study_name=study_name(backend, bucket), storage=_storage(storage)).trials


def test_fake_timer_picks_the_known_best_and_writes_it(tmp_path):
    faults = {p: "wrong" for p in FASTEST}
    be = tb.toy("toy-best", faults=faults)
    with DispatchTable(tmp_path / "d.sqlite") as t:
        r = run(be, table=t)
        rows = t.entries()
    assert (r.winner.kind, r.winner.params.tile, r.winner.params.stages) == tb.BEST
    assert r.time_s == pytest.approx(tb.cost(r.winner))
    assert r.written and len(rows) == 1
    e = rows[0]
    assert e.schedule(tb.BLOCK) == r.winner and e.time_us == pytest.approx(r.time_s * 1e6)
    assert e.floor_us == pytest.approx(1.0) and e.pct_of_floor == pytest.approx(100 * 1.0 / e.time_us)
    assert e.default_time_us == pytest.approx(r.default_time_s * 1e6) and e.default_time_us >= e.time_us
    assert e.baseline == "transformers:grouped_mm" and e.baseline_time_us == pytest.approx(50.0)
    assert r.failures.get("wrong", 0) >= 1  # the fastest points were tried, and lost


FAULT_CASES = [
    # (fault on the fastest points, the status it is scored with)
    ("wrong", "wrong"),
    ("nan", "nonfinite"),
    ("refuse_build", "refused"),
    ("oom", "resource"),
    ("host_oom", "resource"),
]


@pytest.mark.parametrize("fault,status", FAULT_CASES)
def test_a_broken_candidate_never_wins_and_keeps_its_reason(tmp_path, fault, status):
    be = tb.toy(f"toy-{fault}", faults={p: fault for p in FASTEST})
    storage = optuna.storages.InMemoryStorage()
    r = run(be, storage=storage)
    assert (r.winner.kind, r.winner.params.tile, r.winner.params.stages) == tb.BEST
    faulty = [t for t in trials(storage, be.name)
              if (t.params[f"{t.params['kind']}:tile"], t.params[f"{t.params['kind']}:stages"]) == (64, 1)]
    assert faulty, "the faulty points were never tried"
    for t in faulty:
        assert math.isinf(t.value) and t.user_attrs["status"] == status and t.user_attrs["reason"]


def test_the_default_heuristics_are_tried_first(tmp_path):
    j = str(tmp_path / "j.log")
    r = run(tb.toy("toy-first"), storage=j)
    first = trials(j, "toy-first")[0]
    assert first.user_attrs["schedule"] == r.default.describe()
    assert first.value == pytest.approx(tb.cost(r.default))


def test_a_study_resumed_over_another_space_is_refused_naming_its_file(tmp_path):
    """A journal sampled over another search space (an older moetune's kernels) cannot be resumed: the
    error names the file and the parameter; the same space resumes."""
    from moetune.codegen.space import ParamSpace

    j = str(tmp_path / "j.log")
    run(tb.toy("toy-resume"), storage=j)
    wider = tb.toy("toy-resume")
    wider.space = lambda block, kind: ParamSpace(tb.ToyParams, (("tile", (16, 32, 64, 128)), ("stages", (1, 2, 3))))
    with pytest.raises(ConfigError, match=r"j\.log: study .* sampled \S*tile over"):
        run(wider, storage=j)
    assert run(tb.toy("toy-resume"), storage=j).winner is not None


def test_unknown_error_is_reraised_with_a_repro_that_reproduces():
    be = tb.toy("toy-crash", faults={("grouped_gemm", 16, 1): "crash", ("stream_gemv", 16, 1): "crash",
                                     ("hybrid", 16, 1): "crash"})
    with pytest.raises(CandidateError) as ei:
        run(be)
    e = ei.value
    assert "illegal memory access" in str(e) and "repro:" in str(e) and "ToyParams" in e.repro
    with pytest.raises(RuntimeError, match="illegal memory access"):
        exec(e.repro, {})


def test_keep_going_scores_an_unknown_error_inf():
    be = tb.toy("toy-crash-kg", faults={p: "crash" for p in FASTEST})
    r = run(be, keep_going=True)
    assert (r.winner.kind, r.winner.params.tile, r.winner.params.stages) == tb.BEST
    assert r.failures.get("launch_failed", 0) >= 1


@pytest.mark.parametrize("fault", ["oom", "refuse_build"])
def test_strict_reraises_even_known_failures(fault):
    be = tb.toy(f"toy-strict-{fault}", faults={("grouped_gemm", 16, 1): fault, ("stream_gemv", 16, 1): fault,
                                               ("hybrid", 16, 1): fault})
    with pytest.raises(CandidateError):
        run(be, strict=True)


def test_params_refused_by_the_backend_are_scored_not_raised():
    be = tb.toy("toy-params")
    # walk the whole space: ToyParams(64, 3) refuses itself (4 of 36 points)
    r = run(be, bucket=tb.bucket(floor_s=1e-9), patience=1000)
    assert r.stopped == "space exhausted (32 points)" and r.evaluated == 32


def test_stops_once_within_the_margin_of_the_floor():
    be = tb.toy("toy-floor", faults={p: "wrong" for p in FASTEST})
    r = run(be, bucket=tb.bucket(floor_s=9.5e-6), margin=0.1, patience=1000)
    assert r.stopped == "within 10% of the floor"
    assert r.evaluated < 32 and r.pct_of_floor == pytest.approx(95.0)


def test_stops_when_trials_stop_improving():
    be = tb.toy("toy-flat")
    r = run(be, cost=lambda s: 7e-6, patience=5, batch=2)
    assert r.stopped.split("; ")[0] in ("no 1% gain in 5 trials", "no 1% gain in 6 trials")
    assert r.evaluated <= 8
    assert r.winner == r.default and r.stopped.endswith("kept the default: it is the fastest finalist")


def test_a_bucket_with_nothing_to_try_names_its_reasons():
    be = tb.toy("toy-refuses", refuse_kinds={"grouped_gemm": "no tiles", "stream_gemv": "no gemv",
                                             "hybrid": "no hybrid"})
    with pytest.raises(UnsupportedSchedule, match=r"bucket \[1,8\].*no gemv"):
        run(be)


def test_tuning_inputs_come_from_the_trace():
    rows = torch.tensor([[0, 1], [1, 0], [0, 1]])  # a trace that only ever routes to experts 0 and 1
    b = tb.bucket(lo=2, hi=16)
    sampler = trace_sampler(tb.BLOCK, rows)
    inp = bucket_inputs(tb.BLOCK, b, expert_tensors(tb.BLOCK), routings=4, sampler=sampler)
    for c in inp.cases:
        assert set(c.ids.unique().tolist()) <= {0, 1} and c.tokens == inp.tokens
    assert inp.tokens == 6 and inp.check_tokens == (2, 6, 16)  # [2, 16]'s representative count
    with pytest.raises(UnsupportedSchedule, match="E = 8"):
        trace_sampler(tb.BLOCK, torch.tensor([[0, 9]]))


# ------------------------------------------------------------------------ two workers, one study

def _worker(journal: str, table: str, seed: int, out) -> None:
    try:
        be = tb.toy("toy-shared", faults={p: "wrong" for p in FASTEST})
        results = []
        with DispatchTable(table) as t:
            for lo, hi in ((1, 8), (9, 16)):
                r = run(be, bucket=tb.bucket(lo, hi), table=t, storage=journal, seed=seed, patience=12,
                        batch=2)
                results.append((r.bucket, r.evaluated, r.time_s, r.written, r.stopped))
        out.put(results)
    except BaseException:
        import traceback

        out.put(traceback.format_exc())


@pytest.mark.parametrize("kind", ["journal", "rdb"])
def test_two_workers_share_one_study_and_one_table(tmp_path, kind):
    journal = str(tmp_path / "study.log") if kind == "journal" else f"sqlite:///{tmp_path / 'study.db'}"
    table = str(tmp_path / "d.sqlite")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(journal, table, seed, q)) for seed in (1, 2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in procs]
    assert not [g for g in got if isinstance(g, str)], got
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with DispatchTable(table, create=False) as t:
        rows = {e.bucket: e for e in t.entries()}
    assert set(rows) == {(1, 8), (9, 16)}
    best = min(r[2] for g in got for r in g)
    for e in rows.values():
        assert e.time_us == pytest.approx(best * 1e6)
    for bucket in ((1, 8), (9, 16)):
        ts = trials(journal, "toy-shared", bucket)
        states = {t.state for t in ts}
        # none lost half-way (WAITING: points enqueued for later workers)
        assert states <= {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.WAITING}, states
        done = [t for t in ts if t.state == optuna.trial.TrialState.COMPLETE]
        workers = {t.user_attrs["worker"] for t in done}
        assert len(workers) == 2
        evaluated = [t for t in done if not t.user_attrs.get("duplicate")]
        assert len(evaluated) >= max(r[1] for g in got for r in g if r[0] == bucket)
        # the winner written once: by the first worker to finish, again only by one whose final round beat it
        writes = [r for g in got for r in g if r[0] == bucket and r[3]]
        skipped = [r for g in got for r in g if r[0] == bucket and not r[3]]
        assert len(writes) == 1 or "replaced worker" in writes[-1][4], writes
        assert all("written by worker" in r[4] or "not among this worker's finalists" in r[4] for r in skipped), skipped
        attrs = optuna.load_study(study_name=study_name("toy-shared", bucket), storage=_storage(journal)).user_attrs
        (rec,) = [v for k, v in attrs.items() if k.startswith("written@")]
        assert [tuple(r["key"][-2:]) for r in rec["rows"]] == [bucket]
        assert rec["rows"][0]["tuned_at"] == rows[bucket].tuned_at


def test_a_shared_study_s_winner_is_written_once_and_again_only_with_other_versions(tmp_path):
    journal, be = str(tmp_path / "study.log"), tb.toy("toy-once", faults={p: "wrong" for p in FASTEST})
    with DispatchTable(tmp_path / "d.sqlite") as t:
        first = run(be, table=t, storage=journal, seed=1)
        row = t.entries()[0]
        again = run(be, table=t, storage=journal, seed=2)  # the same study finished again: nothing to write
        assert first.written and not again.written and "written by worker" in again.stopped
        assert t.entries() == [row]
        b = tb.bucket()
        inputs = bucket_inputs(tb.BLOCK, b, expert_tensors(tb.BLOCK), routings=2)
        other = dataclasses.replace(VERSIONS, kernel_hash="otherhash")  # the recorded row no longer says anything
        r = tune_bucket(tb.BLOCK, be, "toy-target", b, inputs, FakeTimer(tb.cost),
                        TuneOptions(budget_s=60, storage=journal, seed=3), table=t, versions=other)
        assert r.written and [e.versions.kernel_hash for e in t.entries()] == ["otherhash"]
    # a study of this process alone writes every time it finishes (the table's rules decide)
    with DispatchTable(tmp_path / "e.sqlite") as t:
        assert run(be, table=t, seed=1).written and run(be, table=t, seed=2).stopped.count("written by") == 0


# ------------------------------------------------------------------------ three workers, one killed

POSTGRES = os.environ.get("MOETUNE_TEST_POSTGRES")
KILL_BUCKETS = ((1, 8), (9, 16))


def _database(kind: str, tmp_path) -> str:
    """A fresh storage URL: a SQLite file, or a new database on the PostgreSQL server of MOETUNE_TEST_POSTGRES."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    import psycopg

    name = f"moetune_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES, autocommit=True) as con:
        con.execute(f"CREATE DATABASE {name}")
    return POSTGRES.rsplit("/", 1)[0] + "/" + name


def _slow_worker(url: str, table: str, seed: int, out, hold: str | None = None) -> None:
    try:
        be = tb.toy("toy-killed", faults={p: "wrong" for p in FASTEST}, build_s=0.4,
                    hold=(hold, 120.0) if hold else None)
        results = []
        with DispatchTable(table) as t:
            for lo, hi in KILL_BUCKETS:
                # the first bucket searched to the end: it outlasts the killed worker's grace period
                r = run(be, bucket=tb.bucket(lo, hi), table=t, storage=url, seed=seed, batch=2, build_workers=1,
                        patience=1000 if lo == 1 else 12, heartbeat_s=1)
                results.append((r.bucket, r.evaluated, r.time_s))
        out.put(results)
    except BaseException:
        import traceback

        out.put(traceback.format_exc())


@pytest.mark.parametrize("kind", [pytest.param("sqlite", marks=pytest.mark.skipif(
    bool(POSTGRES), reason="the PostgreSQL variant runs")), pytest.param("postgresql", marks=pytest.mark.skipif(
    not POSTGRES, reason="no PostgreSQL server: MOETUNE_TEST_POSTGRES is unset (.ci/run starts one where the "
    "distribution's PostgreSQL is installed: .ci/postgres)"))])
def test_a_worker_killed_mid_study_loses_no_trial_and_counts_none_twice(tmp_path, kind):
    url, table = _database(kind, tmp_path), str(tmp_path / "d.sqlite")
    optuna.storages.RDBStorage(url)  # the schema, before the workers and the polling below read it
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    held = tmp_path / "held"  # the first worker holds its first sampled trial's build: killed there
    procs = [ctx.Process(target=_slow_worker, args=(url, table, seed, q, str(held) if seed == 1 else None))
             for seed in (1, 2, 3)]
    for p in procs:
        p.start()
    victim = procs[0]
    name = f"{socket.gethostname()}:{victim.pid}"
    deadline = time.monotonic() + 90
    while not held.exists():
        assert time.monotonic() < deadline, "the first worker never built a sampled point"
        time.sleep(0.02)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    got = [q.get(timeout=180) for _ in procs[1:]]
    assert not [g for g in got if isinstance(g, str)], got
    for p in procs[1:]:
        p.join(60)
        assert p.exitcode == 0
    with DispatchTable(table, create=False) as t:
        rows = {e.bucket: e for e in t.entries()}
    assert set(rows) == set(KILL_BUCKETS)  # the table whole
    # The live workers may have timed every point before the killed one's trial went stale (3 silent
    # heartbeats); then the next worker to ask in that study fails and retries it: one asking now.
    time.sleep(3.5)
    sweep = open_storage(url, heartbeat_s=1)
    for bucket in KILL_BUCKETS:
        optuna.storages.fail_stale_trials(optuna.load_study(study_name=study_name("toy-killed", bucket), storage=sweep))
    killed = 0
    for bucket in KILL_BUCKETS:
        ts = trials(url, "toy-killed", bucket)
        states = {t.state for t in ts}
        assert optuna.trial.TrialState.RUNNING not in states, states  # none left running
        done = [t for t in ts if t.state == optuna.trial.TrialState.COMPLETE]
        timed = [t.params for t in done]
        for t in ts:
            if t.state == optuna.trial.TrialState.FAIL and t.user_attrs.get("worker") == name:
                killed += 1
                assert t.value is None  # counted by nobody
                retries = [r for r in ts if r.system_attrs.get("failed_trial") == t.number]
                assert len(retries) == 1, retries  # retried once
                if t.params:  # its point timed by a live worker: not lost (killed while sampling, a trial holds
                    # the part of its point drawn so far, which its retry keeps and completes)
                    assert any(t.params.items() <= p.items() for p in timed), (t.params, timed)
        assert len({t.number for t in ts}) == len(ts)
        best = min(t.value for t in done if math.isfinite(t.value))
        assert rows[bucket].time_us == pytest.approx(best * 1e6)  # the study's best, written
    assert killed >= 1, [(t.number, t.state, t.user_attrs.get("worker"), t.system_attrs) for b in KILL_BUCKETS
                         for t in trials(url, "toy-killed", b)]


def test_exhaustive_mode_times_every_point_and_agrees_with_tpe():
    be = tb.toy("toy-grid", faults={p: "wrong" for p in FASTEST})
    grid = run(be, exhaustive=True, bucket=tb.bucket(floor_s=9.9e-6))  # the floor stop is off in a grid
    tpe = run(be)
    assert grid.evaluated == 32 and grid.stopped == "space exhausted (32 points)"
    assert grid.winner == tpe.winner and grid.time_s == tpe.time_s


def test_tune_block_reports_a_bucket_with_nothing_to_try_and_goes_on(tmp_path):
    from moetune.search import tune_block

    tb.toy("toy-block-none", refuse_kinds={k: "not here" for k in ("grouped_gemm", "stream_gemv", "hybrid")})
    with DispatchTable(tmp_path / "d.sqlite") as t:
        rs = tune_block(tb.BLOCK, "toy-block-none", "cpu", (1, 4), table=t, timer=FakeTimer(tb.cost),
                        options=TuneOptions(device="cpu"), budget_s=5)
        assert t.entries() == []
    assert rs and all(r.winner is None and r.stopped.startswith("not tuned:") and "not here" in r.stopped
                      for r in rs)
    with pytest.raises(UnsupportedSchedule):
        tune_block(tb.BLOCK, "toy-block-none", "cpu", (1, 4), timer=FakeTimer(tb.cost),
                   options=TuneOptions(device="cpu", strict=True), budget_s=5)


def test_tune_block_covers_the_token_range_with_the_passes_buckets(tmp_path):
    from moetune.search import tune_block

    tb.toy("toy-block", faults={p: "wrong" for p in FASTEST})
    with DispatchTable(tmp_path / "d.sqlite") as t:
        rs = tune_block(tb.BLOCK, "toy-block", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                        options=TuneOptions(device="cpu"), budget_s=20)
        rows = t.entries()
    spans = [r.bucket for r in rs]
    assert spans[0][0] == 1 and spans[-1][1] == 16
    assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:], strict=False))
    assert [e.bucket for e in rows] == spans
    for r in rs:
        assert r.winner is not None and (r.winner.params.tile, r.winner.params.stages) != (64, 1)
        assert r.floor is not None and r.floor.target == "cpu"


@pytest.mark.parametrize("warm", [False, True])
def test_a_launch_failure_is_scored_whether_it_shows_at_warm_up_or_at_the_check(warm):
    be = tb.toy(f"toy-warm-{warm}", faults={p: "crash" for p in FASTEST})
    r = run(be, keep_going=True, warm_in_build=warm)
    assert (r.winner.kind, r.winner.params.tile, r.winner.params.stages) == tb.BEST
    assert r.failures.get("launch_failed", 0) >= 1
    with pytest.raises(CandidateError, match="warm-up" if warm else "launch at T="):
        run(tb.toy(f"toy-warm-raise-{warm}", faults={("grouped_gemm", 16, 1): "crash",
                                                     ("stream_gemv", 16, 1): "crash",
                                                     ("hybrid", 16, 1): "crash"}), warm_in_build=warm)


def test_resume_keeps_current_buckets_and_tunes_only_the_missing_one(tmp_path):
    from moetune.runtime.schema import TABLE
    from moetune.search import tune_block

    tb.toy("toy-block-resume")
    path = tmp_path / "d.sqlite"
    with DispatchTable(path) as t:
        first = tune_block(tb.BLOCK, "toy-block-resume", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu"), budget_s=20)
        gone = first[-1].bucket
        t.db.execute(f"DELETE FROM {TABLE} WHERE bucket_lo = ?", [gone[0]])
        t.db.conn.commit()
        assert len(t.entries()) == len(first) - 1
        again = tune_block(tb.BLOCK, "toy-block-resume", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu", resume=True), budget_s=20)
        rows = t.entries()
    assert [r.bucket for r in again] == [r.bucket for r in first]
    kept = [r for r in again if r.stopped.startswith("kept:")]
    assert [r.bucket for r in again if r not in kept] == [gone]
    assert all(r.evaluated == 0 and r.winner == f.winner for r, f in zip(kept, first, strict=False))
    assert next(r for r in again if r.bucket == gone).evaluated > 0
    assert [e.bucket for e in rows] == [r.bucket for r in first]


def test_time_limit_stops_between_buckets_and_resume_finishes(tmp_path):
    from moetune.search import tune_block

    tb.toy("toy-block-limit")
    with DispatchTable(tmp_path / "d.sqlite") as t:
        cut = tune_block(tb.BLOCK, "toy-block-limit", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                         options=TuneOptions(device="cpu", time_limit_s=1e-6), budget_s=20)
        assert len(cut) > 2
        assert cut[0].winner is not None  # the first bucket always runs: its one candidate, the default
        assert "kept the default: the only finalist" in cut[0].stopped and cut[0].written  # the default's entry
        assert all(r.winner is None and r.stopped.startswith("not tuned: time limit") for r in cut[1:])
        assert [e.bucket for e in t.entries()] == [cut[0].bucket]
        done = tune_block(tb.BLOCK, "toy-block-limit", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                          options=TuneOptions(device="cpu", resume=True), budget_s=20)
        assert done[0].stopped.startswith("kept: current table entry")  # the default's entry of the first run
        assert all(r.winner is not None and r.written for r in done[1:])
        assert [e.bucket for e in t.entries()] == [r.bucket for r in done]
        again = tune_block(tb.BLOCK, "toy-block-limit", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu", resume=True), budget_s=20)
        assert all(r.stopped.startswith("kept:") for r in again)


def test_seeds_are_tried_right_after_the_defaults(tmp_path):
    """A seed (here the known best) is built among the first trials, before TPE's own points."""
    from moetune.ir import Schedule

    be = tb.toy("toy-seeds")
    best = Schedule("stream_gemv", backend="toy-seeds", params=tb.ToyParams(tile=32, stages=2))
    outside = Schedule("stream_gemv", backend="toy-seeds", params=tb.ToyParams(tile=48, stages=2))  # not in space
    b = tb.bucket()
    inputs = bucket_inputs(tb.BLOCK, b, expert_tensors(tb.BLOCK), routings=2)
    r = tune_bucket(tb.BLOCK, be, "toy-target", b, inputs, FakeTimer(tb.cost),
                    TuneOptions(budget_s=60, batch=1, build_workers=1), versions=VERSIONS,
                    seeds=[outside, best])
    first = [(s.kind, s.params.tile, s.params.stages) for s in be.built[:4]]
    assert sorted(first[:3]) == sorted((k, 16, 1) for k in ("grouped_gemm", "stream_gemv", "hybrid"))  # defaults
    assert first[3] == tb.BEST  # the seed, before any sampled point
    assert all(s.params.tile != 48 for s in be.built)  # a seed outside the space is left out
    assert r.time_s <= tb.cost(best)


@pytest.mark.parametrize("local", [True, False])
def test_local_search_tries_the_incumbents_neighbours_next(local):
    """Each new incumbent is climbed: its four one-knob neighbours are the next candidates. The runtime's
    default is timed first and is the first incumbent; once the stream_gemv default (the fastest of the
    defaults) is timed, its neighbours follow, the fastest point of the space (tile 64, stages 1) among
    them, then the untried neighbours of tile 32 (11 µs) and tile 64 (1 µs) in that order. Without local
    search TPE picks the next points."""
    be = tb.toy(f"toy-climb-{local}")
    run(be, batch=1, build_workers=1, patience=6, local_search=local, bucket=tb.bucket(floor_s=1e-9))
    built = [(s.kind, s.params.tile, s.params.stages) for s in be.built]
    assert sorted(built[:3]) == sorted((k, 16, 1) for k in ("grouped_gemm", "stream_gemv", "hybrid"))

    def neighbours(kind):
        return {(kind, 32, 1), (kind, 64, 1), (kind, 16, 2), (kind, 16, 3)}

    climb = neighbours("stream_gemv")
    first = built[0][0]
    if local:
        at = 3
        if first != "stream_gemv":  # the first incumbent's neighbours were queued before stream_gemv was timed
            assert set(built[3:7]) == neighbours(first)
            at = 7
        assert set(built[at:at + 4]) == climb
        if first == "stream_gemv":  # (32, 2), (32, 3), then (64, 2): (64, 3) is refused, the rest were tried
            assert built[7:10] == [("stream_gemv", 32, 2), ("stream_gemv", 32, 3), ("stream_gemv", 64, 2)]
    else:
        assert set(built[3:7]) != climb


def test_retune_of_a_stale_bucket_starts_from_its_old_winner_and_its_neighbours(tmp_path):
    """After a kernel change (stale rows), `tune_block` seeds each bucket with its own earlier winner and
    the winners of the buckets beside it: each is built before the bucket's study samples a point."""
    import moetune.search.tune as study
    from moetune.runtime.schema import TABLE

    tb.toy("toy-block-seeds")
    with DispatchTable(tmp_path / "d.sqlite") as t:
        first = study.tune_block(tb.BLOCK, "toy-block-seeds", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                                 options=TuneOptions(device="cpu"), budget_s=20)
        assert len(first) >= 3
        # a distinctive earlier winner in bucket 1, then every row stale (an older kernel hash)
        planted = '{"stages": 3, "tile": 32}'
        t.db.execute(f"UPDATE {TABLE} SET kind = 'stream_gemv', row_threshold = NULL, params = ? "
                     "WHERE bucket_lo = ?", [planted, first[1].bucket[0]])
        t.db.execute(f"UPDATE {TABLE} SET kernel_hash = 'old'")
        t.db.conn.commit()
        seen = {}
        real = study.tune_bucket

        def spy(block, backend, target, bucket, *a, seeds=(), **kw):
            seen[(bucket.lo, bucket.hi)] = list(seeds)
            return real(block, backend, target, bucket, *a, seeds=seeds, **kw)

        study.tune_bucket = spy
        try:
            again = study.tune_block(tb.BLOCK, "toy-block-seeds", "cpu", (1, 16), table=t,
                                     timer=FakeTimer(tb.cost), options=TuneOptions(device="cpu", resume=True),
                                     budget_s=20)
        finally:
            study.tune_bucket = real
    assert not any(r.stopped.startswith("kept:") for r in again)  # stale: every bucket re-tuned
    b0, b1, b2 = (r.bucket for r in again[:3])
    own = seen[b1][0]
    assert (own.kind, own.params.tile, own.params.stages) == ("stream_gemv", 32, 3)  # its old winner first
    assert again[0].winner in seen[b1]  # the bucket before: this run's new winner
    assert first[2].winner in seen[b1]  # the bucket after: its (stale) table entry
    assert own in seen[b0]  # the bucket after bucket 0: its table entry
    assert again[1].winner in seen[b2]  # past a re-tuned bucket: its new winner, not its old entry


class TokensTimer:
    """A fake timer whose time depends on the schedule and on the token count of the cases it is given."""

    name = "fake-by-tokens"

    def __init__(self, cost):
        self.cost = cost

    def __call__(self, fn, cases, schedule=None):
        from moetune.search.timing import Timing

        c = cases[0]
        fn(c.x, c.ids, c.weights, c.w)
        return Timing(self.cost(schedule, c.tokens), 0.0, 1, self.name)


@pytest.mark.parametrize("edge_timing", [True, False])
def test_the_winner_holds_at_the_bucket_edges(edge_timing):
    """Two finalists: A is 1 % faster at the representative T but 40 % slower at the bucket's last T (a
    tile boundary inside the bucket); B is steady. Timed at the edges too, B wins; at one T only, A."""
    from moetune.ir import Schedule

    name = f"toy-edges-{edge_timing}"
    be = tb.toy(name)
    a = Schedule("stream_gemv", backend=name, params=tb.ToyParams(tile=64, stages=1))
    b = Schedule("grouped_gemm", backend=name, params=tb.ToyParams(tile=64, stages=1))
    bucket = tb.bucket(lo=1, hi=8, floor_s=1e-7)  # far below both: the search does not stop at A

    def cost(s, T):
        if s is None or s.params is None:
            return 50e-6
        if (s.kind, s.params.tile, s.params.stages) == ("stream_gemv", 64, 1):
            return 1.40e-6 if T == bucket.hi else 0.99e-6
        if (s.kind, s.params.tile, s.params.stages) == ("grouped_gemm", 64, 1):
            return 1.0e-6
        return tb.cost(s) + 1e-6

    inputs = bucket_inputs(tb.BLOCK, bucket, expert_tensors(tb.BLOCK), routings=2)
    assert bucket.lo < inputs.tokens < bucket.hi
    r = tune_bucket(tb.BLOCK, be, "toy-target", bucket, inputs, TokensTimer(cost),
                    TuneOptions(budget_s=60, edge_timing=edge_timing), versions=VERSIONS, seeds=[a, b])
    assert r.winner == (b if edge_timing else a)
    assert r.time_s == pytest.approx(cost(r.winner, inputs.tokens))  # the stored time: the representative T's


def test_a_winner_chosen_against_the_stored_one_replaces_it_even_if_slower_on_paper(tmp_path):
    """The stored entry claims an impossible 0.001 µs: a plain `put` keeps it (faster), but a re-tune that
    measured the stored winner itself (it is a seed) and chose another writes its own."""
    from moetune.runtime.schema import TABLE
    from moetune.search import tune_block

    tb.toy("toy-block-replace")
    with DispatchTable(tmp_path / "d.sqlite") as t:
        first = tune_block(tb.BLOCK, "toy-block-replace", "cpu", (1, 8), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu"), budget_s=10)
        b = first[0].bucket
        t.db.execute(f"UPDATE {TABLE} SET kind = 'stream_gemv', row_threshold = NULL, params = ?, time_us = 0.001 "
                     "WHERE bucket_lo = ?", ['{"stages": 3, "tile": 16}', b[0]])
        t.db.conn.commit()
        planted = t.entries()[0]
        assert planted.bucket == b
        assert not t.put(dataclasses_replace(planted, time_us=5.0))  # slower on paper: kept
        again = tune_block(tb.BLOCK, "toy-block-replace", "cpu", (1, 8), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu"), budget_s=10)
        now = t.get(planted.target, planted.backend, planted.signature, *b)
    assert again[0].written
    assert now.schedule(tb.BLOCK) == again[0].winner != planted.schedule(tb.BLOCK)
    assert now.time_us == pytest.approx(again[0].time_s * 1e6)


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_revalidate_rechecks_a_stale_winner_without_a_search(tmp_path):
    """After a kernel change, `revalidate` keeps current buckets, and for a stale one builds only its
    defaults and the stored (and neighbouring) winners: the stored winner is re-checked, re-timed and
    stamped with the current kernels, with no TPE point sampled."""
    from moetune.runtime.schema import TABLE
    from moetune.search import tune_block

    be = tb.toy("toy-block-revalidate")
    with DispatchTable(tmp_path / "d.sqlite") as t:
        first = tune_block(tb.BLOCK, "toy-block-revalidate", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu"), budget_s=20)
        stale = first[1].bucket
        t.db.execute(f"UPDATE {TABLE} SET kernel_hash = 'old' WHERE bucket_lo = ?", [stale[0]])
        t.db.conn.commit()
        be.built.clear()
        again = tune_block(tb.BLOCK, "toy-block-revalidate", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu", revalidate=True), budget_s=20)
        rows = {e.bucket: e for e in t.entries()}
    redone = [r for r in again if not r.stopped.startswith("kept:")]
    assert [r.bucket for r in redone] == [stale]
    r = redone[0]
    assert r.stopped.startswith("revalidated") and r.written
    assert r.winner == first[1].winner  # the stored winner (the known best) holds
    assert r.evaluated <= 3 + 3  # defaults (3 kinds) and at most 3 seeds: no search
    assert rows[stale].versions.kernel_hash != "old"


def test_probe_counts():
    """The first and last T, and in a bucket spanning ≥ 1.5× two more at even ratios, none at or within
    5 % of the representative T."""
    from moetune.search.finalists import probe_counts

    assert probe_counts(305, 633, 439, 2) == [305, 389, 496, 633]  # mixtral-8x7b's bucket around T = 512
    assert probe_counts(305, 633, 439, 0) == [305, 633]
    assert probe_counts(8, 11, 9, 2) == [8, 11]  # narrower than 1.5×: the edges only
    assert probe_counts(8, 17, 8, 2) == [10, 13, 17]  # the representative T is not timed twice
    assert probe_counts(100, 400, 160, 2) == [100, 252, 400]  # 159 is within 5 % of 160: left out
    with pytest.raises(ConfigError, match="interior_counts"):
        TuneOptions(interior_counts=-1)


@pytest.mark.parametrize("interior", [2, 0])
def test_the_winner_holds_inside_a_wide_bucket(interior):
    """A is 1 % faster at the representative T and at both edges, 40 % slower at the counts between them
    (a wave or tile boundary inside the bucket); B is steady. With the interior counts timed, B wins;
    with the edges only, A."""
    from moetune.ir import Schedule
    from moetune.search.finalists import probe_counts

    name = f"toy-interior-{interior}"
    be = tb.toy(name)
    a = Schedule("stream_gemv", backend=name, params=tb.ToyParams(tile=64, stages=1))
    b = Schedule("grouped_gemm", backend=name, params=tb.ToyParams(tile=64, stages=1))
    bucket = tb.bucket(lo=1, hi=16, floor_s=1e-7)
    inputs = bucket_inputs(tb.BLOCK, bucket, expert_tensors(tb.BLOCK), routings=2)
    inner = set(probe_counts(bucket.lo, bucket.hi, inputs.tokens, 2)) - {bucket.lo, bucket.hi}
    assert inner  # the bucket is wide enough for counts between its edges

    def cost(s, T):
        if s is None or s.params is None:
            return 50e-6
        if (s.kind, s.params.tile, s.params.stages) == ("stream_gemv", 64, 1):
            return 1.40e-6 if T in inner else 0.99e-6
        if (s.kind, s.params.tile, s.params.stages) == ("grouped_gemm", 64, 1):
            return 1.0e-6
        return tb.cost(s) + 1e-6

    r = tune_bucket(tb.BLOCK, be, "toy-target", bucket, inputs, TokensTimer(cost),
                    TuneOptions(budget_s=60, interior_counts=interior), versions=VERSIONS, seeds=[a, b])
    assert r.winner == (b if interior else a)
    counts = set(r.finalists[0][2])
    assert counts == ({bucket.lo, bucket.hi} | (inner if interior else set())) - {inputs.tokens}


def test_robust_choice_over_the_edges():
    from moetune.search.finalists import robust as _robust

    rep = {"a": 1.00, "b": 1.01}
    assert _robust(rep, {}) == "a"  # no edges: the faster at the representative T
    assert _robust(rep, {8: {"a": 1.40, "b": 1.00}}) == "b"  # a loses 40 % at the last T
    assert _robust(rep, {8: {"a": 1.005, "b": 1.00}}) == "a"  # a small loss there does not outweigh
    assert _robust(rep, {8: {"a": math.inf, "b": 1.00}}) == "b"  # failed to launch at an edge
    assert _robust(rep, {8: {"a": math.inf, "b": math.inf}}) == "a"  # nothing ran there: that edge is ignored


@pytest.mark.parametrize("rounds", [1, 3])
def test_finalists_are_retimed_in_rounds_and_a_one_off_slow_timing_does_not_decide(rounds):
    """Each finalist is timed once in the search and `retime_rounds` more times at the end, every other
    round in reverse; its time is the median. A timer that is 30 % slow on the known best's first final
    timing (a noisy replay) loses it the bucket with one re-time round, not with three."""
    from moetune.search.timing import FakeTimer

    calls: dict[tuple, int] = {}

    def noisy(s):
        p = (s.kind, s.params.tile, s.params.stages) if s is not None and s.params is not None else None
        calls[p] = calls.get(p, 0) + 1
        t = tb.cost(s)
        return t * 1.3 if p == tb.BEST and calls[p] == 2 else t  # the 2nd timing: the first final round

    be = tb.toy(f"toy-rounds-{rounds}", faults={p: "wrong" for p in FASTEST})
    b = tb.bucket(floor_s=1e-9)
    inputs = bucket_inputs(tb.BLOCK, b, expert_tensors(tb.BLOCK), routings=2)
    r = tune_bucket(tb.BLOCK, be, "toy-target", b, inputs, FakeTimer(noisy),
                    TuneOptions(budget_s=60, patience=1000, retime=2, retime_rounds=rounds, edge_timing=False),
                    versions=VERSIONS)
    assert calls[tb.BEST] == 1 + rounds
    won = (r.winner.kind, r.winner.params.tile, r.winner.params.stages) == tb.BEST
    assert won == (rounds == 3)
    with pytest.raises(ConfigError, match="retime_rounds"):
        TuneOptions(retime_rounds=0)


def test_split_parts():
    """A bucket is cut where its winner loses more than `loss` at some count: a deepseek-v3 [590, 1024]
    whose winner is 7 % slower than the default at T = 1024 becomes [590, 933]
    with the finalist fastest over 590-852 and [934, 1024] with the default; mixtral-8x7b [305, 633], whose
    winner is within 3 % everywhere, stays whole; a winner beaten at both ends gives three parts."""
    from moetune.ir import Schedule
    from moetune.search.finalists import split_parts

    w, x, d = Schedule("grouped_gemm"), Schedule("hybrid", row_threshold=2), Schedule("stream_gemv")
    finals = ((w, 5443.8, {590: 5310.4, 709: 5381.6, 852: 5560.0, 1024: 6104.9}),
              (x, 5413.2, {590: 5286.7, 709: 5345.3, 852: 5549.9, 1024: 6225.2}),
              (d, 5592.6, {590: 5528.5, 709: 5563.6, 852: 5622.0, 1024: 5691.3}))
    assert split_parts(590, 1024, 777, finals, 0.03) == ((590, 933, x, 5413.2, 777), (934, 1024, d, 5691.3, 1024))
    assert split_parts(590, 1024, 777, finals, 0.08) == ()  # a 7.3 % loss is within 8 %
    assert split_parts(590, 1024, 777, finals[:1], 0.03) == ()
    a, b, c, e = (Schedule("grouped_gemm", backend=n) for n in "abce")
    mixtral = ((a, 786.7, {305: 755.9, 389: 768.2, 496: 862.7, 633: 1212.0}),
               (b, 788.7, {305: 751.0, 389: 757.5, 496: 965.4, 633: 1392.7}),
               (c, 794.6, {305: 761.9, 389: 768.4, 496: 903.9, 633: 1220.6}),
               (e, 811.1, {305: 760.3, 389: 776.8, 496: 1018.2, 633: 1300.8}))
    assert split_parts(305, 633, 439, mixtral, 0.03) == ()
    both = ((a, 1.0, {1: 1.5, 2: 1.2, 8: 1.0, 16: 1.3}), (b, 1.2, {1: 1.0, 2: 1.0, 8: 1.3, 16: 1.4}),
            (c, 1.3, {1: 1.6, 2: 1.5, 8: 1.2, 16: 1.0}))
    one = ((a, 1.0, {1: 1.0, 8: 1.0, 16: 1.2}), (b, 1.01, {1: 1.01, 8: 1.01, 16: 1.02}))
    assert [(lo, hi, s) for lo, hi, s, _, _ in split_parts(1, 16, 4, one, 0.03)] == [(1, 10, a), (11, 16, b)]
    parts = split_parts(1, 16, 4, both, 0.03)
    assert [(lo, hi, s) for lo, hi, s, _, _ in parts] == [(1, 2, b), (3, 10, a), (11, 16, c)]
    assert [(t, T) for _, _, _, t, T in parts] == [(1.0, 2), (1.0, 4), (1.0, 16)]


@pytest.mark.parametrize("split", [True, False])
def test_a_bucket_split_is_written_as_its_parts(tmp_path, split):
    """Finalist A is 4 % faster than B up to T = 6 and 30 % slower at the bucket's last T = 16; B is steady.
    The winner over all counts (B) loses 4 % at the low counts, so with splitting the table gets two
    entries, A's below and B's above, that a compiled model's dispatcher takes as they are, and the
    bucket's earlier entry is gone; without, one entry, B's."""
    from moetune.ir import Schedule
    from moetune.runtime.dispatch import Dispatcher, DispatchWarning
    from moetune.runtime.table import load_entries

    name = f"toy-split-{split}"
    be = tb.toy(name)
    a = Schedule("stream_gemv", backend=name, params=tb.ToyParams(tile=64, stages=1))
    b = Schedule("grouped_gemm", backend=name, params=tb.ToyParams(tile=64, stages=1))
    bucket = tb.bucket(lo=1, hi=16, floor_s=1e-7)

    def cost(s, T):
        if s is None or s.params is None:
            return 50e-6
        if (s.kind, s.params.tile, s.params.stages) == ("stream_gemv", 64, 1):
            return 1.30e-6 if T == 16 else 0.96e-6
        if (s.kind, s.params.tile, s.params.stages) == ("grouped_gemm", 64, 1):
            return 1.0e-6
        return tb.cost(s) + 1e-6

    inputs = bucket_inputs(tb.BLOCK, bucket, expert_tensors(tb.BLOCK), routings=2)
    with DispatchTable(tmp_path / "d.sqlite") as t:
        t.put(DispatchEntry.of(target="toy-target", block=tb.BLOCK, bucket=(1, 16), schedule=b, time_us=9.0,
                               versions=VERSIONS, tuned_at="2026-01-01T00:00:00+00:00"))
        r = tune_bucket(tb.BLOCK, be, "toy-target", bucket, inputs, TokensTimer(cost),
                        TuneOptions(budget_s=60, split=split, split_loss=0.03), table=t, versions=VERSIONS,
                        seeds=[a, b])
        rows = [(e.bucket, e.schedule(tb.BLOCK), e.time_us) for e in t.entries()]
        floors = [e.floor_us for e in t.entries()]
    assert r.winner == b and r.written
    if not split:
        assert r.parts == () and rows == [((1, 16), b, pytest.approx(1.0))]
        return
    (lo1, hi1, s1, t1, _), (lo2, hi2, s2, t2, T2) = r.parts
    assert (lo1, s1, hi2, s2, T2) == (1, a, 16, b, 16) and hi1 + 1 == lo2 and 6 <= hi1 < 16
    assert rows == [((1, hi1), a, pytest.approx(0.96)), ((lo2, 16), b, pytest.approx(1.0))]
    # the part holding the representative T keeps the bucket's floor; the toy target has no other
    assert floors == [pytest.approx(bucket.floor.time_s * 1e6), None]
    entries = load_entries(tmp_path / "d.sqlite", tb.BLOCK, "toy-target", name, versions=VERSIONS)
    with pytest.warns(DispatchWarning, match=r"no usable entry for bucket\(s\) \[17,"):  # T > 16: untuned
        d = Dispatcher.from_entries(tb.BLOCK, be, entries)
    assert [(r_.lo, r_.hi) for r_ in d.routes][:2] == [(1, hi1), (lo2, 16)]


def test_resume_keeps_a_split_bucket(tmp_path):
    """A bucket the tuner split (its parts tile it in the table, current here) counts as tuned for
    `resume`: kept with its parts, not searched again; the parts also seed a re-tune of it."""
    from moetune.ir import Bucket, Schedule
    from moetune.runtime.schema import TABLE
    from moetune.search import tune_block
    from moetune.search.seeds import seeds as _seeds

    be = tb.toy("toy-block-resume-split")
    with DispatchTable(tmp_path / "d.sqlite") as t:
        first = tune_block(tb.BLOCK, "toy-block-resume-split", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu"), budget_s=20)
        lo, hi = next(r.bucket for r in first if r.bucket[1] > r.bucket[0])
        whole = t.get("cpu", "toy-block-resume-split", tb.BLOCK.signature_hash(), lo, hi)
        other = Schedule("grouped_gemm", backend="toy-block-resume-split", params=tb.ToyParams(tile=64, stages=1))
        assert other != whole.schedule(tb.BLOCK)
        t.db.execute(f"DELETE FROM {TABLE} WHERE bucket_lo = ?", [lo])
        t.db.conn.commit()
        t.put(dataclasses_replace(whole, bucket_hi=lo))
        t.put(DispatchEntry.of(target="cpu", block=tb.BLOCK, bucket=(lo + 1, hi), schedule=other, time_us=3.0,
                               versions=whole.versions))
        one = [Bucket(lo, hi)]
        seeds = _seeds(tb.BLOCK, t, "cpu", "toy-block-resume-split", one, one[0], [])
        assert seeds == [whole.schedule(tb.BLOCK), other]
        be.built.clear()
        again = tune_block(tb.BLOCK, "toy-block-resume-split", "cpu", (1, 16), table=t, timer=FakeTimer(tb.cost),
                           options=TuneOptions(device="cpu", resume=True), budget_s=20)
    kept = next(r for r in again if r.bucket == (lo, hi))
    assert kept.stopped.startswith("kept: current table entries")
    assert [(p[0], p[1], p[2]) for p in kept.parts] == [(lo, lo, whole.schedule(tb.BLOCK)), (lo + 1, hi, other)]
    assert not be.built  # nothing searched: every bucket was current


def test_the_exit_status_fails_only_a_bucket_that_could_not_be_tuned_at_all(tmp_path):
    from moetune.cli.tune import exit_status
    from moetune.search import BucketResult, tune_block

    every = {(k, t, s): "wrong" for k in ("grouped_gemm", "stream_gemv", "hybrid") for t in (16, 32, 64)
             for s in (1, 2, 3)}
    tb.toy("toy-exit-broken", faults=every)
    rs = tune_block(tb.BLOCK, "toy-exit-broken", "cpu", (1, 4), timer=FakeTimer(tb.cost),
                    options=TuneOptions(device="cpu"), budget_s=5)
    assert rs and all(r.winner is None and r.evaluated > 0 for r in rs)
    rc, line = exit_status(rs)
    assert rc == 1 and line.startswith(f"exit status 1: {len(rs)} bucket(s) could not be tuned at all: [1,")
    assert "every candidate failed (" in line and " wrong" in line
    # the default heuristic beating every candidate is a good run: the default serves the bucket
    tb.toy("toy-exit-flat")
    flat = tune_block(tb.BLOCK, "toy-exit-flat", "cpu", (1, 4), timer=FakeTimer(lambda s: 7e-6),
                      options=TuneOptions(device="cpu", patience=4, batch=2), budget_s=5)
    assert all(r.winner == r.default for r in flat)
    rc, line = exit_status(flat)
    n = len(flat)
    assert rc == 0 and line == (f"exit status 0: the tune ran; {n} of {n} bucket(s) with a winner, {n} of them the "
                                "default heuristic (no candidate beat it)")
    # a bucket the budget left untuned is named, with --resume; one with nothing to try fails the run
    left = BucketResult.untuned(tb.bucket(9, 16), 12, "budget spent: this bucket's share is 0.0 s", left=True)
    rc, line = exit_status([*flat, left])
    assert rc == 0 and line.endswith("left untuned by the budget or the time limit (their default serves them; "
                                     "rerun with --resume to tune only those): [9,16]")
    none = BucketResult.untuned(tb.bucket(17, 32), 24, "no kind runs here")
    rc, line = exit_status([*flat, left, none])
    assert rc == 1 and "could not be tuned at all: [17,32] no kind runs here;" in line
