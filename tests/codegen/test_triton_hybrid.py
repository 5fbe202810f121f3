"""Triton hybrid against the float32 reference over the table of cases (GEMV rows path RP = 1 and 4)."""

from __future__ import annotations

import pytest

pytest.importorskip("moetune.codegen.triton")
from triton_cases import CASES, check_against_reference, of_kind  # noqa: E402

from moetune.codegen.triton import BACKEND  # noqa: E402
from moetune.ir import MoEBlock, UnsupportedSchedule  # noqa: E402


@pytest.mark.parametrize("sched", of_kind("hybrid"))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference(case, sched, poisoned):
    check_against_reference(case, sched, poisoned)


def test_gemm_part_refused_over_the_targets_shared_memory():
    space = BACKEND.space(MoEBlock(E=8, k=2, D=512, F=256), "hybrid")
    with pytest.raises(UnsupportedSchedule, match="HybridParams gate/up GEMM tile .* limit 227 KiB"):
        space.make(block_m=64, block_n=128, block_k=128, num_stages=4)
