"""Tuning for a TPU without one: every candidate verified and lowered, the winner chosen by a cost model.

    estimate_block(block, "tpu-v5e", (1, 64), table=DispatchTable(path), space_cap=8)   # every bucket

Per bucket of the passes, every candidate of its search space (the capped sub-grid with `space_cap`,
space.cap_space), the runtime's default first, goes through three stages:

1. verified: built by the Pallas TPU backend of the tuned target (`codegen.backend.for_target`: its VMEM
   bounds the space) and checked against the float32 reference on fresh random inputs at
   T = min(VERIFY_TOKENS, the bucket's representative count) in TPU interpret mode (the search's own check,
   `Objective.verify`; MOETUNE_PALLAS_INTERPRET set for the run where no TPU is visible). The check runs on
   the block itself while its expert weights take at most VERIFY_WEIGHT_BYTES; a larger block is checked on
   a copy with fewer experts (`verify_block`: k, D, F, layout and format kept, so every tile and every
   kernel parameter is the block's own; only the expert count, and so the rows per expert, differ).
2. lowered: the same schedule built again on the block's real shape, traced with jax.ShapeDtypeStruct
   arguments at the bucket's token counts (first, representative, last) and lowered for TPU, interpret
   off (`codegen.pallas_tpu.lowering`): Mosaic checks the TPU's tiling rules there, which interpret mode does
   not. A candidate Mosaic refuses is out.
3. estimated, at the representative count (the cost model):

       time = max(bytes / (bandwidth · s), flops / (peak · s)) + Σ_pallas_calls steps per core · grid_step_s

   (flops, bytes) from the kind's `cost(block, schedule, T)`; bandwidth, peak (FP8's for FP8 weights where
   the target has it) and grid_step_s from the target (moetune.targets, the figures its floor uses);
   s = 1 where every pallas_call's leading grid axis is parallel (split over the chip's TensorCores), else
   1/cores (one core's share of the chip); steps per core: the grid's product, its leading axis divided by
   the cores where it is parallel (`GridCall.steps_per_core`). What the model leaves out: XLA ops around the
   kernel, DMA latency a pipeline does not hide, VMEM bank conflicts; it ranks candidates by the bytes they
   move, the flops they do and the grid steps they pay for.

The fastest estimate wins (the earlier candidate on a tie: the default first) and is written to the table
as an estimate row (`DispatchEntry.estimated`), its floor, the default's estimate and the candidate count
with it: such a row never replaces or splits a measured one, and a measured entry always replaces it
(runtime.table). Nothing here is timed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..codegen.backend import for_target
from ..ir import Bucket, ConfigError, MoEBlock, Roofline, Schedule, TunerUnavailable, UnsupportedSchedule
from ..passes.policy import representative_tokens
from ..passes.roofline import peak_flops
from ..runtime.entry import DispatchEntry
from ..runtime.table import DispatchTable
from ..runtime.versions import Versions
from ..targets import Target, get_target
from .objective import CandidateError, Objective, expert_tensors, make_cases, repro
from .seeds import default_schedules, runtime_default
from .space import build_space, cap_space, key

BACKEND = "pallas_tpu"
VERIFY_TOKENS = 8  # the token count candidates are checked at (the bucket's representative one when smaller)
VERIFY_WEIGHT_BYTES = 512 << 20  # expert weights a check allocates at most (verify_block)
MODEL = "cost model: max(bytes/bandwidth, flops/peak) + grid steps × the target's grid step cost"


@dataclass(frozen=True)
class Candidate:
    """One candidate's fate: status verified → lowered → estimated, or where it stopped and why."""

    schedule: Schedule
    status: str  # estimated | refused | lowering_refused | wrong | nonfinite | resource | <stage>_failed
    reason: str = ""
    verified: bool = False  # passed its check against the reference
    time_s: float = math.inf  # the estimate (status "estimated")
    steps: int = 0  # grid steps per core at the representative count
    flops: float = 0.0
    bytes: float = 0.0


@dataclass(frozen=True)
class EstimateResult:
    bucket: tuple[int, int]
    tokens: int  # the representative count: the estimate's and the floor's
    winner: Schedule | None
    time_s: float  # the winner's estimate (inf: none)
    floor: Roofline | None
    default: Schedule | None = None
    default_time_s: float | None = None  # the default's estimate, where it got one
    candidates: int = 0
    verified: int = 0
    lowered: int = 0
    refused: int = 0  # by the backend (its parameters, its space on this target) or by the TPU lowering
    lowering_refused: int = 0  # of `refused`: by the TPU lowering
    failures: dict[str, int] = field(default_factory=dict)  # status → count: wrong, nonfinite, ...
    reasons: tuple[str, ...] = ()  # the first few refusals and failures, one line each
    written: bool = False
    note: str = ""
    space: str = ""

    @property
    def pct_of_floor(self) -> float | None:
        if self.floor is None or not math.isfinite(self.time_s):
            return None
        return 100.0 * self.floor.time_s / self.time_s


# ------------------------------------------------------------------------------------- the cost model


