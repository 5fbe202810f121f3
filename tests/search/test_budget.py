"""The budget is kept: `tune_block`'s wall time stays within 10 % of its budget, each bucket stops when its
share is spent and says so, a bucket that cannot be started is reported with its numbers; the tuner's
typed errors (a missing Optuna, an unusable backend, bad options) are raised, never turned into "not tuned"."""

from __future__ import annotations

import io
import sys
import time

import pytest
import toy_backend as tb

from moetune.ir import ConfigError, MoEBlock, TunerUnavailable
from moetune.search import TuneOptions, tune_block
from moetune.search.loop import Share
from moetune.search.progress import Display
from moetune.search.timing import FakeTimer


def slow_timer(per_token_s: float, fixed_s: float = 0.0) -> FakeTimer:
    """A fake timer whose every call takes real wall time: `fixed_s` + `per_token_s` per token timed."""

    class Slow(FakeTimer):
        def __call__(self, fn, cases, schedule=None):
            time.sleep(fixed_s + per_token_s * cases[0].tokens)
            return super().__call__(fn, cases, schedule)

    return Slow(tb.cost)


@pytest.fixture(autouse=True, scope="module")
def _baseline_imported():
    """The transformers baseline is imported once per process (seconds): not inside these budgets."""
    from moetune.search.baseline import baseline_fn

    baseline_fn(tb.BLOCK, "grouped_mm")


def test_each_bucket_stops_when_its_share_is_spent_and_the_run_keeps_the_budget():
    tb.toy("toy-budget")
    t0 = time.monotonic()
    rs = tune_block(tb.BLOCK, "toy-budget", "cpu", (1, 16), timer=slow_timer(0.0, 0.15),
                    options=TuneOptions(device="cpu", build_workers=1, patience=1000), budget_s=3.0,
                    display=False)
    wall = time.monotonic() - t0
    assert wall <= 1.1 * 3.0, wall
    tuned = [r for r in rs if r.winner is not None]
    assert len(rs) >= 3 and len(tuned) >= 2, [r.stopped for r in rs]
    for r in tuned:  # the reason reads as what happened, with the share in seconds and the candidates tried
        assert r.stopped.startswith("budget: this bucket's "), r.stopped
        n = r.evaluated
        assert f"after {n} candidate{'s' if n != 1 else ''}" in r.stopped.split(";")[0 if "spent" in r.stopped else 1]
        share = float(r.stopped.split("'s ")[1].split(" s share")[0])
        assert 0.3 < share <= 3.0 and r.elapsed_s <= share * 1.1 + 0.15
    for r in rs:
        assert r.winner is not None or r.stopped.startswith("not tuned: budget spent: ")


def test_a_bucket_that_cannot_be_started_is_reported_with_its_numbers():
    """Every timer call takes 0.9 s: after the first bucket, one candidate would pass each bucket's share,
    so the others are not started, and say why in numbers."""
    tb.toy("toy-budget-big")
    t0 = time.monotonic()
    rs = tune_block(tb.BLOCK, "toy-budget-big", "cpu", (1, 16), timer=slow_timer(0.0, 0.9),
                    options=TuneOptions(device="cpu", build_workers=1), budget_s=2.0, display=False)
    assert time.monotonic() - t0 <= 2.2
    assert rs[0].winner is not None and rs[0].stopped.startswith("budget: this bucket's 0.5 s share")
    assert len(rs) >= 3 and all(r.winner is None for r in rs[1:])
    for r in rs[1:]:
        assert r.stopped.startswith("not tuned: budget spent: one candidate here takes about ")
        assert "s of the 2.0 s budget used" in r.stopped and "share is" in r.stopped


def test_the_share_estimates_from_what_it_measured():
    now = [0.0]
    s = Share(10.0, first_estimate=2.0, clock=lambda: now[0])
    assert s.eval_s() == 2.0 and s.fits(2.0) and not s.fits(10.5)
    s.evals += [1.0, 3.0]
    s.timings += [0.5]
    assert s.eval_s() == 2.0 and s.timing_s() == 0.5
    now[0] = 9.0
    assert s.left() == pytest.approx(1.0) and not s.fits(2.0) and s.fits(0.5)
    assert s.reserve(finalists=4, rounds=2, counts=2) == pytest.approx(min(17 * 0.5, 10 / 3))


