"""Fusion pass: Before (candidates with default Fusion) / Expected (per block kind and schedule kind)."""

import dataclasses

import pytest

from moetune.ir import (
    Bucket,
    CandidateSpace,
    Fusion,
    MoEBlock,
    ScheduledBlock,
    SharedExperts,
    verify_scheduled,
)
from moetune.passes.fusion import fusion
from moetune.passes.pipeline import context

PLAIN = dict(E=16, k=4, D=64, F=40, T_max=64)
# (block changes, schedule kind, expected Fusion)
CASES = [
    ({}, "stream_gemv", Fusion(True, True, True, False)),
    ({}, "grouped_gemm", Fusion(True, True, False, False)),
    ({}, "hybrid", Fusion(True, True, False, False)),
    ({"k": 1}, "grouped_gemm", Fusion(True, True, True, False)),
    ({"weight_application": "input"}, "stream_gemv", Fusion(True, False, True, False)),
    ({"shared": SharedExperts(F=40)}, "grouped_gemm", Fusion(True, True, False, True)),
    ({"shared": SharedExperts(F=80, gated=True)}, "stream_gemv", Fusion(True, True, True, True)),
    ({"shared": SharedExperts(F=48)}, "stream_gemv", Fusion(True, True, True, False)),  # 48 % 40 ≠ 0
    ({"shared": SharedExperts(F=40, inside_block=False)}, "stream_gemv", Fusion(True, True, True, False)),
]


@pytest.mark.parametrize("changes,kind,expected", CASES)
def test_fusion_before_expected(changes, kind, expected):
    block = MoEBlock(**{**PLAIN, **changes})
    cand = CandidateSpace(kind, row_thresholds=(4,) if kind == "hybrid" else (), rule=kind)
    before = ScheduledBlock(block, (Bucket(1, 64, candidates=(cand,)),))
    after = fusion(before, context(block))
    verify_scheduled(after)
    assert after.buckets[0].candidates == (dataclasses.replace(cand, fusion=expected),)


def test_fusion_is_identity_when_already_decided():
    block = MoEBlock(**PLAIN)
    cand = CandidateSpace("stream_gemv", fusion=Fusion(True, True, True, False))
    before = ScheduledBlock(block, (Bucket(1, 64, candidates=(cand,)),))
    assert fusion(before, context(block)) is before
