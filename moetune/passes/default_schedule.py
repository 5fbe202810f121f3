"""Default-schedule pass: one backend-neutral Schedule per bucket from its candidates, by the regime
at its representative T, so that the final IR passes `verify_scheduled(final=True)` and `explain`
shows a complete plan. The runtime's default with a backend's parameters is
`moetune.runtime.default.default_schedule`, which follows the same preference.

    one_row    stream_gemv          mixed    grouped_gemm, else hybrid with the smallest kept R
    many_rows  grouped_gemm         (each falls back to the first candidate the rules proposed)

Hybrid is never preferred on the expected statistics alone: on the H200 it won none of the 48 cells
of bench/results/nvidia-h200-kernels.md; the search tries it wherever the rules propose it.
"""

from __future__ import annotations

import dataclasses

from ..ir import Schedule, ScheduledBlock
from .context import PassContext

PREFERENCE = {"one_row": ("stream_gemv", "hybrid", "grouped_gemm"),
              "mixed": ("grouped_gemm", "hybrid", "stream_gemv"),
              "many_rows": ("grouped_gemm", "hybrid", "stream_gemv")}


def default_schedule(sb: ScheduledBlock, ctx: PassContext) -> ScheduledBlock:
    buckets = []
    for b in sb.buckets:
        if b.schedule is not None or not b.candidates:
            buckets.append(b)
            continue
        T = b.stats.tokens if b.stats is not None else b.lo
        by_kind = {c.kind: c for c in b.candidates}
        kind = next((k for k in PREFERENCE[ctx.regime(T)] if k in by_kind), b.candidates[0].kind)
        c = by_kind[kind]
        R = min(c.row_thresholds) if kind == "hybrid" else None
        buckets.append(dataclasses.replace(b, schedule=Schedule(kind, row_threshold=R, fusion=c.fusion)))
    new = sb.replace(buckets=tuple(buckets))
    return sb if new == sb else new
