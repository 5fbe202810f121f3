"""What every pass sees besides the IR: the target, the routing model and the regime policy.

The regimes, by the expected rows of the active experts at T (see stats.py):

    one_row    share of active experts with ≥ 2 rows ≤ `one_row_share`: nearly every expert batch
               is a single row; the work is streaming the selected experts' weights (GEMV)
    many_rows  share of active experts with ≥ `gemm_rows` rows ≥ `many_rows_share`: nearly every
               expert fills a tensor-core tile; the work is a grouped GEMM
    mixed      in between: a few heavy experts, many light ones (hybrid)

one_row ⇒ share(≥ 2) ≤ 0.25 and many_rows ⇒ share(≥ 2) ≥ 0.75, so the two never touch: a token
range always passes through `mixed` between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..ir import IRError
from .stats import RoutingModel
from .targets import Target

Regime = Literal["one_row", "mixed", "many_rows"]


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
            raise IRError("Policy", "hybrid_thresholds", self.hybrid_thresholds, "each R must be ≥ 2")


@dataclass(frozen=True, eq=False)
class PassContext:
    target: Target
    routing: RoutingModel
    policy: Policy = field(default_factory=Policy)

    def regime(self, T: int) -> Regime:
        p, r = self.policy, self.routing
        if r.share_ge(T, 2) <= p.one_row_share:
            return "one_row"
        if r.share_ge(T, p.gemm_rows) >= p.many_rows_share:
            return "many_rows"
        return "mixed"
