"""The default schedule: a tested heuristic of rows per active expert (STYLE §7).

Used for every bucket the dispatch table has no answer for. With T tokens routed top-k over E
experts, uniform routing activates distinct(T) = E·(1 − (1 − k/E)^T) experts, each with
rows(T) = T·k / distinct(T) rows on average (`moetune.passes.stats` when present, else the same
closed form here). The regime orders the kinds:

    rows ≤ GEMV_MAX_ROWS      stream_gemv → hybrid → grouped_gemm
    rows > GEMV_MAX_ROWS      grouped_gemm

Hybrid is not a default under uniform routing: it pays where a few hot experts meet many one-row
ones, which uniform routing does not produce; on the H200 it won none of the 48 cells of
bench/results/nvidia-h200-kernels.md, and the tuned qwen3-30b-a3b table (cache/h200.sqlite) measured
the old hybrid default at 793.6 µs against 288.2 µs for grouped_gemm at T = 33. It stays a fallback
when a backend refuses stream_gemv, and the search tries it wherever the passes propose it.
and the first kind in that order is taken unless the backend refuses it for the block (its reason
from `backend.kinds`) or, for the memory-bound kinds (stream_gemv, hybrid), its own cost model says
it moves more than COST_SLACK × the bytes of the cheapest kind at T (`backend.cost`). The second
guard is what keeps the torch backend on GEMM on CPU: its gathered GEMV copies every pair's weights
(3·T·k·W bytes against distinct·W for the GEMM), and measured 4.2–7.6× slower than the GEMM loop
at T = 1–4 on E=64 k=8 D=1024 F=512 fp32 (one thread); a device backend whose GEMV streams each
expert once keeps the GEMV. The backend supplies the parameters (`backend.default`).
"""

from __future__ import annotations

import dataclasses
import math

from ..codegen.backend import Backend
from ..ir import MoEBlock, Schedule, UnsupportedSchedule
from ..passes import stats
from ..passes.stats import uniform_distinct  # noqa: F401  (re-exported for callers of the default)

GEMV_MAX_ROWS = 1.5
COST_SLACK = 1.5
ORDER = {
    "stream_gemv": ("stream_gemv", "hybrid", "grouped_gemm"),
    "hybrid": ("hybrid", "grouped_gemm"),
    "grouped_gemm": ("grouped_gemm",),
}


def rows_per_active(block: MoEBlock, tokens: int) -> float:
    """Expected rows per active expert at `tokens` under uniform routing (≥ 1 for tokens ≥ 1)."""
    if tokens < 1:
        raise ValueError(f"rows_per_active: tokens = {tokens}, need ≥ 1")
    return float(stats.uniform(block.E, block.k).rows_per_active(tokens))


def default_kind(block: MoEBlock, tokens: int) -> tuple[str, int | None]:
    """(schedule kind, hybrid row threshold or None) for `tokens`, by the regime table above."""
    if rows_per_active(block, tokens) <= GEMV_MAX_ROWS:
        return "stream_gemv", None
    return "grouped_gemm", None


def default_schedule(block: MoEBlock, backend: Backend, tokens: int) -> Schedule:
    """The default Schedule for `tokens` on `backend`, with the backend's own parameters."""
    kind, R = default_kind(block, tokens)
    refusals = backend.kinds(block)
    reasons, offers = [], []
    for choice in ("stream_gemv", "hybrid", "grouped_gemm"):
        why = refusals.get(choice, f"kind {choice} not offered")
        if why:
            reasons.append(f"{choice}: {why}")
            continue
        sch = backend.default(block, choice, tokens)
        if choice == "hybrid":
            sch = dataclasses.replace(
                sch, row_threshold=R or max(2, math.ceil(2 * rows_per_active(block, tokens)))
            )
        offers.append(sch)
    if not offers:
        raise UnsupportedSchedule(
            f"block {block.name or block.signature_hash()} at T={tokens}: backend "
            f"{backend.name} refuses every kind ({'; '.join(reasons)})"
        )
    moved = {s.kind: backend.cost(block, s, tokens)[1] for s in offers}
    cheapest = min(moved.values())
    by_kind = {s.kind: s for s in offers}
    for choice in ORDER[kind]:  # grouped_gemm is never vetoed on bytes: at many rows flops are the limit
        if choice in by_kind and (choice == "grouped_gemm" or moved[choice] <= COST_SLACK * cheapest):
            return by_kind[choice]
    return min(offers, key=lambda s: moved[s.kind])


def representative_tokens(lo: int, hi: int) -> int:
    """The token count a bucket's default is chosen at: the geometric middle of [lo, hi]."""
    return max(lo, min(hi, round(math.sqrt(lo * hi))))
