"""One-launch GEMV: gate/up, activation, down and the k-sum of the few-rows regime in one kernel launch.

Worth trying while the bucket's (token, expert) pairs at its largest T stay within `Policy.fused_max_pairs`:
there the block is a weight stream too short to hide a second launch, its ramp and its tail, and every
program can find its expert from the router's ids itself. Past it, the pairs are many enough that two
launches of a full grid cost less than the one barrier between gate/up and down. The streaming GEMV's row
limit (rules/stream_gemv.py) holds here too: each row is an FMA dot product off the matrix units. A GPU
target only: the one launch replaces a kernel boundary by counters in global memory that the programs of a
GPU grid poll; a CPU or a TPU core runs its grid's steps in order, with no launch gaps to save.
"""

from __future__ import annotations

from ...ir import Bucket, CandidateSpace, MoEBlock, Refusal
from ..context import PassContext

KIND = "fused_gemv"


def rule(block: MoEBlock, bucket: Bucket, ctx: PassContext) -> CandidateSpace | Refusal:
    if ctx.target.kind != "gpu":
        return Refusal(KIND, "fused_gemv", f"one launch saves GPU launch gaps; {ctx.target.name} is a "
                                           f"{ctx.target.kind} target")
    pairs, most = bucket.hi * block.k, ctx.policy.fused_max_pairs
    if pairs > most:
        return Refusal(KIND, "fused_gemv", f"at T={bucket.hi} the block has {pairs} (token, expert) pairs, above "
                                           f"{most}: two launches of a full grid pay less than one barrier")
    limit = ctx.target.gemv_max_rows(block.weight_dtype, ctx.policy.gemv_default_rows)
    heavy = ctx.routing.row_share_ge(bucket.hi, limit + 1)
    if heavy > ctx.policy.gemv_max_heavy_rows:
        return Refusal(KIND, "fused_gemv", f"at T={bucket.hi} {heavy:.0%} of the rows sit in experts with > "
                                           f"{limit} rows (GEMV row limit on {ctx.target.name})")
    return CandidateSpace(KIND, rule="fused_gemv")
