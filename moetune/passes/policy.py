"""The schedule policy: every rule that decides which schedule kind runs where, written once.

The passes (bucketing, the specialisation rules, the default schedule), the runtime's defaults, the
search and `explain` all call these functions, so what `explain` prints for a bucket is what a
compiled model runs there when its dispatch table has no entry.

Regimes, by the routing model's expectations at T (stats.py):

    one_row    share of active experts with ≥ 2 rows ≤ `one_row_share`: nearly every expert batch
               is a single row; the work is streaming the selected experts' weights (GEMV)
    many_rows  share of active experts with ≥ `gemm_rows` rows ≥ `many_rows_share`: nearly every
               expert fills a tensor-core tile; the work is a grouped GEMM
    mixed      in between: a few heavy experts, many light ones

one_row ⇒ share(≥ 2) ≤ 0.25 and many_rows ⇒ share(≥ 2) ≥ 0.75, so the two never touch: a token
range always passes through `mixed` between them.

The default kind of a bucket is the first kind of its regime's `PREFERENCE` that the specialisation
rules propose and the backend offers. A memory-bound kind (stream_gemv, hybrid) is passed over when the
backend's own cost model says it moves more than `COST_SLACK` × the bytes of the cheapest offer (a
GEMV that copies every pair's weights streams more than a GEMM that reads each expert once); when every
proposed kind is passed over, the offer that moves the fewest bytes runs. Hybrid is never preferred
on expected statistics alone: it pays where a few hot experts meet many one-row ones, which the
expectations of a uniform router do not show; the search tries it wherever the rules propose it.

A bucket [lo, hi] is judged, timed and given its floor at one token count, `representative_tokens`:
the geometric middle of its ends, rounded ([1, 1] → 1, [64, 256] → 128).

The hybrid's row threshold R (experts with ≥ R rows take GEMM tiles) is, among the thresholds allowed
(the hybrid rule's kept ones, or `Policy.hybrid_thresholds`), the one nearest twice the rows per active
expert: an expert with about the mean row count streams, one with twice as many takes a tile.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..ir import IRError, MoEBlock
from .stats import RoutingModel, uniform

Regime = Literal["one_row", "mixed", "many_rows"]

PREFERENCE: dict[Regime, tuple[str, ...]] = {
    "one_row": ("stream_gemv", "fused_gemv", "hybrid", "grouped_gemm"),
    "mixed": ("grouped_gemm", "hybrid", "stream_gemv", "fused_gemv"),
    "many_rows": ("grouped_gemm", "hybrid", "stream_gemv", "fused_gemv"),
}
SCHEDULE_ORDER = ("fused_gemv", "stream_gemv", "hybrid", "grouped_gemm")  # the kinds, as reports list them
MEMORY_BOUND_KINDS = ("fused_gemv", "stream_gemv", "hybrid")
COST_SLACK = 1.5


@dataclass(frozen=True)
class Policy:
    one_row_share: float = 0.25  # one_row while share(≥ 2 rows) ≤ this
    gemm_rows: int = 16  # rows per expert where a tensor-core tile stops wasting most of itself
    many_rows_share: float = 0.75  # many_rows once share(≥ gemm_rows) ≥ this
    distinct_ratio: float = 1.5  # a bucket's expected distinct experts vary at most by this factor
    rows_ratio: float = 2.0  # … and its rows per active expert by this one
    gemv_default_rows: int = 8  # GEMV row limit on targets without a vector-unit rate
    gemv_max_heavy_rows: float = 0.25  # GEMV refused once this share of rows sits above its row limit
    hybrid_thresholds: tuple[int, ...] = (4, 8, 16, 32)  # candidate R (GEMM tiles for m_e ≥ R)
    hybrid_min_heavy_rows: float = 0.2  # hybrid needs this share of rows in experts with ≥ R rows
    hybrid_min_light: float = 0.2  # … and this share of active experts with < R rows
    fused_max_pairs: int = 64  # fused_gemv (one launch) offered while T·k ≤ this at a bucket's largest T

    def __post_init__(self) -> None:
        if not 0 < self.one_row_share < 0.5 < self.many_rows_share <= 1:
            raise IRError("Policy", "one_row_share/many_rows_share",
                          (self.one_row_share, self.many_rows_share),
                          "need 0 < one_row_share < 0.5 < many_rows_share ≤ 1 (keeps the regimes apart)")
        if self.gemm_rows < 2:
            raise IRError("Policy", "gemm_rows", self.gemm_rows, "need ≥ 2")
        if self.distinct_ratio <= 1 or self.rows_ratio <= 1:
            raise IRError("Policy", "distinct_ratio/rows_ratio", (self.distinct_ratio, self.rows_ratio),
                          "need > 1")
        if any(r < 2 for r in self.hybrid_thresholds):
            raise IRError("Policy", "hybrid_thresholds", self.hybrid_thresholds, "each R must be ≥ 2 (none: no hybrid)")


POLICY = Policy()


def regime(routing: RoutingModel, T: int, policy: Policy = POLICY) -> Regime:
    """The regime of `T` tokens under `routing` (module doc)."""
    if routing.share_ge(T, 2) <= policy.one_row_share:
        return "one_row"
    if routing.share_ge(T, policy.gemm_rows) >= policy.many_rows_share:
        return "many_rows"
    return "mixed"


def representative_tokens(lo: int, hi: int) -> int:
    """The one token count a bucket [lo, hi] is judged, timed and floored at: its geometric middle."""
    if not 1 <= lo <= hi:
        raise IRError("representative_tokens", "lo..hi", (lo, hi), "need 1 ≤ lo ≤ hi")
    return min(hi, max(lo, round(math.sqrt(lo * hi))))


def rows_per_active(block: MoEBlock, T: int) -> float:
    """Expected rows per active expert at `T` tokens under uniform routing (≥ 1 for T ≥ 1): the
    quantity kernel-parameter heuristics are written in."""
    if not isinstance(T, int) or T < 1:
        raise IRError("rows_per_active", "T", T, "need an int ≥ 1")
    return float(uniform(block.E, block.k).rows_per_active(T))


def hybrid_threshold(rows: float, allowed: Sequence[int] = POLICY.hybrid_thresholds) -> int:
    """The row threshold R of a hybrid schedule at `rows` rows per active expert: the allowed R nearest
    2·rows (ties: the smaller)."""
    if not allowed:
        raise IRError("hybrid_threshold", "allowed", tuple(allowed), "need at least one R")
    return min(allowed, key=lambda R: (abs(R - 2 * rows), R))


def kept_thresholds(routing: RoutingModel, T: int, hi: int, gemv_rows: int,
                    policy: Policy = POLICY) -> tuple[tuple[int, ...], list[str]]:
    """The hybrid thresholds worth trying in a bucket ending at `hi`, judged at its representative `T`,
    and why each other one was dropped. R is kept when R ≤ hi (an expert can reach it), R − 1 ≤ the
    target's GEMV row limit `gemv_rows` (the light side stays memory-bound), experts with ≥ R rows carry
    ≥ `hybrid_min_heavy_rows` of the rows and ≥ `hybrid_min_light` of the active experts have < R rows."""
    kept, why = [], []
    for R in policy.hybrid_thresholds:
        if R > hi or R - 1 > gemv_rows:
            why.append(f"R={R}: needs R ≤ T_hi = {hi} and R − 1 ≤ GEMV row limit {gemv_rows}")
            continue
        heavy, light = routing.row_share_ge(T, R), 1.0 - routing.share_ge(T, R)
        if heavy < policy.hybrid_min_heavy_rows:
            why.append(f"R={R}: {heavy:.0%} of rows in experts with ≥ R rows "
                       f"(need {policy.hybrid_min_heavy_rows:.0%})")
        elif light < policy.hybrid_min_light:
            why.append(f"R={R}: {light:.0%} of active experts below R rows (need {policy.hybrid_min_light:.0%})")
        else:
            kept.append(R)
    return tuple(kept), why


def default_kind(reg: Regime, proposed: Sequence[str], offered: Sequence[str],
                 moved: Mapping[str, float] | None = None) -> str:
    """The default kind of a bucket in regime `reg` (module doc). `proposed`: the kinds the rules keep;
    `offered`: the kinds the backend can build for the block; `moved`: bytes each offered kind moves at
    the bucket's representative T by the backend's cost model (None: no backend, no veto)."""
    if not offered:
        raise IRError("default_kind", "offered", tuple(offered), "the backend offers no kind")
    cheapest = min(moved.values()) if moved else None

    def streams_sensibly(kind: str) -> bool:
        return (moved is None or kind not in MEMORY_BOUND_KINDS or kind not in moved
                or moved[kind] <= COST_SLACK * cheapest)

    for kind in PREFERENCE[reg]:
        if kind in proposed and kind in offered and streams_sensibly(kind):
            return kind
    if moved:
        return min((k for k in offered if k in moved), key=lambda k: (moved[k], PREFERENCE[reg].index(k)))
    return next((k for k in PREFERENCE[reg] if k in offered), offered[0])
