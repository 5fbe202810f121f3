"""torch hybrid (GEMM for experts with ≥ R rows, gathered GEMV for the rest) against the float32 reference;
its cost's binomial tail."""

from __future__ import annotations

import math

import pytest
from torch_cases import BACKEND, CASES, check_against_reference, make_block, of_kind

from moetune.codegen.torch import HybridParams
from moetune.codegen.torch.hybrid import binomial_tail
from moetune.ir import UnsupportedSchedule


@pytest.mark.parametrize("variant", of_kind("hybrid"))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_variant_matches_reference(case, variant):
    check_against_reference(case, variant)


@pytest.mark.parametrize("bad, why", [(dict(heavy="eager"), "supported"), (dict(chunk=-1), "positive int")])
def test_params_checked(bad, why):
    with pytest.raises(UnsupportedSchedule, match=why):
        HybridParams(**bad)


def test_default_threshold_grows_with_rows_per_expert():
    block = make_block(E=8, k=2)
    rs = [BACKEND.default(block, "hybrid", T).row_threshold for T in (1, 4, 16, 64, 256)]
    assert rs == sorted(rs) and rs[-1] > rs[0]


def test_binomial_tail_against_direct_sum():
    n, q, r = 30, 0.2, 5
    pm = [math.comb(n, m) * q**m * (1 - q) ** (n - m) for m in range(n + 1)]
    p, m = binomial_tail(n, q, r)
    assert p == pytest.approx(sum(pm[r:])) and m == pytest.approx(sum(i * pm[i] for i in range(r, n + 1)))
    assert binomial_tail(4096, 0.5, 2000)[0] == pytest.approx(0.9, abs=0.1)  # no overflow
