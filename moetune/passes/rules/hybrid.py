"""Hybrid: experts with m_e ≥ R rows take GEMM tiles, the rest stream as GEMV, in one launch.

The knob is the row threshold R; the rule keeps the thresholds `policy.kept_thresholds` keeps at the
bucket's representative T and refuses, naming what was missing, when it keeps none.
"""

from __future__ import annotations

from ...ir import Bucket, CandidateSpace, MoEBlock, Refusal
from ..context import PassContext
from ..policy import kept_thresholds, representative_tokens

KIND = "hybrid"


def rule(block: MoEBlock, bucket: Bucket, ctx: PassContext) -> CandidateSpace | Refusal:
    p = ctx.policy
    T = representative_tokens(bucket.lo, bucket.hi)
    limit = ctx.target.gemv_max_rows(block.weight_dtype, p.gemv_default_rows)
    kept, why = kept_thresholds(ctx.routing, T, bucket.hi, limit, p)
    if not kept:
        return Refusal(KIND, "hybrid", f"at T={T} no row threshold of {p.hybrid_thresholds} splits the "
                                       "experts: " + "; ".join(why))
    return CandidateSpace(KIND, row_thresholds=kept, rule="hybrid")
