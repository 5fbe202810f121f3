"""Where a tuning budget starts: at the process's start for the `moetune tune` command (its imports count),
at the tuning step for a command that tunes on the way (`moetune demo`), at the call from Python."""

from __future__ import annotations

import sys

import pytest

from moetune.cli import tune as cli_tune
from moetune.search.tune import process_started


@pytest.mark.parametrize("argv,from_process", [
    (["/x/bin/moetune", "tune", "--tiny", "qwen3_moe"], True),
    (["/x/bin/moetune", "demo"], False),
    (["/x/lib/python3.11/site-packages/moetune/__main__.py", "tune"], True),
    (["pytest", "tune"], False),
])
def test_the_budget_counts_the_process_only_for_the_tune_command(monkeypatch, argv, from_process):
    monkeypatch.setattr(sys, "argv", argv)
    started = cli_tune._command_started()
    if from_process:
        assert started is not None and abs(started - process_started()) < 1.0
    else:
        assert started is None
