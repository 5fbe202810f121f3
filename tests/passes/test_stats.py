"""Routing statistics: closed forms against their definitions and against Monte-Carlo simulation."""

import numpy as np
import pytest

from moetune.ir import IRError, RoutingStats
from moetune.ir.trace import synthetic_trace
from moetune.passes.stats import BinomialRouting, ResampledRouting, from_trace, uniform, uniform_distinct


def simulate_uniform(E, k, T, reps, seed=0):
    """m_e of `reps` calls: each token picks k distinct experts uniformly. [reps, E]"""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((reps, T, E)), axis=-1)[..., :k]  # [reps, T, k]
    flat = ids.reshape(reps, -1) + (np.arange(reps) * E)[:, None]
    return np.bincount(flat.ravel(), minlength=reps * E).reshape(reps, E)


def summary(m, T, k):
    """Measured statistics of simulated calls m [reps, E]."""
    active = (m > 0).sum(1)
    return dict(distinct=active.mean(), max=m.max(1).mean(),
                ge={r: (m >= r).sum(1).mean() / active.mean() for r in (2, 4, 8)},
                rows_ge={r: (m * (m >= r)).sum(1).mean() / (T * k) for r in (2, 4, 8)})


# (E, k, T): one-row, in-between and many-rows cases
MC_CASES = [(128, 8, 1), (128, 8, 3), (128, 8, 16), (128, 8, 64), (8, 2, 4), (8, 2, 40), (64, 6, 200),
            (512, 10, 3)]


@pytest.mark.parametrize("E,k,T", MC_CASES)
def test_uniform_matches_simulation(E, k, T):
    reps = max(40, 20000 // (T * E) + 40)
    m = simulate_uniform(E, k, T, reps, seed=E * 1000 + T)
    sim = summary(m, T, k)
    model = uniform(E, k)
    se = (m > 0).sum(1).std() / np.sqrt(reps) + 1e-9
    assert abs(model.distinct(T) - sim["distinct"]) < 4 * se + 1e-3 * E
    assert model.max_rows(T) == pytest.approx(sim["max"], rel=0.06, abs=0.05)
    for r in (2, 4, 8):
        assert model.share_ge(T, r) == pytest.approx(sim["ge"][r], abs=0.03)
        assert model.row_share_ge(T, r) == pytest.approx(sim["rows_ge"][r], abs=0.03)


@pytest.mark.parametrize("E,k", [(128, 8), (256, 8), (512, 10), (8, 2), (16, 16)])
@pytest.mark.parametrize("T", [1, 2, 3, 8, 100, 4096])
def test_uniform_closed_form(E, k, T):
    model = uniform(E, k)
    d = E * (1 - (1 - k / E) ** T)
    assert model.distinct(T) == pytest.approx(d, rel=1e-9)
    assert uniform_distinct(E, k, T) == pytest.approx(d, rel=1e-12)
    assert model.rows_per_active(T) == pytest.approx(T * k / d, rel=1e-9)
    st = model.stats(T)
    assert isinstance(st, RoutingStats) and st.tokens == T and st.source == "uniform"
    assert 1 - 1e-9 <= st.rows_per_active <= T + 1e-9
    assert st.rows_per_active - 1e-6 <= st.max_rows <= T + 1e-9


def test_qwen35_three_tokens_figure():
    # at T = 3, qwen3.5-397b-a17b (E = 512, k = 10) makes 30 selections; the distinct experts by hand:
    # 512·(1 − (502/512)^3) = 29.42, i.e. 1.9 % shared
    d = uniform(512, 10).distinct(3)
    assert d == pytest.approx(29.42, abs=0.01)
    assert 0.015 < 1 - d / 30 < 0.025


def test_binomial_tails_against_direct_sums():
    from math import comb
    p = np.array([[0.0, 0.01, 0.3, 0.69, 1.0]])  # sums to 2
    model = BinomialRouting(p, 2, source="hand")
    for T in (1, 2, 7, 30):
        for r in (1, 2, 3, 5):
            want = sum(sum(comb(T, j) * q**j * (1 - q) ** (T - j) for j in range(r, T + 1)) for q in p[0])
            assert model.active_ge(T, r) == pytest.approx(want, abs=1e-9)
            want_rows = sum(sum(j * comb(T, j) * q**j * (1 - q) ** (T - j) for j in range(r, T + 1))
                            for q in p[0])
            assert model.rows_ge(T, r) == pytest.approx(want_rows, abs=1e-9)


def test_measured_distribution_matches_resampling_of_the_trace():
    tr = synthetic_trace(64, 6, tokens=20000, zipf=1.2, seed=3)
    probs = from_trace(tr, prior=0)  # empirical p_e: the Binomial model is exact for i.i.d. token rows
    res = from_trace(tr, method="resample", samples=400, seed=1)
    for T in (1, 4, 32, 256):
        assert probs.distinct(T) == pytest.approx(res.distinct(T), rel=0.02)
        assert probs.max_rows(T) == pytest.approx(res.max_rows(T), rel=0.06)
        for r in (2, 8):
            assert probs.share_ge(T, r) == pytest.approx(res.share_ge(T, r), abs=0.03)


def test_skew_means_fewer_experts_and_hotter_ones():
    u = uniform(128, 8)
    z = from_trace(synthetic_trace(128, 8, tokens=20000, zipf=1.0))
    for T in (2, 8, 64):
        assert z.distinct(T) < u.distinct(T)
        assert z.max_rows(T) > u.max_rows(T)
    assert z.source.startswith("trace:")


def test_prior_keeps_unseen_experts_alive():
    tr = synthetic_trace(64, 4, tokens=8, zipf=0.0, seed=0)  # 8 tokens: most experts never seen
    assert from_trace(tr, prior=0).distinct(4096) < 40
    assert from_trace(tr).distinct(4096) == pytest.approx(64, abs=0.5)


@pytest.mark.parametrize("bad", [
    lambda: uniform(8, 9),
    lambda: BinomialRouting(np.full((1, 8), 0.5), 2),  # sums to 4, not 2
    lambda: BinomialRouting(np.array([[1.5, 0.5, 0.0]]), 2),
    lambda: uniform(8, 2).stats(0),
    lambda: ResampledRouting([np.array([[0, 9]])], 8, 2),
])
def test_invalid_models_are_refused(bad):
    with pytest.raises(IRError):
        bad()