def test_one_small_bucket_does_not_price_a_large_one_by_its_token_count():
    """A candidate's build is the same in every bucket; from a single measured bucket its evaluation grows
    with the floors only (not 181× from T = 1 to T = 172), and with two buckets along a fitted line."""
    from moetune.search.tune import _Costs

    now = [0.0]
    s = Share(30.0, clock=lambda: now[0])
    s.evals += [0.4, 0.5]
    s.builds += [2.5]
    costs = _Costs()
    assert costs.estimate((1e-4, 3.0)) is None
    costs.add((5e-5, 3.0), s)  # the T = 1 bucket: floors 3 × 16.7 µs, 3 tokens
    assert costs.estimate((8e-4, 543.0)) == pytest.approx(2.5 + 0.5 * 16)  # floors 16×, tokens 181×
    assert costs.estimate((5e-5, 3.0)) == pytest.approx(3.0)
    big = Share(30.0, clock=lambda: now[0])
    big.evals += [1.0]
    big.builds += [2.0]
    costs.add((2e-4, 30.0), big)  # a second bucket: lines through both, on each axis; the larger build
    line = 0.5 + (1.0 - 0.5) / (30.0 - 3.0) * (543.0 - 3.0)
    assert costs.estimate((8e-4, 543.0)) == pytest.approx(2.5 + line)


@pytest.mark.parametrize("tty", [False, True])
def test_progress_display_shows_an_eta_per_bucket_and_overall(tty):
    out = io.StringIO()
    out.isatty = lambda: tty
    d = Display(3, 30.0, time.monotonic(), stream=out, every_s=0.0)
    d({"bucket": (1, 4), "index": 0, "evaluated": 5, "best_s": 2e-5, "floor_s": 1e-5, "bucket_left_s": 7.4})
    text = out.getvalue()
    assert "[1/3] bucket [1,4]: 5 candidates" in text and "50% of floor" in text
    assert "bucket ETA ≤ 7 s" in text and "all ≤ 30 s" in text
    assert text.startswith("\r") == tty and text.endswith("\n") != tty


def test_the_budget_on_a_real_block_with_the_torch_backend():
    """Real Optuna, the torch backend, the CPU timer and a small block over several buckets."""
    block = MoEBlock(E=8, k=2, D=64, F=32, weight_dtype="float32", routing_weight_dtype="float32", T_max=256,
                     name="budget-test")
    t0 = time.monotonic()
    rs = tune_block(block, "torch", "cpu", (1, 256), options=TuneOptions(device="cpu", build_workers=2),
                    budget_s=6.0, display=False)
    wall = time.monotonic() - t0
    assert wall <= 1.1 * 6.0, (wall, [r.stopped for r in rs])
    assert len(rs) >= 3 and sum(r.winner is not None for r in rs) >= 2
    assert "budget 0 s" not in " ".join(r.stopped for r in rs)


def test_a_missing_optuna_raises_tuner_unavailable_not_not_tuned(monkeypatch):
    tb.toy("toy-no-optuna")
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna → ImportError
    with pytest.raises(TunerUnavailable, match=r"needs Optuna.*pip install 'moetune\[tune\]'"):
        tune_block(tb.BLOCK, "toy-no-optuna", "cpu", (1, 4), timer=FakeTimer(tb.cost),
                   options=TuneOptions(device="cpu"), budget_s=5, display=False)


def test_a_backend_not_usable_here_raises_tuner_unavailable():
    be = tb.toy("toy-unusable")
    be.available = lambda: "no toy device on this machine"
    with pytest.raises(TunerUnavailable, match="backend toy-unusable is not usable here: no toy device"):
        tune_block(tb.BLOCK, "toy-unusable", "cpu", (1, 4), timer=FakeTimer(tb.cost),
                   options=TuneOptions(device="cpu"), budget_s=5, display=False)


@pytest.mark.parametrize("field,value,need", [
    ("budget_s", 0, "positive budget"), ("margin", 1.0, "0 ≤ margin < 1"), ("patience", 0, "≥ 1"),
    ("retime_rounds", 0, "≥ 1"), ("interior_counts", -1, "≥ 0"), ("split_loss", 0.0, "> 0"),
    ("time_limit_s", -1.0, "positive limit"), ("space_cap", 0, "at least 1 point"), ("batch", -2, "≥ 0"),
])
def test_bad_options_raise_config_error_naming_the_field_and_value(field, value, need):
    with pytest.raises(ConfigError, match=rf"TuneOptions\.{field} = {value!r}: need .*{need}"):
        TuneOptions(**{field: value})


def test_a_bad_total_budget_is_a_config_error():
    tb.toy("toy-bad-budget")
    with pytest.raises(ConfigError, match="budget_s = -1"):
        tune_block(tb.BLOCK, "toy-bad-budget", "cpu", (1, 4), timer=FakeTimer(tb.cost), budget_s=-1)
