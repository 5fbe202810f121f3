"""bench/proto_fused_down.py (small-T GEMV with the down projection fused into the gate/up programs, not
in the package): its arithmetic interpreted against the float32 reference, and its sm_90 build."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
proto = pytest.importorskip("proto_fused_down")
from test_triton_kernels import ON_GPU, make_problem, rel_err, tolerances  # noqa: E402

from moetune.codegen.torch.reference import experts_reference  # noqa: E402
from moetune.ir import Activation, UnsupportedSchedule, WeightLayout  # noqa: E402

pytestmark = pytest.mark.skipif(ON_GPU, reason="the GPU run is bench/proto_fused_down.py itself")

CASES = [  # E, k, D, F, T, routing, dtype
    (8, 2, 64, 48, 3, "uniform", torch.float32),
    (8, 2, 64, 48, 4, "zero_rows", torch.float32),
    (6, 2, 64, 48, 7, "one_hot_expert", torch.float32),
    (5, 2, 200, 72, 3, "uniform", torch.float32),
    (4, 1, 64, 48, 6, "uniform", torch.float32),
    (8, 2, 64, 48, 4, "sentinel", torch.float32),
    (8, 2, 64, 48, 5, "uniform", torch.float16),
    (8, 2, 64, 48, 40, "uniform", torch.float32),  # P = 80: the routing kernel first
    (6, 2, 64, 48, 37, "one_hot_expert", torch.float32),
]
PARAMS = {
    "rows1": proto.FusedParams(block_n=16, block_k=32, block_d=32, num_warps=4),
    "rows4": proto.FusedParams(block_n=16, block_k=32, block_d=16, rows=4, num_warps=4),
}


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("case", CASES, ids=[f"{c[5]}-T{c[4]}-D{c[2]}-{c[6]}" for c in CASES])
def test_matches_the_reference(case, params, poisoned):
    E, k, D, F, T, kind, dtype = case
    block, x, ids, weights, w = make_problem(E, k, D, F, T, kind, dtype, {})
    out = proto.FusedDown(block, PARAMS[params])(x, ids, weights, w)
    assert torch.isfinite(out).all(), "unwritten (poisoned) output elements"
    assert rel_err(out, experts_reference(block, x, ids, weights, w)) < tolerances(dtype)


def test_refuses_what_it_cannot_run():
    block, *_ = make_problem(8, 2, 64, 48, 4, "uniform", torch.float32, {})
    gpt = block.replace(layout=WeightLayout(transposed=True, interleaved=True, has_bias=True),
                        activation=Activation("clamped_swiglu", alpha=1.702, limit=7.0))
    with pytest.raises(UnsupportedSchedule, match="standard layout"):
        proto.FusedDown(gpt)


COMPILE = r'''
import json, re, sys
sys.path.insert(0, "bench")
import triton_sm90 as S
import proto_fused_down as PF
S.INT64_PTRS.add("ids_ptr")
S.UNIT_STRIDES.update({"gsk", "dsk"})
S.ALIGNED_INTS.update({"gse", "gsn", "gup", "dse", "dsn", "F", "D"})
for fused, rp, bn, bk, bd, nw in ((True, 1, 16, 256, 128, 4), (True, 1, 64, 128, 128, 8), (True, 1, 128, 128, 32, 8),
                                  (False, 4, 32, 128, 64, 4), (False, 4, 64, 128, 64, 8)):
    k = S.compile_sm90(PF.fused_down_kernel, dict(K_TOP=8, BP=16, BLOCK_E=128, FUSED=fused, RP=rp, BN=bn, BK=bk,
                       BD=bd, STAGES=4), fp32_out=True, num_warps=nw, num_stages=4)
    ptx = k.asm["ptx"]
    print(json.dumps(dict(bn=bn, shared=k.metadata.shared, cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)),
                          local=len(re.findall(r"(ld|st)\.local", ptx)))))
'''


def test_compiles_for_sm90_pipelined_without_spills():
    from test_triton_compile import _compile

    rows = _compile(COMPILE)
    assert len(rows) == 5
    for r in rows:
        assert r["cp_async"] > 0 and r["local"] == 0 and r["shared"] <= 227 * 1024, r
