"""bench/grid_vs_tpe.py on a tiny block with the torch backend: the record the H200 run will write, and
its properties (the same sub-grid for both phases, a complete grid, winners re-timed back to back)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "grid_vs_tpe.py"
CAP = 6
AT = (1, 5, 12)


def _bench():
    spec = importlib.util.spec_from_file_location("grid_vs_tpe", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("grid_vs_tpe")
    argv = ["--mode", "grid", "--tiny", "qwen3_moe", "--backend", "torch", "--tokens", "1-64",
            "--at", ",".join(map(str, AT)), "--space-cap", str(CAP), "--tpe-budget", "5",
            "--grid-budget", "10", "--rounds", "5", "--tolerance", "0.35", "--build-workers", "2",
            "--no-isolate", "--out", str(out)]
    rc = _bench().main(argv)
    rec = json.loads((out / "grid_vs_tpe.json").read_text())
    return rc, rec, (out / "grid_vs_tpe.md").read_text()


def test_one_row_per_requested_bucket_with_every_field(record):
    _, rec, md = record
    assert rec["device"].startswith("cpu") and rec["space_cap"] == CAP and rec["backend"] == "torch"
    assert len(rec["buckets"]) == len(AT)
    for t, row in zip(AT, rec["buckets"], strict=True):
        lo, hi = row["bucket"]
        assert lo <= t <= hi and lo <= row["tokens"] <= hi
        for phase in ("tpe", "grid"):
            r = row[phase]
            assert r["winner"].startswith("torch:") and r["time_us"] > 0 and r["wall_s"] > 0
            assert r["trials"] >= 1 and r["evaluated"] >= 1
        assert set(row["back_to_back"]["rounds"]) == {"tpe", "grid"}
        assert all(len(v) == 5 for v in row["back_to_back"]["rounds"].values())
        assert f"| [{lo},{hi}] | {row['tokens']} |" in md
    assert rec["tpe_wall_s"] > 0 and rec["grid_wall_s"] > 0


def test_both_phases_search_one_sub_grid_and_the_grid_is_complete(record):
    _, rec, _ = record
    for row in rec["buckets"]:
        assert row["same_space"], row["space"]
        points = int(re.search(r": (\d+) points", row["space"]).group(1))
        assert 1 <= points <= CAP
        assert row["grid_complete"] and row["grid"]["stopped"].startswith("space exhausted")
        accepted = int(re.search(r"exhausted \((\d+) points", row["grid"]["stopped"]).group(1))
        assert accepted <= points and row["grid"]["trials"] >= accepted


def test_the_tpe_winner_does_not_beat_the_grid_beyond_noise(record):
    """The grid timed every point of the same space: a TPE winner much faster than the grid's (re-timed
    back to back on the same cases) would mean the grid missed its best."""
    rc, rec, _ = record
    for row in rec["buckets"]:
        assert row["ratio"] >= 1 - rec["tolerance"], row["back_to_back"]
        assert row["within_tolerance"] == (row["ratio"] <= 1 + rec["tolerance"])
    assert rc == (0 if all(r["within_tolerance"] for r in rec["buckets"]) else 1)