def estimate_s(block: MoEBlock, target: str | Target, flops: float, nbytes: float, calls) -> float:
    """The cost model's time of a kernel moving `nbytes` and doing `flops` through the pallas_calls `calls`
    (lowering.GridCall) on `target` (module doc)."""
    t = get_target(target)
    spread = bool(calls) and all(c.parallel for c in calls)
    share = 1.0 if spread else 1.0 / t.cores
    roof = max(nbytes / (t.bandwidth * share), flops / (peak_flops(block, t) * share))
    return roof + grid_steps(calls, t) * (t.grid_step_s or 0.0)


def grid_steps(calls, target: str | Target) -> int:
    """Grid steps one TensorCore of `target` runs over the pallas_calls `calls`."""
    t = get_target(target)
    return sum(c.steps_per_core(t.cores) for c in calls)


# --------------------------------------------------------------------------------------- verification


def verify_block(block: MoEBlock) -> tuple[MoEBlock, str]:
    """The block the candidates are checked on, and what it is: the block itself while its expert weights
    fit VERIFY_WEIGHT_BYTES, else a copy with the fewest experts that keeps 2·k of them (a multiple of the
    router's groups) within that, or 2·k."""
    per = block.weight_bytes_per_expert
    if block.E * per <= VERIFY_WEIGHT_BYTES:
        return block, f"the block itself (E={block.E})"
    g = block.router.n_group
    E = max(2 * block.k, int(VERIFY_WEIGHT_BYTES // per))
    E = min(block.E, -(-E // g) * g)
    return block.replace(E=E), (f"a reduced-E copy: E={E} of {block.E} (k, D, F, layout and weight format "
                                "kept: every tile and kernel parameter is the block's)")


def verify_tokens(bucket: Bucket) -> int:
    return min(VERIFY_TOKENS, representative_tokens(bucket.lo, bucket.hi))


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    """MOETUNE_PALLAS_INTERPRET set for the run where no TPU is visible and it is not set already (TPU
    interpret mode: codegen.pallas_tpu._common.interpret); as it was afterwards."""
    from ..codegen.pallas_tpu._common import INTERPRET_ENV, interpret_requested, on_tpu

    if interpret_requested() is not None or on_tpu():
        yield
        return
    before = os.environ.get(INTERPRET_ENV)
    os.environ[INTERPRET_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INTERPRET_ENV, None)
        else:
            os.environ[INTERPRET_ENV] = before


# ---------------------------------------------------------------------------------------- the buckets


@dataclass(frozen=True)
class EstimateOptions:
    space_cap: int | None = None
    seed: int = 0
    strict: bool = False  # re-raise every candidate failure, refusals included
    keep_going: bool = False  # score unknown failures (a kernel's bug) as failed instead of raising

    def __post_init__(self) -> None:
        if self.space_cap is not None and self.space_cap < 1:
            raise ConfigError(f"EstimateOptions.space_cap = {self.space_cap!r}: need at least 1 point (None: the "
                              "whole space)")


def estimate_block(block: MoEBlock, target: str, tokens: tuple[int, int] = (1, 1024), *,
                   table: DispatchTable | None = None, options: EstimateOptions | None = None,
                   at_tokens: Sequence[int] | None = None,
                   on_bucket: Callable[[int, int, EstimateResult], None] | None = None) -> list[EstimateResult]:
    """Verify, lower and estimate every candidate of every bucket the passes make of `block` on `tokens` for
    the TPU `target` (module doc); write each bucket's winner to `table` as an estimate row. With
    `at_tokens`, only the buckets holding one of those counts."""
    from ..passes.pipeline import schedule_block

    options = options or EstimateOptions()
    t = get_target(target)
    if t.kind != "tpu":
        raise ConfigError(f"target {target!r}: estimates are made for a TPU target (tpu-v5e, tpu-v6e, tpu-v7), "
                          f"this is a {t.kind}")
    be = for_target(BACKEND, t.name)
    block = block.replace(T_max=max(block.T_max, tokens[1])) if block.T_max < tokens[1] else block
    with interpreting():
        why = be.available()
        if why:
            raise TunerUnavailable(f"backend {BACKEND} is not usable here: {why}")
        sb = schedule_block(block, t.name, tokens=tokens)
        buckets = [b for b in sb.buckets if b.hi >= tokens[0] and b.lo <= tokens[1]]
        if at_tokens is not None:
            buckets = [b for b in buckets if any(b.lo <= x <= b.hi for x in at_tokens)]
        vblock, _ = verify_block(block)
        w = expert_tensors(vblock, seed=options.seed)
        from ..codegen.pallas_tpu._common import on_tpu

        versions = Versions.current(BACKEND, "tpu" if on_tpu() else "cpu") if table is not None else None
        results = []
        for i, b in enumerate(buckets):
            r = estimate_bucket(block, be, t.name, b, vblock, w, options)
            if table is not None and r.winner is not None:
                r = dataclasses.replace(r, written=_write(table, block, t.name, r, versions))
            results.append(r)
            if on_bucket:
                on_bucket(i, len(buckets), r)
    return results


def estimate_bucket(block: MoEBlock, be, target: str, bucket: Bucket, vblock: MoEBlock, w,
                    options: EstimateOptions) -> EstimateResult:
    """One bucket (module doc): every candidate verified on `vblock` with weights `w`, lowered and estimated
    on `block`; the result with the fastest estimate."""
    rep = representative_tokens(bucket.lo, bucket.hi)
    try:
        space = build_space(block, be, bucket)
    except UnsupportedSchedule as e:
        if options.strict:
            raise
        return EstimateResult((bucket.lo, bucket.hi), rep, None, math.inf, bucket.floor, note=f"not tuned: {e}")
    default = runtime_default(block, be, target, bucket)
    firsts = default_schedules(block, be, space, rep, first=default)
    if options.space_cap:
        space = cap_space(space, options.space_cap, firsts)
    todo, refused, reasons, seen = [], 0, [], set()
    for s in [*([default] if default is not None else []), *firsts, *space.grid()]:
        if isinstance(s, UnsupportedSchedule):  # a combination the params class or the target refuses
            if options.strict:
                raise s
            refused += 1
            _say(reasons, f"refused: {s}")
        elif key(s) not in seen:
            seen.add(key(s))
            todo.append(s)
    Tv = verify_tokens(bucket)
    gen = torch.Generator().manual_seed(options.seed * 1_000_003 + bucket.lo)
    objective = Objective(vblock, be, None, make_cases(vblock, w, Tv, 1, gen), (Tv,), seed=options.seed + bucket.lo,
                          strict=options.strict, keep_going=options.keep_going)
    counts = sorted({bucket.lo, rep, bucket.hi})
    done = [_candidate(block, be, target, s, objective, counts, rep, options) for s in todo]
    n = len(todo) + refused
    estimated = [c for c in done if c.status == "estimated"]
    lrefused = sum(c.status == "lowering_refused" for c in done)
    failures: dict[str, int] = {}
    for c in done:
        if c.status in ("refused", "lowering_refused"):
            refused += 1
        elif c.status != "estimated":
            failures[c.status] = failures.get(c.status, 0) + 1
        if c.status != "estimated":
            _say(reasons, f"{c.status}: {c.schedule.describe()}: {c.reason}")
    best = min(estimated, key=lambda c: c.time_s, default=None)  # min keeps the first of equals
    dflt = next((c for c in estimated if default is not None and key(c.schedule) == key(default)), None)
    note = "" if best else "no candidate verified and lowered: the runtime keeps its default"
    return EstimateResult(
        (bucket.lo, bucket.hi), rep, best.schedule if best else None, best.time_s if best else math.inf,
        bucket.floor, default=default, default_time_s=dflt.time_s if dflt else None, candidates=n,
        verified=sum(c.verified for c in done), lowered=len(estimated), refused=refused, lowering_refused=lrefused,
        failures=failures, reasons=tuple(reasons), note=note, space=space.describe())


_REASONS = 6  # refusals and failures kept per bucket for the report


def _say(reasons: list[str], line: str) -> None:
    if len(reasons) < _REASONS:
        reasons.append(" ".join(line.split())[:300])


def _candidate(block: MoEBlock, be, target: str, s: Schedule, objective: Objective, counts: list[int], rep: int,
               options: EstimateOptions) -> Candidate:
    """Verify `s`, lower it at every count of `counts`, estimate it at `rep`."""
    from ..codegen.pallas_tpu.lowering import LoweringRefused, TraceFailed, lower, reset_interpret

    checked = objective.verify(s)
    if checked.status != "verified":
        reset_interpret()  # a kernel that raised inside TPU interpret mode leaves it to be reset
        return Candidate(s, checked.status, checked.reason.split("\nrepro:")[0])
    calls = None
    for T in counts:
        try:
            low = lower(be, block, s, T)
        except LoweringRefused as e:
            if options.strict:
                raise
            return Candidate(s, "lowering_refused", str(e), verified=True)
        except UnsupportedSchedule as e:
            if options.strict:
                raise
            return Candidate(s, "refused", f"at the real shape, T={T}: {e}", verified=True)
        except TraceFailed as e:
            if options.strict or not options.keep_going:
                raise CandidateError(s, f"trace for TPU at T={T}", e.error,
                                     repro(block, s, T, "cpu")) from e.error
            return Candidate(s, "trace_failed", f"T={T}: {e}", verified=True)
        if T == rep:
            calls = low.calls
    flops, nbytes = be.cost(block, s, rep)
    return Candidate(s, "estimated", verified=True, time_s=estimate_s(block, target, flops, nbytes, calls),
                     steps=grid_steps(calls, target), flops=flops, bytes=nbytes)


def _write(table: DispatchTable, block: MoEBlock, target: str, r: EstimateResult, versions: Versions) -> bool:
    e = DispatchEntry.of(
        target=target, block=block, bucket=r.bucket, schedule=r.winner, time_us=r.time_s * 1e6, versions=versions,
        floor_us=r.floor.time_s * 1e6 if r.floor is not None else None,
        default_time_us=None if r.default_time_s is None else r.default_time_s * 1e6,
        baseline=None, timer=f"{MODEL} ({target})", trials=r.candidates, estimated=True)
    return table.put(e, supersede=True)
