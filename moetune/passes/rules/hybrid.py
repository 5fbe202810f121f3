"""Hybrid: experts with m_e ≥ R rows take GEMM tiles, the rest stream as GEMV, in one launch.

The knob is the row threshold R. A candidate R (from `Policy.hybrid_thresholds`) is kept when,
at the bucket's representative T,
  - R ≤ T_hi (an expert can reach it) and R − 1 ≤ the target's GEMV row limit (the light side
    stays memory-bound),
  - experts with ≥ R rows carry ≥ `hybrid_min_heavy_rows` of the rows (the GEMM side matters),
  - ≥ `hybrid_min_light` of the active experts have < R rows (the GEMV side matters).
The rule refuses when no R is kept, naming what was missing.
"""

from __future__ import annotations

from ...ir import Bucket, CandidateSpace, MoEBlock, Refusal
from ..context import PassContext

KIND = "hybrid"


def rule(block: MoEBlock, bucket: Bucket, ctx: PassContext) -> CandidateSpace | Refusal:
    p, r = ctx.policy, ctx.routing
    T = bucket.stats.tokens if bucket.stats is not None else bucket.hi
    limit = ctx.target.gemv_max_rows(block.weight_dtype, p.gemv_default_rows)
    fits = [R for R in p.hybrid_thresholds if R <= bucket.hi and R - 1 <= limit]
    if not fits:
        return Refusal(KIND, "hybrid", f"no row threshold of {p.hybrid_thresholds} fits: need R ≤ T_hi = "
                                       f"{bucket.hi} and R − 1 ≤ GEMV row limit {limit}")
    kept, why = [], []
    for R in fits:
        heavy, light = r.row_share_ge(T, R), 1.0 - r.share_ge(T, R)
        if heavy < p.hybrid_min_heavy_rows:
            why.append(f"R={R}: {heavy:.0%} of rows in experts with ≥ R rows")
        elif light < p.hybrid_min_light:
            why.append(f"R={R}: {light:.0%} of active experts below R rows")
        else:
            kept.append(R)
    if not kept:
        return Refusal(KIND, "hybrid", f"at T={T} no threshold splits the experts "
                                       f"(need ≥ {p.hybrid_min_heavy_rows:.0%} of rows heavy and "
                                       f"≥ {p.hybrid_min_light:.0%} of experts light): " + "; ".join(why))
    return CandidateSpace(KIND, row_thresholds=tuple(kept), rule="hybrid")
