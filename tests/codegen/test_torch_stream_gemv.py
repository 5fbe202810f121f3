"""torch stream_gemv (gathered bmm per chunk of pairs) against the float32 reference; its workspace bound."""

from __future__ import annotations

import dataclasses

import pytest
from torch_cases import BACKEND, CASES, check_against_reference, make_block, of_kind

from moetune.codegen.torch import GatheredParams, GroupedGemmParams
from moetune.codegen.torch._common import GATHER_WORKSPACE_BYTES
from moetune.ir import Schedule, UnsupportedSchedule


@pytest.mark.parametrize("variant", of_kind("stream_gemv"))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_variant_matches_reference(case, variant):
    check_against_reference(case, variant)


def test_refuses_workspace_over_bound():
    big = make_block(E=8, k=2, D=4096, F=14336, dtype="bfloat16")  # 352 MiB per expert
    assert big.weight_bytes_per_expert > GATHER_WORKSPACE_BYTES
    why = BACKEND.kinds(big)["stream_gemv"]
    assert why and "limit 256 MiB" in why and "grouped_gemm" in why
    with pytest.raises(UnsupportedSchedule, match="limit 256 MiB"):
        BACKEND.build(big, Schedule("stream_gemv", backend="torch", params=GatheredParams(1)))
    mid = make_block(E=8, k=2, D=1024, F=2048, dtype="bfloat16")  # 12 MiB per expert: chunk ≤ 21
    with pytest.raises(UnsupportedSchedule, match="lower chunk to ≤ 21"):
        BACKEND.build(mid, Schedule("stream_gemv", backend="torch", params=GatheredParams(64)))
    assert BACKEND.space(mid, "stream_gemv").choices == (("chunk", (4, 16)),)
    assert BACKEND.default(mid, "stream_gemv", 64).params.chunk == 16  # the largest chunk that fits


def test_default_is_one_bmm_when_it_fits():
    block = make_block(E=8, k=2)
    assert [BACKEND.default(block, "stream_gemv", T).params.chunk for T in (1, 2, 8, 100, 1000)] == \
        [4, 4, 16, 256, 256]


def test_params_checked_frozen_and_typed():
    with pytest.raises(UnsupportedSchedule, match="positive int"):
        GatheredParams(0)
    p = GatheredParams(8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.chunk = 4
    with pytest.raises(UnsupportedSchedule, match="takes GatheredParams"):
        BACKEND.build(make_block(), Schedule("stream_gemv", backend="torch", params=GroupedGemmParams()))
