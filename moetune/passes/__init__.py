"""Passes: pure IR → IR functions from a captured MoEBlock to a ScheduledBlock, and what they read.

    stats.py       routing statistics model (uniform closed forms; measured per-expert probabilities)
    trace.py       routing traces: record from a model, the .npz file format, synthetic Zipf traces
    targets.py     the target description table and `floor(block, target, tokens, stats)`
    policy.py      the schedule policy: regimes, default kind, representative T, hybrid threshold
    context.py     PassContext (target, routing model, policy, optional backend)
    bucketing.py   token buckets by regime and routing statistics
    rules/         specialisation rules, one file per regime: stream_gemv, hybrid, grouped_gemm
    specialise.py  runs the rules per bucket
    roofline.py    each bucket's floor
    default_schedule.py  one Schedule per bucket (the fallback heuristic)
    pipeline.py    the ordered pass list, `run_pipeline`, `schedule_block`, `describe`
"""

from .pipeline import PASSES, PassError, describe, run_pipeline, schedule_block
from .stats import BinomialRouting, ResampledRouting, RoutingModel, from_trace, uniform
from .targets import TARGETS, Target, floor, get_target
from .trace import Trace, TraceError, record, synthetic_trace

__all__ = [
    "PASSES", "PassError", "describe", "run_pipeline", "schedule_block",
    "BinomialRouting", "ResampledRouting", "RoutingModel", "from_trace", "uniform",
    "TARGETS", "Target", "floor", "get_target",
    "Trace", "TraceError", "record", "synthetic_trace",
]
