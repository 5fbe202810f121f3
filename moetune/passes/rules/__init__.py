"""Specialisation rules, one file per regime, tried in this order for every bucket.

A rule is `rule(block, bucket, ctx) -> CandidateSpace | Refusal`: the schedule kind worth trying
in the bucket with its IR-level knobs' choices, or the reason it is not worth trying. Rules read
the routing model at the bucket's ends and representative token count; they know no backend.
"""

from __future__ import annotations

from . import fused_gemv, grouped_gemm, hybrid, stream_gemv

RULES = (
    ("fused_gemv", fused_gemv.rule),
    ("stream_gemv", stream_gemv.rule),
    ("hybrid", hybrid.rule),
    ("grouped_gemm", grouped_gemm.rule),
)

__all__ = ["RULES"]
