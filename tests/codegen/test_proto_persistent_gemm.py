"""bench/proto_persistent_gemm.py (a prototype for the H200): the persistent TMA grouped GEMM against the
float32 reference under the interpreter, with fewer programs than tiles (each program walks several),
split-K partials and both loop forms; torch.empty poisoned, so an unwritten element fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("moetune.codegen.triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import proto_persistent_gemm as proto  # noqa: E402
from test_triton_kernels import make_problem, rel_err, tolerances  # noqa: E402

from moetune.codegen.torch.reference import experts_reference  # noqa: E402
from moetune.codegen.triton import GemmParams  # noqa: E402

CASES = [  # E, k, D, F, T, routing, dtype
    (8, 2, 64, 48, 9, "uniform", torch.float32),
    (8, 2, 64, 48, 6, "zero_rows", torch.float32),
    (6, 2, 64, 48, 7, "one_hot_expert", torch.float32),
    (4, 1, 64, 48, 6, "uniform", torch.float32),
    (5, 2, 200, 72, 5, "uniform", torch.float32),
    (8, 2, 64, 48, 5, "uniform", torch.float16),
]


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}k{c[1]}D{c[2]}F{c[3]}T{c[4]}-{c[5]}-{c[6]}")
def test_persistent_twin_matches_the_reference(case, split_k, flatten, poisoned):
    E, k, D, F, T, kind, dtype = case
    block, x, ids, weights, w = make_problem(E, k, D, F, T, kind, dtype, {})
    p = GemmParams(block_m=16, block_n=32, block_k=32, group_m=2, down_block_n=32, down_block_k=16,
                   split_k=split_k, tma=True)
    out = proto.build(block, p, flatten)(x, ids, weights, w)
    assert torch.isfinite(out).all()
    assert rel_err(out, experts_reference(block, x, ids, weights, w)) < tolerances(dtype)


def test_fewer_programs_than_tiles_when_interpreting():
    assert proto.programs(torch.device("cpu"), 100) == 4 and proto.programs(torch.device("cpu"), 2) == 2
