"""bench/proto_persistent.py (one persistent launch for both projections, not in the package yet):
its arithmetic and item split, interpreted as two launches, against the float32 reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
proto = pytest.importorskip("proto_persistent")
from test_triton_kernels import ON_GPU, make_problem, rel_err  # noqa: E402

from moetune.codegen.torch.reference import experts_reference  # noqa: E402
from moetune.ir import UnsupportedSchedule  # noqa: E402

pytestmark = pytest.mark.skipif(ON_GPU, reason="the GPU run is bench/proto_persistent.py itself")

CASES = [  # E, k, D, F, T, routing
    (8, 2, 64, 48, 3, "uniform"),
    (8, 2, 64, 48, 4, "zero_rows"),
    (6, 2, 64, 48, 7, "one_hot_expert"),
    (5, 2, 200, 72, 3, "uniform"),
    (4, 1, 64, 48, 6, "uniform"),
    (8, 2, 64, 48, 4, "sentinel"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[5]}-T{c[4]}-D{c[2]}" for c in CASES])
def test_matches_the_reference(case, poisoned):
    E, k, D, F, T, kind = case
    block, x, ids, weights, w = make_problem(E, k, D, F, T, kind, torch.float32, {})
    fn = proto.PersistentGemv(block, proto.PersistentParams(block_n=16, block_k=64, down_block_n=16,
                                                            num_warps=4))
    out = fn(x, ids, weights, w)
    assert torch.isfinite(out).all(), "unwritten (poisoned) output elements"
    assert rel_err(out, experts_reference(block, x, ids, weights, w)) < 1e-4


def test_refuses_what_it_cannot_run():
    block, x, ids, weights, w = make_problem(8, 2, 64, 48, 40, "uniform", torch.float32, {})
    with pytest.raises(UnsupportedSchedule, match="P = 80"):
        proto.PersistentGemv(block)(x, ids, weights, w)
    big = block.replace(F=16384)
    with pytest.raises(UnsupportedSchedule, match="registers"):
        proto.PersistentGemv(big)


COMPILE = r'''
import json, re, sys
sys.path.insert(0, "bench")
import triton_sm90 as S
import proto_persistent as PP
S.INT64_PTRS.add("bar_ptr")
S.UNIT_STRIDES.update({"g_sk", "d_sk"})
S.ALIGNED_INTS.update({"g_se", "g_sn", "g_up", "d_se", "d_sn", "F", "D"})
k = S.compile_sm90(PP.persistent_gemv_kernel, dict(PHASE=0, K_TOP=8, KP=8, BP=16, BN1=16, BK1=256, BN2=4,
                   FP=1024, STAGES=4), num_warps=8, num_stages=4)
ptx = k.asm["ptx"]
print(json.dumps(dict(shared=k.metadata.shared, cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)),
                      acq_rel=len(re.findall(r"atom\.global\.gpu\.acq_rel\.add\.u64", ptx)),
                      acquire=len(re.findall(r"ld\.global\.gpu\.acquire", ptx)))))
'''


def test_compiles_for_sm90_with_a_pipelined_phase_one_and_an_acquire_release_barrier():
    from test_triton_compile import _compile

    (r,) = _compile(COMPILE)
    assert r["cp_async"] > 0 and r["shared"] <= 227 * 1024
    assert r["acq_rel"] == 1 and r["acquire"] >= 1
