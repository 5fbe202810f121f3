"""Passes: pure IR → IR functions from a captured MoEBlock to a ScheduledBlock, and what they read.

    stats.py       routing statistics model (uniform closed forms; measured per-expert probabilities)
    policy.py      the schedule policy: regimes, default kind, representative T, hybrid threshold
    context.py     PassContext (target, routing model, policy, optional backend)
    bucketing.py   token buckets by regime and routing statistics
    rules/         specialisation rules, one file per regime: stream_gemv, hybrid, grouped_gemm
    specialise.py  runs the rules per bucket
    roofline.py    `floor(block, target, tokens, stats)`, and each bucket's floor
    default_schedule.py  one Schedule per bucket (the fallback heuristic)
    pipeline.py    the ordered pass list, `run_pipeline`, `schedule_block`, `describe`

The targets themselves are `moetune.targets`; routing traces (recorded, synthetic, the file format) are
`moetune.ir.trace`.
"""

from .pipeline import PASSES, PassError, describe, run_pipeline, schedule_block
from .roofline import floor
from .stats import BinomialRouting, ResampledRouting, RoutingModel, from_trace, uniform

__all__ = [
    "PASSES", "PassError", "describe", "run_pipeline", "schedule_block",
    "BinomialRouting", "ResampledRouting", "RoutingModel", "from_trace", "uniform",
    "floor",
]
