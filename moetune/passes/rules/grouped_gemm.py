"""Grouped GEMM: rows sorted by expert, BLOCK_M-row tiles, each weight tile reused by a tile's rows.

Worth trying everywhere on a GPU target; elsewhere (CPU, TPU) unless the whole bucket lies in the
one-row regime, where a tile of ≥ 16 rows holds one real row per expert and the padding rows cost
real matrix-unit (or core) time. On a GPU the one-row regime is bandwidth-bound and a 16-row
tensor-core tile streams the weights as fast as a GEMV (on large experts it can be the faster of the
two), so the tuner must be allowed to find it there. Judged at the bucket's largest T, so a bucket
that reaches the mixed regime keeps it.
"""

from __future__ import annotations

from ...ir import Bucket, CandidateSpace, MoEBlock, Refusal
from ..context import PassContext

KIND = "grouped_gemm"


def rule(block: MoEBlock, bucket: Bucket, ctx: PassContext) -> CandidateSpace | Refusal:
    if ctx.regime(bucket.hi) == "one_row" and ctx.target.kind != "gpu":
        share = ctx.routing.share_ge(bucket.hi, 2)
        return Refusal(KIND, "grouped_gemm",
                       f"one-row regime up to T={bucket.hi} on {ctx.target.name}: only {share:.0%} of the "
                       f"active experts have ≥ 2 rows (≤ {ctx.policy.one_row_share:.0%}); a BLOCK_M tile "
                       f"would be padding, rows per active expert "
                       f"{ctx.routing.rows_per_active(bucket.hi):.2f}")
    return CandidateSpace(KIND, rule="grouped_gemm")
