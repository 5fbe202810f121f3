"""The default schedule: a tested heuristic of rows per active expert (STYLE §7).

Used for every bucket the dispatch table has no answer for. With T tokens routed top-k over E
experts, uniform routing activates distinct(T) = E·(1 − (1 − k/E)^T) experts, each with
rows(T) = T·k / distinct(T) rows on average (`moetune.passes.stats` when present, else the same
closed form here). The regime decides the kind:

    rows ≤ GEMV_MAX_ROWS                    stream_gemv   nothing to batch: read each expert once, no tiles
    GEMV_MAX_ROWS < rows < GEMM_MIN_ROWS    hybrid        R = max(2, ⌈2·rows⌉): experts well above the mean
                                                          take GEMM rows, the one-row majority GEMV
    rows ≥ GEMM_MIN_ROWS                    grouped_gemm  every active expert has a batch worth a GEMM

A kind the backend refuses for the block (its reason from `backend.kinds`) falls back along
stream_gemv → hybrid → grouped_gemm, and the backend supplies its parameters (`backend.default`).
"""

from __future__ import annotations

import dataclasses
import math

from ..codegen.backend import Backend
from ..ir import MoEBlock, Schedule, UnsupportedSchedule

GEMV_MAX_ROWS = 1.5
GEMM_MIN_ROWS = 4.0
FALLBACK = {"stream_gemv": ("stream_gemv", "hybrid", "grouped_gemm"),
            "hybrid": ("hybrid", "grouped_gemm"),
            "grouped_gemm": ("grouped_gemm",)}


def uniform_distinct(E: int, k: int, T: int) -> float:
    """E·(1 − (1 − k/E)^T): expected experts with ≥ 1 row under uniform routing."""
    return E * (1.0 - (1.0 - k / E) ** T) if T > 0 else 0.0


def rows_per_active(block: MoEBlock, tokens: int) -> float:
    """Expected rows per active expert at `tokens` under uniform routing (≥ 1 for tokens ≥ 1)."""
    if tokens < 1:
        raise ValueError(f"rows_per_active: tokens = {tokens}, need ≥ 1")
    try:
        from ..passes import stats
    except ImportError:  # the passes are optional to a deployment
        stats = None
    if stats is not None and hasattr(stats, "uniform"):
        return float(stats.uniform(block.E, block.k).rows_per_active(tokens))
    return tokens * block.k / uniform_distinct(block.E, block.k, tokens)


def default_kind(block: MoEBlock, tokens: int) -> tuple[str, int | None]:
    """(schedule kind, hybrid row threshold or None) for `tokens`, by the regime table above."""
    rows = rows_per_active(block, tokens)
    if rows <= GEMV_MAX_ROWS:
        return "stream_gemv", None
    if rows >= GEMM_MIN_ROWS:
        return "grouped_gemm", None
    return "hybrid", min(max(2, math.ceil(2 * rows)), max(2, tokens))


def default_schedule(block: MoEBlock, backend: Backend, tokens: int) -> Schedule:
    """The default Schedule for `tokens` on `backend`, with the backend's own parameters."""
    kind, R = default_kind(block, tokens)
    refusals = backend.kinds(block)
    reasons = []
    for choice in FALLBACK[kind]:
        why = refusals.get(choice, f"kind {choice} not offered")
        if why:
            reasons.append(f"{choice}: {why}")
            continue
        sch = backend.default(block, choice, tokens)
        if choice == "hybrid":
            sch = dataclasses.replace(sch, row_threshold=R or 2)
        return sch
    raise UnsupportedSchedule(f"block {block.name or block.signature_hash()} at T={tokens}: backend "
                              f"{backend.name} refuses every kind ({'; '.join(reasons)})")


def representative_tokens(lo: int, hi: int) -> int:
    """The token count a bucket's default is chosen at: the geometric middle of [lo, hi]."""
    return max(lo, min(hi, round(math.sqrt(lo * hi))))
