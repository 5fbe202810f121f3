"""Default-schedule pass: one Schedule per bucket, the one a compiled model runs where its dispatch
table has no entry (the runtime's defaults are this pass's output).

The kind is `policy.default_kind` at the bucket's representative T among the kinds the rules propose.
With a backend in the context, the kinds it refuses are left out, its cost model can veto a
memory-bound kind, and the Schedule carries the backend's own parameters (`backend.default`); without
one the Schedule is backend-neutral. A hybrid's row threshold is `policy.hybrid_threshold` over the
thresholds the hybrid rule kept; a hybrid whose threshold no expert can reach in the bucket is not offered
(it matters where the backend has no kernel of the kind the rules prefer there).
"""

from __future__ import annotations

import dataclasses

from ..ir import Bucket, IRError, MoEBlock, MoetuneError, Schedule, ScheduledBlock
from .context import PassContext
from .policy import POLICY, SCHEDULE_ORDER, default_kind, hybrid_threshold, representative_tokens


def bucket_default(block: MoEBlock, b: Bucket, ctx: PassContext) -> Schedule:
    """The default Schedule of bucket `b` (module doc)."""
    T = representative_tokens(b.lo, b.hi)
    rows = ctx.routing.rows_per_active(T)
    proposed = {c.kind: c for c in b.candidates}
    hybrid = proposed.get("hybrid")
    allowed = hybrid.row_thresholds if hybrid else ctx.policy.hybrid_thresholds or POLICY.hybrid_thresholds
    R = hybrid_threshold(rows, allowed)
    be = ctx.backend
    if be is None:
        kind = default_kind(ctx.regime(T), list(proposed), list(proposed))
        return Schedule(kind, row_threshold=R if kind == "hybrid" else None)
    refused = be.kinds(block)
    offers, reasons = {}, []
    for kind in SCHEDULE_ORDER:
        why = refused.get(kind, f"kind {kind} not offered")
        if why is None and kind == "hybrid" and R > b.hi:
            why = f"its row threshold {R} is out of reach in {b.label}"
        if why is None:
            try:
                s = be.default(block, kind, T)
                offers[kind] = dataclasses.replace(s, row_threshold=R) if kind == "hybrid" else s
                continue
            except MoetuneError as e:
                why = str(e)
        reasons.append(f"{kind}: {why}")
    if not offers:
        raise IRError(f"bucket {b.label} of {block.name or block.signature_hash()}", "schedule", None,
                      f"backend {be.name} refuses every kind ({'; '.join(reasons)})")
    moved = {k: be.cost(block, s, T)[1] for k, s in offers.items()}
    return offers[default_kind(ctx.regime(T), list(proposed), list(offers), moved)]


def default_schedule(sb: ScheduledBlock, ctx: PassContext) -> ScheduledBlock:
    buckets = tuple(b if b.schedule is not None else dataclasses.replace(b, schedule=bucket_default(sb.block, b, ctx))
                    for b in sb.buckets)
    new = sb.replace(buckets=buckets)
    return sb if new == sb else new
