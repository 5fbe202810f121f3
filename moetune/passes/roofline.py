"""Roofline pass: each bucket gets its floor on the target at its representative token count.

The floor is `targets.floor` with the bucket's routing statistics (expected distinct experts) when they
were taken at that count.
"""

from __future__ import annotations

import dataclasses

from ..ir import ScheduledBlock
from .context import PassContext
from .policy import representative_tokens
from .targets import floor


def roofline(sb: ScheduledBlock, ctx: PassContext) -> ScheduledBlock:
    buckets = []
    for b in sb.buckets:
        T = representative_tokens(b.lo, b.hi)
        buckets.append(dataclasses.replace(b, floor=floor(sb.block, ctx.target, T, b.stats)))
    new = sb.replace(buckets=tuple(buckets))
    return sb if new == sb else new
