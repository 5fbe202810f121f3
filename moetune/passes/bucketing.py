"""Bucketing pass: MoEBlock → ScheduledBlock whose buckets split T ∈ [1, T_max] by routing statistics.

A bucket is a run of token counts with
  - one regime (context.py): the boundaries between one_row, mixed and many_rows are exact (found by
    bisection over the integers), so no bucket spans two regimes;
  - expected distinct experts within a factor `distinct_ratio` and rows per active expert within
    `rows_ratio` of the bucket's first token count (weight traffic and tile shape stay alike).
Token counts are examined at every T ≤ 64 and on a geometric grid (5 % steps) above; a ratio
boundary falls on a grid point, and a sliver (hi < 1.1·lo above the dense grid) is folded into a
same-regime neighbour. Each bucket carries the routing statistics at its representative
token count (`policy.representative_tokens`).
"""

from __future__ import annotations

from ..ir import Bucket, MoEBlock, ScheduledBlock
from .context import PassContext
from .policy import representative_tokens

DENSE_UP_TO = 64
GRID_STEP = 1.05
SLIVER = 1.1  # buckets above the dense grid narrower than this factor in T are merged


def grid(T_max: int) -> list[int]:
    pts = list(range(1, min(T_max, DENSE_UP_TO) + 1))
    t = float(pts[-1])
    while pts[-1] < T_max:
        t *= GRID_STEP
        nxt = min(T_max, max(pts[-1] + 1, round(t)))
        pts.append(nxt)
    return pts


def _regime_change(ctx: PassContext, a: int, b: int) -> int:
    """The smallest T in (a, b] whose regime differs from a's (b's regime differs from a's)."""
    ra = ctx.regime(a)
    while b - a > 1:
        mid = (a + b) // 2
        if ctx.regime(mid) == ra:
            a = mid
        else:
            b = mid
    return b


def split(block: MoEBlock, ctx: PassContext) -> list[tuple[int, int]]:
    """The buckets' (lo, hi) ranges covering [1, block.T_max]."""
    r, p = ctx.routing, ctx.policy
    starts = [1]

    def start(t: int) -> None:
        nonlocal reg, d0, rho0
        starts.append(t)
        reg, d0, rho0 = ctx.regime(t), r.distinct(t), r.rows_per_active(t)

    reg, d0, rho0 = ctx.regime(1), r.distinct(1), r.rows_per_active(1)
    prev = 1
    for t in grid(block.T_max)[1:]:
        while ctx.regime(t) != reg:  # exact regime boundaries, however many lie in (prev, t]
            prev = _regime_change(ctx, prev, t)
            start(prev)
        if starts[-1] != t and (r.distinct(t) > p.distinct_ratio * d0
                                or r.rows_per_active(t) > p.rows_ratio * rho0):
            start(t)
        prev = t
    ends = [s - 1 for s in starts[1:]] + [block.T_max]
    return _merge_slivers(ctx, list(zip(starts, ends, strict=True)))


def _merge_slivers(ctx: PassContext, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Fold a bucket above the dense grid spanning < SLIVER in T into a same-regime neighbour."""
    out = list(ranges)
    i = 0
    while i < len(out):
        lo, hi = out[i]
        if lo > DENSE_UP_TO and hi < SLIVER * lo:
            reg = ctx.regime(lo)
            if i > 0 and ctx.regime(out[i - 1][0]) == reg:
                out[i - 1: i + 1] = [(out[i - 1][0], hi)]
                continue
            if i + 1 < len(out) and ctx.regime(out[i + 1][0]) == reg:
                out[i: i + 2] = [(lo, out[i + 1][1])]
                continue
        i += 1
    return out


def bucketing(block: MoEBlock, ctx: PassContext) -> ScheduledBlock:
    buckets = []
    for lo, hi in split(block, ctx):
        rep = representative_tokens(lo, hi)
        buckets.append(Bucket(lo=lo, hi=hi, stats=ctx.routing.stats(rep)))
    return ScheduledBlock(block=block, buckets=tuple(buckets))
