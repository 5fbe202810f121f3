"""The pass pipeline: one ordered list of named pure passes, MoEBlock → ScheduledBlock.

    capture            the MoEBlock as captured (not a pass: the pipeline's input)
    bucketing          MoEBlock → ScheduledBlock: token buckets with their routing statistics
    specialise         candidate schedule kinds (and hybrid thresholds) or refusals per bucket
    roofline           each bucket's floor on the target
    default_schedule   one Schedule per bucket: what runs where no tuned entry exists (with a backend
                       in the context, that backend's choice and parameters)

A pass is `pass(ir, ctx) -> ir`, pure, returning its input object when it changes nothing. A pass
that raises is reported as a `PassError` naming it and the passes that ran before it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..ir import IRError, MoEBlock, MoetuneError, ScheduledBlock, verify, verify_scheduled
from ..ir.trace import Trace
from ..targets import DEFAULT_GPU, Target, get_target
from .bucketing import bucketing
from .context import PassContext
from .default_schedule import default_schedule
from .policy import Policy
from .roofline import roofline
from .specialise import specialise
from .stats import RoutingModel, from_trace, uniform

PASSES: tuple[tuple[str, Callable], ...] = (
    ("bucketing", bucketing),
    ("specialise", specialise),
    ("roofline", roofline),
    ("default_schedule", default_schedule),
)


class PassError(MoetuneError):
    def __init__(self, name: str, before: list[str], err: Exception):
        self.pass_name, self.before, self.error = name, before, err
        super().__init__(f"pass {name!r} failed (after {' → '.join(before)}): {type(err).__name__}: {err}")


def routing_for(block: MoEBlock, trace: Trace | RoutingModel | str | Path | None) -> RoutingModel:
    """The routing model of `block`: uniform, or from a trace (object or file) or a ready model."""
    if trace is None:
        return uniform(block.E, block.k)
    if isinstance(trace, (str, Path)):
        trace = Trace.load(trace)
    model = from_trace(trace) if isinstance(trace, Trace) else trace
    if not isinstance(model, RoutingModel):
        raise IRError("run_pipeline", "trace", type(trace).__name__,
                      "need a Trace, a trace file or a RoutingModel")
    if (model.E, model.k) != (block.E, block.k):
        raise IRError(f"MoEBlock({block.name or block.E})", "E/k", (block.E, block.k),
                      f"the routing of {model.source} has E={model.E}, k={model.k}")
    return model


def context(block: MoEBlock, target: str | Target = DEFAULT_GPU, trace=None,
            policy: Policy | None = None, backend=None) -> PassContext:
    return PassContext(get_target(target), routing_for(block, trace), policy or Policy(), backend)


def _with_range(block: MoEBlock, tokens: tuple[int, int] | None) -> MoEBlock:
    if tokens is None:
        return block
    lo, hi = tokens
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise IRError("run_pipeline", "tokens", tokens, "need ints 1 ≤ lo ≤ hi")
    return block if hi == block.T_max else block.replace(T_max=hi)


def run_pipeline(block: MoEBlock, target: str | Target = DEFAULT_GPU, trace=None,
                 tokens: tuple[int, int] | None = None, *, policy: Policy | None = None,
                 backend=None, check: bool = True) -> list[tuple[str, object]]:
    """The IR after each pass, first ("capture", block). `tokens=(lo, hi)` sets T_max = hi; the
    buckets always cover [1, hi] (verify_scheduled demands it), `lo` only has to be valid.

    `backend`: the backend whose kernels will run (its refusals, costs and parameters decide the
    default schedules); None: backend-neutral defaults.
    `check`: verify the IR after every pass (verify / verify_scheduled); a failure is that pass's.
    """
    block = _with_range(block, tokens)
    verify(block)
    ctx = context(block, target, trace, policy, backend)
    out: list[tuple[str, object]] = [("capture", block)]
    ir: object = block
    for name, fn in PASSES:
        try:
            ir = fn(ir, ctx)
            if check:
                verify_scheduled(ir) if isinstance(ir, ScheduledBlock) else verify(ir)
        except Exception as e:
            raise PassError(name, [n for n, _ in out], e) from e
        out.append((name, ir))
    return out


def schedule_block(block: MoEBlock, target: str | Target = DEFAULT_GPU, trace=None,
                   tokens: tuple[int, int] | None = None, *, policy: Policy | None = None,
                   backend=None) -> ScheduledBlock:
    """The final IR of `run_pipeline`."""
    return run_pipeline(block, target, trace, tokens, policy=policy, backend=backend)[-1][1]


# ---------------------------------------------------------------- printing


def describe(ir: object, ctx: PassContext | None = None) -> str:
    """Human-readable IR for `moetune explain --passes`: the block, or a table of buckets."""
    if not isinstance(ir, ScheduledBlock):
        return str(ir)
    sb = ir
    lines = [f"ScheduledBlock {sb.block.name or sb.block.signature_hash()}  E={sb.block.E} k={sb.block.k} "
             f"D={sb.block.D} F={sb.block.F}  {len(sb.buckets)} buckets"
             + (f"  routing: {ctx.routing.source}  target: {ctx.target.name}" if ctx else "")]
    src = next((b.stats.source for b in sb.buckets if b.stats is not None), None)
    if src and not ctx:
        lines[0] += f"  routing: {src}"
    hdr = f"  {'bucket':<13}{'T':>5}{'distinct':>9}{'rows/act':>9}{'max':>7}{'≥2':>5}{'≥16':>5}"
    hdr += f"{'floor µs':>10} {'bound':<8}candidates"
    lines.append(hdr)
    for b in sb.buckets:
        s = b.stats
        row = f"  {b.label:<13}"
        if s is not None:
            sh = dict(s.share_ge)
            pct = "".join(f"{sh[r]:>5.0%}" if r in sh else f"{'-':>5}" for r in (2, 16))
            row += f"{s.tokens:>5}{s.distinct_experts:>9.1f}{s.rows_per_active:>9.2f}{s.max_rows:>7.1f}{pct}"
        else:
            row += " " * 40
        if b.floor is not None:
            row += f"{b.floor.time_s * 1e6:>10.1f} {b.floor.bound:<8}"
        else:
            row += " " * 19
        cands = []
        for c in b.candidates:
            cands.append(c.kind + (f"(R∈{{{','.join(map(str, c.row_thresholds))}}})" if c.row_thresholds else ""))
        row += " ".join(cands)
        if b.schedule is not None:
            row += f"  → {b.schedule.describe()}"
        lines.append(row.rstrip())
        for r in b.refusals:
            lines.append(f"      ✗ {r.kind}: {r.reason}")
    return "\n".join(lines)
