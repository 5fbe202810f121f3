"""Grouped GEMM: rows sorted by expert, BLOCK_M-row tiles, each weight tile reused by a tile's rows.

Worth trying unless the whole bucket lies in the one-row regime: there a tile of ≥ 16 rows holds
one real row per expert, and GEMM tilings stream the weights with too little parallelism (see
DESIGN.md). Judged at the bucket's largest T, so a bucket that reaches the mixed regime keeps it.
"""

from __future__ import annotations

from ...ir import Bucket, CandidateSpace, MoEBlock, Refusal
from ..context import PassContext

KIND = "grouped_gemm"


def rule(block: MoEBlock, bucket: Bucket, ctx: PassContext) -> CandidateSpace | Refusal:
    if ctx.regime(bucket.hi) == "one_row":
        share = ctx.routing.share_ge(bucket.hi, 2)
        return Refusal(KIND, "grouped_gemm",
                       f"one-row regime up to T={bucket.hi}: only {share:.0%} of the active experts have "
                       f"≥ 2 rows (≤ {ctx.policy.one_row_share:.0%}); a BLOCK_M tile would be padding, "
                       f"rows per active expert {ctx.routing.rows_per_active(bucket.hi):.2f}")
    return CandidateSpace(KIND, rule="grouped_gemm")
