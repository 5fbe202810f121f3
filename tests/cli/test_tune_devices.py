"""`moetune tune --devices`: one worker process per device sharing one storage and one table (CPU workers here:
the same processes, CUDA_VISIBLE_DEVICES set and unused)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moetune.cli.workers import worker_argv
from moetune.runtime.table import DispatchTable

optuna = pytest.importorskip("optuna")


def test_worker_argv_drops_devices_and_names_the_storage():
    argv = ["tune", "--tiny", "qwen3_moe", "--devices", "0,1", "--budget", "5s"]
    assert worker_argv(argv, "sqlite:///s.db") == ["tune", "--tiny", "qwen3_moe", "--budget", "5s",
                                                   "--storage", "sqlite:///s.db"]
    given = ["tune", "--devices=0,1", "--storage", "j.log"]
    assert worker_argv(given, "sqlite:///s.db") == ["tune", "--storage", "j.log"]


def test_two_workers_share_the_studies_and_fill_one_table(tmp_path):
    table = tmp_path / "t.sqlite"
    cmd = [sys.executable, "-m", "moetune.cli", "tune", "--tiny", "qwen3_moe", "--tokens", "1-2", "--budget", "30s",
           "--cache", str(table), "--devices", "0,1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("moetune tune: 2 workers (devices 0, 1), shared storage sqlite:///")
    for d in ("0", "1"):
        assert any(line.startswith(f"[device {d}] exit status 0: the tune ran") for line in lines), lines[-20:]
    assert lines[-1].endswith("exit statuses device 0: 0, device 1: 0; exit status 0")
    assert "workers running" in run.stderr and "Heartbeat of storage" not in run.stderr
    with DispatchTable(table, create=False) as t:
        buckets = sorted(e.bucket for e in t.entries())
    assert buckets and buckets[0][0] == 1 and buckets[-1][1] == 2
    assert all(a[1] + 1 == b[0] for a, b in zip(buckets, buckets[1:], strict=False)), buckets  # no gap
    storage = f"sqlite:///{table}.study.db"
    workers = set()
    for s in optuna.get_all_study_summaries(storage):
        trials = optuna.load_study(study_name=s.study_name, storage=storage).trials
        workers |= {t.user_attrs.get("worker") for t in trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert len(workers - {None}) == 2  # both workers timed trials of the shared studies
