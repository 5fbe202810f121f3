"""torch grouped_gemm (sorted_gemm host loop, torch grouped_mm; both combines) against the float32 reference."""

from __future__ import annotations

import pytest
import torch
from torch_cases import BACKEND, CASES, VARIANTS, check_against_reference, make_block, of_kind, run_case

from moetune.codegen.torch import GroupedGemmParams
from moetune.ir import UnsupportedSchedule


@pytest.mark.parametrize("variant", of_kind("grouped_gemm"))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_variant_matches_reference(case, variant):
    check_against_reference(case, variant)


def test_grouped_mm_refuses_misaligned_strides():
    block = make_block(D=37, F=19)
    with pytest.raises(UnsupportedSchedule, match="16 bytes.*impl=sorted_gemm"):
        BACKEND.build(block, VARIANTS["grouped_mm/unsort"])
    assert BACKEND.space(block, "grouped_gemm").choices[0] == ("impl", ("sorted_gemm",))
    assert BACKEND.default(block, "grouped_gemm", 8).params.impl == "sorted_gemm"
    out, ref = run_case(block, VARIANTS["sorted_gemm/unsort"], 5, "uniform")  # the loop still serves it
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [dict(impl="cublas"), dict(combine="atomic")])
def test_params_checked(bad):
    with pytest.raises(UnsupportedSchedule, match="supported"):
        GroupedGemmParams(**bad)


def test_reads_weights_in_place():
    """No copy at build time: the kernel follows an in-place edit of the model's tensors."""
    from torch_cases import make_tensors, routing

    block = make_block()
    w = make_tensors(block)
    fn = BACKEND.build(block, VARIANTS["sorted_gemm/unsort"])
    x, ids, wt = torch.randn(4, block.D), routing("uniform", 4, block.E, block.k), torch.rand(4, block.k)
    before = fn(x, ids, wt, w)
    with torch.no_grad():
        w.down.mul_(2)
    torch.testing.assert_close(fn(x, ids, wt, w), 2 * before)
