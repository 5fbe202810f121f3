"""Triton grouped_gemm (pointer and TMA operand paths) against the float32 reference over the table of
cases; 16-bit y rows; the parameters' refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("moetune.codegen.triton")
from triton_cases import CASES, check_against_reference, make_problem, of_kind, within  # noqa: E402

from moetune.codegen.torch.reference import experts_reference  # noqa: E402
from moetune.codegen.triton import BACKEND, GemmParams  # noqa: E402
from moetune.ir import MoEBlock, Schedule, UnsupportedSchedule  # noqa: E402


@pytest.mark.parametrize("sched", of_kind("grouped_gemm"))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference(case, sched, poisoned):
    check_against_reference(case, sched, poisoned)


def test_down_nb_refused_where_it_does_not_run():
    """down_nb > 1: the pointer GEMM down only, with the reason; its in-loop store's staging tile counts
    against the shared memory (the pipeline alone fits, not with the staging tile)."""
    with pytest.raises(UnsupportedSchedule, match="pointer path only"):
        GemmParams(block_m=16, block_n=32, block_k=32, down_block_n=16, tma=True, down_nb=2)
    space = BACKEND.space(MoEBlock(E=8, k=2, D=512, F=256), "grouped_gemm")
    fits = dict(block_m=128, block_n=128, down_block_n=256, down_block_k=64, down_warps=8, down_stages=4)
    space.make(**fits)
    with pytest.raises(UnsupportedSchedule, match="down tile .* shared memory"):
        space.make(**fits, down_nb=2)


def test_tiles_refused_over_the_targets_shared_memory():
    space = BACKEND.space(MoEBlock(E=8, k=2, D=512, F=256), "grouped_gemm")
    with pytest.raises(UnsupportedSchedule, match=r"gate/up tile block_m=128 .* limit 227 KiB on h200"):
        space.make(block_m=128, block_n=256, block_k=128, num_stages=4)


@pytest.mark.parametrize("tma", [False, True])
def test_y_half_writes_16_bit_rows(tma, poisoned):
    """GemmParams.y_half: the down GEMM's rows y are x's 16-bit dtype (S·P·D·2 bytes fewer than fp32),
    and the output still matches the float32 reference."""
    E, k, D, F, T = 8, 2, 64, 48, 7
    block, x, ids, weights, w = make_problem(E, k, D, F, T, "uniform", torch.float16, {})
    ref = experts_reference(block, x, ids, weights, w)
    p = GemmParams(block_m=16, block_n=16, block_k=64, group_m=1, down_block_n=32, down_block_k=16,
                   split_k=2, tma=tma)
    used = []
    for half in (False, True):
        poisoned.clear()
        s = Schedule("grouped_gemm", backend="triton", params=dataclasses.replace(p, y_half=half))
        out = BACKEND.build(block, s)(x, ids, weights, w)
        assert within(out, ref)
        used.append(sum(poisoned))
    assert used[0] - used[1] == 2 * T * k * D * 2  # S = 2 planes of [P, D]: 4 → 2 bytes per element
