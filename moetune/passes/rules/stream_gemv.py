"""Streaming GEMV: every selected expert's weights read once, each of its m_e rows a dot product.

Worth trying while the rows per expert stay below the target's GEMV row limit (the rows at which
the multiply-adds, done off the matrix units, stop hiding behind the weight stream:
`Target.gemv_max_rows`). Refused once a share `gemv_max_heavy_rows` of the bucket's rows (at its
largest T) sits in experts above that limit: those experts would be compute-bound on the vector
units, and a skewed router gets there at a smaller T than a uniform one.
"""

from __future__ import annotations

from ...ir import Bucket, CandidateSpace, MoEBlock, Refusal
from ..context import PassContext

KIND = "stream_gemv"


def rule(block: MoEBlock, bucket: Bucket, ctx: PassContext) -> CandidateSpace | Refusal:
    limit = ctx.target.gemv_max_rows(block.weight_dtype, ctx.policy.gemv_default_rows)
    heavy = ctx.routing.row_share_ge(bucket.hi, limit + 1)
    if heavy > ctx.policy.gemv_max_heavy_rows:
        return Refusal(KIND, "stream_gemv",
                       f"at T={bucket.hi} {heavy:.0%} of the rows sit in experts with > {limit} rows "
                       f"(GEMV row limit on {ctx.target.name} for {block.weight_dtype}), above "
                       f"{ctx.policy.gemv_max_heavy_rows:.0%}: streaming would be compute-bound off the "
                       f"matrix units (rows per active expert {ctx.routing.rows_per_active(bucket.hi):.1f})")
    return CandidateSpace(KIND, rule="stream_gemv")
