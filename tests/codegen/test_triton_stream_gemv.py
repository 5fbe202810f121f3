"""Triton stream_gemv against the float32 reference over the table of cases; its parameters' refusals."""

from __future__ import annotations

import pytest

pytest.importorskip("moetune.codegen.triton")
from triton_cases import CASES, check_against_reference, of_kind  # noqa: E402

from moetune.codegen.triton import BACKEND, GemvParams  # noqa: E402
from moetune.ir import MoEBlock, UnsupportedSchedule  # noqa: E402


@pytest.mark.parametrize("sched", of_kind("stream_gemv"))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference(case, sched, poisoned):
    check_against_reference(case, sched, poisoned)


@pytest.mark.parametrize("bad, why", [
    (dict(down_mode="expert", down_nb=2), "down_mode='token'"),
    (dict(down_nb=3), "1, 2, 4 or 8"),
    (dict(block_n=24), "power of two"),
    (dict(split_k=2), "only with"),
    (dict(block_n=64, block_k=1024, num_warps=1), "registers"),
])
def test_params_refused_with_reason(bad, why):
    with pytest.raises(UnsupportedSchedule, match=why):
        GemvParams(**bad)


def test_the_dot_pass_is_refused_over_the_targets_shared_memory():
    """rows ≥ 16 runs a tl.dot pipeline: over the target's shared memory per block the space refuses it,
    and so does a build of a schedule that holds it."""
    from moetune.ir import Schedule

    block = MoEBlock(E=8, k=2, D=512, F=256)
    space = BACKEND.space(block, "stream_gemv")
    big = dict(rows=16, block_n=256, block_k=256, num_stages=4)
    with pytest.raises(UnsupportedSchedule, match=r"KiB shared memory, limit 227 KiB on h200; lower block_k"):
        space.make(**big)
    with pytest.raises(UnsupportedSchedule, match="shared memory"):
        BACKEND.build(block, Schedule("stream_gemv", backend="triton", params=GemvParams(**big)))
    space.make(rows=16, block_n=64, block_k=128, num_stages=4)  # the default's dot pass fits
