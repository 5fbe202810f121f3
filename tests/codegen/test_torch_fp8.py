"""The torch kernels on fp8_block weights: every variant against the float32 reference on the dequantised
weights (the bf16 / fp16 / fp32 tolerance of the compute dtype), the weights read in place and dequantised
only per call, the format's refusals and space."""

from __future__ import annotations

import pytest
import torch
from torch_cases import BACKEND, FP8_CASES, VARIANTS, check_fp8_against_reference, make_block, make_tensors, routing

from moetune.codegen.torch import experts_reference, worst_error
from moetune.codegen.torch._common import GATHER_WORKSPACE_BYTES, copy_bytes_per_expert
from moetune.ir import UnsupportedSchedule


def _runs(case, variant) -> bool:
    """Whether the variant's workspace bound admits the case's block (the large case refuses chunk 256)."""
    try:
        BACKEND.build(make_block(**case[1]), VARIANTS[variant])
    except UnsupportedSchedule:
        return False
    return True


PAIRS = [(c, v) for c in FP8_CASES for v in VARIANTS if _runs(c, v)]


@pytest.mark.parametrize("case, variant", PAIRS, ids=[f"{c[0]}-{v}" for c, v in PAIRS])
def test_variant_matches_reference(case, variant):
    check_fp8_against_reference(case, variant)


def test_every_case_runs_on_every_kind():
    assert {(c[0], VARIANTS[v].kind) for c, v in PAIRS} == {
        (c[0], k) for c in FP8_CASES for k in ("grouped_gemm", "stream_gemv", "hybrid")}


def test_every_kind_reads_fp8_blocks():
    block = make_block(D=384, F=640, fp8=((128, 128), "float32"), dtype="bfloat16")
    assert BACKEND.kinds(block) == {"grouped_gemm": None, "stream_gemv": None, "hybrid": None}
    for kind in ("grouped_gemm", "stream_gemv", "hybrid"):
        assert BACKEND.schemes(kind) == ("none", "fp8_block")
        assert any(p.name == "quant.py" for p in BACKEND.sources(kind, "fp8_block"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_weights_stay_fp8_and_in_place(variant):
    """The kernels read the module's FP8 tensors: a change to them changes the next call's result, and
    nothing writes to them."""
    block = make_block(D=64, F=96, fp8=((32, 32), "float32"), dtype="bfloat16")
    w = make_tensors(block)
    fn = BACKEND.build(block, VARIANTS[variant])
    x = torch.randn(6, block.D).bfloat16()
    ids, wt = routing("uniform", 6, block.E, block.k), torch.rand(6, block.k).bfloat16()
    snap = [t.clone() for t in (w.gate_up, w.down, w.gate_up_scale, w.down_scale)]
    before = fn(x, ids, wt, w)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
               for a, b in zip(snap, (w.gate_up, w.down, w.gate_up_scale, w.down_scale), strict=True))
    assert w.gate_up.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        w.down_scale.mul_(2)
    after = fn(x, ids, wt, w)
    assert worst_error(after, 2 * before.float()) <= 1
    assert worst_error(after, experts_reference(block, x, ids, wt, w)) <= 1


def test_workspace_bound_counts_the_dequantised_copy():
    """The gather bound of an FP8 block counts its per-call dequantised copy, not the stored FP8 bytes."""
    bf16 = make_block(E=8, k=2, D=1024, F=1024, dtype="bfloat16")
    fp8 = make_block(E=8, k=2, D=1024, F=1024, fp8=((128, 128), "float32"), dtype="bfloat16")
    assert fp8.weight_bytes_per_expert < bf16.weight_bytes_per_expert < copy_bytes_per_expert(fp8)
    assert BACKEND.space(bf16, "stream_gemv").choices == (("chunk", (4, 16)),)
    assert BACKEND.space(fp8, "stream_gemv").choices == (("chunk", (4,)),)
    fit = int(GATHER_WORKSPACE_BYTES // copy_bytes_per_expert(fp8))
    with pytest.raises(UnsupportedSchedule, match=f"lower chunk to ≤ {fit}"):
        BACKEND.build(fp8, VARIANTS["stream_gemv/256"])
