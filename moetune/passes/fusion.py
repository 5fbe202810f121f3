"""Fusion pass: which steps share a kernel, per bucket and candidate (recorded in `Fusion`).

act_in_gate_up    always: SwiGLU and clamped SwiGLU are elementwise over a row's gate/up pair, in
                  either weight layout, so the gate/up kernel's epilogue writes the F-wide hidden row.
weight_in_down    iff the block applies routing weights to the expert *output*; an input-side weight
                  (Llama4) scales x before gate/up and cannot move to the down epilogue.
combine_in_down   stream_gemv: yes (one program per token and D-block loops over the token's k
                  experts, the sum stays in registers). grouped_gemm / hybrid: only when k = 1; with
                  k > 1 a token's k rows live in k expert tiles, and summing them in the epilogue
                  needs atomic adds (order-dependent, and no bf16 atomics), so a separate sum over k
                  runs after the down GEMM.
shared_alongside  iff the block has shared experts inside the block (outside it, e.g. Granite's
                  shared MLP in the decoder layer, the hook never sees them) and their width F_s is a
                  multiple of F: they run as F_s/F more experts that every token selects (a gated
                  shared expert's σ(x·w_gate) is one more per-token weight).
"""

from __future__ import annotations

import dataclasses

from ..ir import CandidateSpace, Fusion, MoEBlock, ScheduledBlock
from .context import PassContext


def decide(block: MoEBlock, c: CandidateSpace) -> Fusion:
    sh = block.shared
    return Fusion(
        act_in_gate_up=True,
        weight_in_down=block.weight_application == "output",
        combine_in_down=c.kind == "stream_gemv" or block.k == 1,
        shared_alongside=sh is not None and sh.inside_block and sh.F % block.F == 0,
    )


def fusion(sb: ScheduledBlock, ctx: PassContext) -> ScheduledBlock:
    buckets = tuple(
        dataclasses.replace(b, candidates=tuple(dataclasses.replace(c, fusion=decide(sb.block, c))
                                                for c in b.candidates))
        for b in sb.buckets)
    new = sb.replace(buckets=buckets)
    return sb if new == sb else new
