"""bench/proto_tma_gemm.py (the large-T grouped GEMM with TMA loads, not in the package yet): its
arithmetic interpreted against the float32 reference, and its sm_90 build (TMA loads, wgmma)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
proto = pytest.importorskip("proto_tma_gemm")
from test_triton_kernels import ON_GPU, make_problem, rel_err, tolerances  # noqa: E402

from moetune.codegen.torch.reference import experts_reference  # noqa: E402
from moetune.ir import Activation, UnsupportedSchedule, WeightLayout  # noqa: E402

pytestmark = pytest.mark.skipif(ON_GPU, reason="the GPU run is bench/proto_tma_gemm.py itself")

CASES = [  # E, k, D, F, T, routing, dtype
    (8, 2, 64, 48, 5, "uniform", torch.float32),
    (8, 2, 64, 48, 6, "zero_rows", torch.float32),
    (6, 2, 64, 48, 7, "one_hot_expert", torch.float32),
    (5, 2, 200, 72, 3, "uniform", torch.float32),
    (4, 1, 64, 48, 6, "uniform", torch.float32),
    (8, 2, 64, 48, 4, "sentinel", torch.float32),
    (8, 2, 64, 48, 5, "uniform", torch.float16),
]
SMALL = proto.TmaParams(block_m=16, block_n=16, block_k=32, down_block_n=32, down_block_k=32, group_m=2)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[5]}-T{c[4]}-D{c[2]}-{c[6]}" for c in CASES])
def test_matches_the_reference(case, poisoned):
    E, k, D, F, T, kind, dtype = case
    block, x, ids, weights, w = make_problem(E, k, D, F, T, kind, dtype, {})
    out = proto.TmaGemm(block, SMALL)(x, ids, weights, w)
    assert torch.isfinite(out).all(), "unwritten (poisoned) output elements"
    assert rel_err(out, experts_reference(block, x, ids, weights, w)) < tolerances(dtype)


def test_refuses_what_it_cannot_run():
    block, *_ = make_problem(4, 2, 64, 48, 2, "uniform", torch.float32, dict(
        layout=WeightLayout(transposed=True, interleaved=True, has_bias=True),
        activation=Activation("clamped_swiglu", alpha=1.702, limit=7.0)))
    with pytest.raises(UnsupportedSchedule, match="standard layout"):
        proto.TmaGemm(block)


COMPILE = r'''
import json, re, sys
sys.path.insert(0, "bench")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import proto_tma_gemm as PT
for proj, bn in ((0, 128), (1, 256)):
    sig = {"a_desc": "tensordesc<bf16[128, 64]>", "b_desc": f"tensordesc<bf16[{bn}, 64]>", "counts_ptr": "*i32",
           "row_pair_ptr": "*i32", "wts_ptr": "*bf16", "out_ptr": "*fp32" if proj else "*bf16", "E": "i32",
           "N": "i32", "K": "i32", "n_tiles": "i32", "alpha": "fp32", "limit": "fp32"}
    cx = dict(PROJ=proj, BLOCK_E=16, BM=128, BN=bn, BK=64, GROUP_M=8, UPCAST=False)
    sig.update({n: "constexpr" for n in cx})
    aligned = ("counts_ptr", "row_pair_ptr", "wts_ptr", "out_ptr", "N", "K")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(PT.tma_gemm_kernel.arg_names) if n in aligned}
    k = triton.compile(ASTSource(PT.tma_gemm_kernel, sig, constexprs=cx, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=4 - proj))
    ptx = k.asm["ptx"]
    print(json.dumps(dict(proj=proj, shared=k.metadata.shared, tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                          wgmma=len(re.findall(r"wgmma\.mma_async", ptx)))))
'''


def test_compiles_for_sm90_to_tma_loads_and_wgmma():
    from test_triton_compile import _compile

    rows = _compile(COMPILE)
    assert [r["proj"] for r in rows] == [0, 1]
    for r in rows:
        assert r["tma"] > 0 and r["wgmma"] > 0 and r["shared"] <= 227 * 1024, r
