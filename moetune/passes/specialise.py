"""Specialisation pass: every bucket gets the candidate schedule kinds its rules accept.

Runs `rules.RULES` in order on each bucket and records each rule's CandidateSpace or Refusal. A
bucket that every rule refuses is an error naming the bucket and the reasons.
"""

from __future__ import annotations

import dataclasses

from ..ir import CandidateSpace, IRError, ScheduledBlock
from .context import PassContext
from .rules import RULES


def specialise(sb: ScheduledBlock, ctx: PassContext) -> ScheduledBlock:
    buckets = []
    for b in sb.buckets:
        cands, refusals = [], []
        for _name, rule in RULES:
            out = rule(sb.block, b, ctx)
            (cands if isinstance(out, CandidateSpace) else refusals).append(out)
        if not cands:
            node = f"bucket {b.label} of {sb.block.name or sb.block.signature_hash()}"
            raise IRError(node, "candidates", (),
                          "every rule refused: " + " | ".join(f"{x.rule}: {x.reason}" for x in refusals))
        buckets.append(dataclasses.replace(b, candidates=tuple(cands), refusals=tuple(refusals)))
    new = sb.replace(buckets=tuple(buckets))
    return sb if new == sb else new
