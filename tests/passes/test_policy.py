"""The schedule policy: regimes, the default kind, the representative count and the hybrid threshold."""

from __future__ import annotations

import pytest
import torch

from moetune.ir import IRError, MoEBlock
from moetune.passes.policy import (
    COST_SLACK,
    Policy,
    default_kind,
    hybrid_threshold,
    kept_thresholds,
    regime,
    representative_tokens,
    rows_per_active,
)
from moetune.passes.stats import uniform, uniform_distinct


def block(E=128, k=8, D=1024, F=512, T_max=4096) -> MoEBlock:
    return MoEBlock(E=E, k=k, D=D, F=F, T_max=T_max, name="b")


def test_uniform_distinct_matches_simulation():
    E, k, T = 16, 4, 9
    g = torch.Generator().manual_seed(0)
    sims = [len({int(e) for _ in range(T) for e in torch.randperm(E, generator=g)[:k]}) for _ in range(400)]
    assert uniform_distinct(E, k, T) == pytest.approx(sum(sims) / len(sims), rel=0.03)


@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (128, 8), (512, 10)])
def test_rows_per_active_grows_from_one_to_Tk_over_E(E, k):
    b = block(E=E, k=k)
    assert rows_per_active(b, 1) == pytest.approx(1.0)
    rows = [rows_per_active(b, T) for T in (1, 2, 4, 16, 64, 256, 4096)]
    assert rows == sorted(rows)
    assert rows[-1] == pytest.approx(4096 * k / E, rel=1e-3)
    with pytest.raises(IRError, match="need an int ≥ 1"):
        rows_per_active(b, 0)


@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (128, 8), (512, 10)])
def test_regimes_progress_with_T_and_never_touch(E, k):
    r, p = uniform(E, k), Policy()
    order = {"one_row": 0, "mixed": 1, "many_rows": 2}
    seen = [regime(r, T, p) for T in range(1, 4097)]
    assert seen[0] == "one_row" and seen[-1] == "many_rows"
    assert [order[x] for x in seen] == sorted(order[x] for x in seen)
    for a, b in zip(seen, seen[1:], strict=False):
        assert {a, b} != {"one_row", "many_rows"}
    for T, x in enumerate(seen, 1):  # the definition, at every T
        assert (x == "one_row") == (r.share_ge(T, 2) <= p.one_row_share)


def test_representative_tokens_is_the_rounded_geometric_middle():
    assert [representative_tokens(*r) for r in [(1, 1), (2, 3), (64, 256), (7, 9), (590, 1024)]] == [1, 2, 128, 8, 777]
    for lo in range(1, 60):
        for hi in range(lo, 80, 7):
            assert lo <= representative_tokens(lo, hi) <= hi
    with pytest.raises(IRError):
        representative_tokens(5, 4)


def test_hybrid_threshold_is_the_allowed_R_nearest_twice_the_rows():
    assert hybrid_threshold(1.0) == 4  # 2 rows wanted, 4 the nearest allowed (ties go to the smaller)
    assert hybrid_threshold(3.0) == 4 and hybrid_threshold(3.1) == 8
    assert hybrid_threshold(5.0, (4, 16)) == 4 and hybrid_threshold(7.0, (4, 16)) == 16
    assert hybrid_threshold(100.0) == 32
    with pytest.raises(IRError):
        hybrid_threshold(2.0, ())


def test_kept_thresholds_give_a_reason_for_each_dropped_R():
    r = uniform(8, 2)
    kept, why = kept_thresholds(r, 20, 40, gemv_rows=8)
    assert kept and all(R <= 40 and R - 1 <= 8 for R in kept)
    assert len(kept) + len(why) == len(Policy().hybrid_thresholds)
    assert any("R=16" in w for w in why)  # R − 1 = 15 > 8
    assert kept_thresholds(r, 1, 1, gemv_rows=8)[0] == ()


def test_default_kind_prefers_the_regime_order_and_vetoes_a_copying_gemv():
    kinds = ("stream_gemv", "hybrid", "grouped_gemm")
    assert default_kind("one_row", kinds, kinds) == "stream_gemv"
    assert default_kind("mixed", kinds, kinds) == "grouped_gemm"
    assert default_kind("many_rows", ("stream_gemv", "grouped_gemm"), kinds) == "grouped_gemm"
    assert default_kind("one_row", kinds, ("hybrid", "grouped_gemm")) == "hybrid"  # gemv not offered
    moved = {"stream_gemv": 10.0, "hybrid": 1.1, "grouped_gemm": 1.0}
    assert default_kind("one_row", kinds, kinds, moved) == "hybrid"  # gemv vetoed, hybrid within the slack
    moved = {"stream_gemv": COST_SLACK * 1.01, "grouped_gemm": 1.0}
    assert default_kind("one_row", kinds, ("stream_gemv", "grouped_gemm"), moved) == "grouped_gemm"
    moved = {"stream_gemv": COST_SLACK * 0.99, "grouped_gemm": 1.0}
    assert default_kind("one_row", kinds, ("stream_gemv", "grouped_gemm"), moved) == "stream_gemv"
    # every proposed kind vetoed: the cheapest offer runs, proposed or not
    assert default_kind("one_row", ("stream_gemv",), ("stream_gemv", "grouped_gemm"),
                        {"stream_gemv": 5.0, "grouped_gemm": 1.0}) == "grouped_gemm"
    with pytest.raises(IRError):
        default_kind("one_row", kinds, ())
