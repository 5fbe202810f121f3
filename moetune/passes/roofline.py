"""The roofline floor of an MoE expert block on a target (`floor`), and the roofline pass: each bucket gets its
floor on the target at its representative token count, with the bucket's routing statistics (expected distinct
experts) when they were taken at that count.

Floor of one call of the routed experts at T tokens (the router and the shared experts are not part
of it: they run outside transformers' experts hook, which covers the routed experts alone):

    bytes = distinct_experts · weight_bytes_per_expert         (every selected expert read once, scales too)
          + 2 · T·D · bytes_per_activation                     (x in, y out)
          + T·k · (8 + bytes_per_routing_weight)               (int64 ids, routing weights)
    flops = 2 · 3 · T·k · D·F
    time  = max(bytes / bandwidth, flops / peak)      peak: fp8_flops for FP8 weights where the target has
                                                      FP8 matrix units, else peak_flops

`distinct_experts` is the routing statistics model's expectation at T (uniform routing unless a
measured `RoutingStats` is given). `floor(block, target, tokens, stats=None)` is the one function
the passes, the search and the benchmarks use.
"""

from __future__ import annotations

import dataclasses

from ..ir import DTYPE_BYTES, IRError, MoEBlock, Roofline, RoutingStats, ScheduledBlock
from ..targets import Target, get_target
from .context import PassContext
from .policy import representative_tokens
from .stats import uniform

ROUTING_ID_BYTES = 8  # transformers hands the experts int64 top-k ids


def roofline(sb: ScheduledBlock, ctx: PassContext) -> ScheduledBlock:
    buckets = []
    for b in sb.buckets:
        T = representative_tokens(b.lo, b.hi)
        buckets.append(dataclasses.replace(b, floor=floor(sb.block, ctx.target, T, b.stats)))
    new = sb.replace(buckets=tuple(buckets))
    return sb if new == sb else new


def floor(block: MoEBlock, target: str | Target, tokens: int, stats: RoutingStats | None = None) -> Roofline:
    """The roofline floor of `block`'s routed experts at `tokens` tokens on `target`.

    `stats`: the expected expert-batch shape at `tokens` (its `distinct_experts` is used); uniform
    routing when None.
    """
    t = get_target(target)
    if not isinstance(tokens, int) or tokens < 1:
        raise IRError("floor", "tokens", tokens, "need an int ≥ 1")
    if stats is None:
        stats = uniform(block.E, block.k).stats(tokens)
    elif stats.tokens != tokens:
        raise IRError("floor", "stats.tokens", stats.tokens,
                      f"stats are for another token count than {tokens}")
    act = DTYPE_BYTES[block.weight_format.compute_dtype]
    nbytes = (stats.distinct_experts * block.weight_bytes_per_expert
              + 2 * tokens * block.D * act
              + tokens * block.k * (ROUTING_ID_BYTES + DTYPE_BYTES[block.routing_weight_dtype]))
    flops = 2.0 * 3 * tokens * block.k * block.D * block.F
    return Roofline(target=t.name, tokens=tokens, bytes=float(nbytes), flops=flops,
                    bandwidth=t.bandwidth, peak_flops=peak_flops(block, t))


def peak_flops(block: MoEBlock, target: str | Target) -> float:
    """The matrix-unit rate a floor of `block` is quoted at: FP8's for FP8 weights where the target has it."""
    t = get_target(target)
    if block.weight_format.dtype.startswith("float8") and t.fp8_flops:
        return t.fp8_flops
    return t.peak_flops
