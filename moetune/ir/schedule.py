"""Schedules: how one token bucket of a MoEBlock is computed.

ScheduleKind
    grouped_gemm  expert-sorted rows in BLOCK_M tiles; tensor-core bound at many rows per expert
    stream_gemv   each selected expert's weights streamed once, no padding rows; HBM bound
    hybrid        experts with ≥ `row_threshold` rows take GEMM tiles, the rest GEMV, in one launch
    fused_gemv    the few-rows regime in one launch: gate/up, activation, down and the k-sum, the weight
                  stream split over every SM; offered while T·k stays small

Passes fill a `ScheduledBlock` (token buckets, each with its routing statistics, floor and candidate
spaces); the search or the default heuristic fixes one `Schedule` per bucket. Backend-specific
tunables (tiles, warps, stages, split-K) live in `Schedule.params`, a frozen dataclass that the
backend declares; the IR only checks that it is one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from .block import MoEBlock, verify
from .errors import IRError

ScheduleKind = Literal["grouped_gemm", "stream_gemv", "hybrid", "fused_gemv"]
SCHEDULE_KINDS: tuple[ScheduleKind, ...] = ("grouped_gemm", "stream_gemv", "hybrid", "fused_gemv")


@dataclass(frozen=True)
class Schedule:
    kind: ScheduleKind
    row_threshold: int | None = None  # hybrid: experts with ≥ this many rows take GEMM tiles
    backend: str | None = None  # a registered backend's name ("torch", "triton"); None while backend-neutral
    params: Any = None  # the backend's frozen parameter dataclass, or None

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise IRError("Schedule", "kind", self.kind, f"supported: {', '.join(SCHEDULE_KINDS)}")
        if self.kind == "hybrid":
            if not isinstance(self.row_threshold, int) or self.row_threshold < 2:
                raise IRError("Schedule(hybrid)", "row_threshold", self.row_threshold, "need an int ≥ 2")
        elif self.row_threshold is not None:
            raise IRError(f"Schedule({self.kind})", "row_threshold", self.row_threshold, "only hybrid has one")
        if self.params is not None:
            if not dataclasses.is_dataclass(self.params) or isinstance(self.params, type):
                raise IRError("Schedule", "params", self.params, "must be a backend parameter dataclass")
            if not type(self.params).__dataclass_params__.frozen:  # type: ignore[attr-defined]
                raise IRError("Schedule", "params", type(self.params).__name__, "must be a frozen dataclass")
        if self.params is not None and self.backend is None:
            raise IRError("Schedule", "backend", None, "params given without the backend they belong to")

    def describe(self) -> str:
        s = self.kind
        if self.row_threshold is not None:
            s += f"(R={self.row_threshold})"
        if self.backend:
            s = f"{self.backend}:{s}"
        if self.params is not None:
            kv = ", ".join(f"{f.name}={getattr(self.params, f.name)}" for f in dataclasses.fields(self.params))
            s += f" [{kv}]"
        return s


@dataclass(frozen=True)
class RoutingStats:
    """Expected expert-batch shape at one token count (uniform routing or a measured trace)."""

    tokens: int
    distinct_experts: float  # expected number of experts with m_e ≥ 1
    rows_per_active: float  # T·k / distinct_experts
    max_rows: float  # expected max_e m_e
    share_ge: tuple[tuple[int, float], ...] = ()  # (r, expected share of active experts with m_e ≥ r)
    source: str = "uniform"


@dataclass(frozen=True)
class Roofline:
    """The floor of a bucket on a target: bytes and flops at its representative token count."""

    target: str
    tokens: int
    bytes: float
    flops: float
    bandwidth: float  # bytes/s
    peak_flops: float  # flop/s

    @property
    def time_s(self) -> float:
        return max(self.bytes / self.bandwidth, self.flops / self.peak_flops)

    @property
    def bound(self) -> str:
        return "memory" if self.bytes / self.bandwidth >= self.flops / self.peak_flops else "compute"


@dataclass(frozen=True)
class CandidateSpace:
    """One schedule kind worth trying in a bucket, with its IR-level knobs' choices."""

    kind: ScheduleKind
    row_thresholds: tuple[int, ...] = ()  # hybrid only
    rule: str = ""  # the specialisation rule that proposed it


@dataclass(frozen=True)
class Refusal:
    kind: ScheduleKind
    rule: str
    reason: str


@dataclass(frozen=True)
class Bucket:
    """Token counts lo ≤ T ≤ hi that share one schedule."""

    lo: int
    hi: int
    stats: RoutingStats | None = None
    floor: Roofline | None = None
    candidates: tuple[CandidateSpace, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    schedule: Schedule | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise IRError("Bucket", "lo..hi", (self.lo, self.hi), "need 1 ≤ lo ≤ hi")

    @property
    def label(self) -> str:
        return f"[{self.lo},{self.hi}]"

    def __contains__(self, tokens: int) -> bool:
        return self.lo <= tokens <= self.hi


@dataclass(frozen=True)
class ScheduledBlock:
    block: MoEBlock
    buckets: tuple[Bucket, ...]

    def bucket_for(self, tokens: int) -> Bucket:
        for b in self.buckets:
            if tokens in b:
                return b
        raise IRError("ScheduledBlock", "tokens", tokens, f"outside every bucket of {self.block.name or 'block'}")

    def replace(self, **changes) -> ScheduledBlock:
        return dataclasses.replace(self, **changes)


def verify_scheduled(sb: ScheduledBlock, *, final: bool = False) -> ScheduledBlock:
    """Buckets cover [1, T_max] in order with no gap or overlap; `final`: one Schedule per bucket."""
    verify(sb.block)
    node = f"ScheduledBlock({sb.block.name or sb.block.signature_hash()})"
    if not sb.buckets:
        raise IRError(node, "buckets", (), "empty")
    expect = 1
    for i, b in enumerate(sb.buckets):
        if b.lo != expect:
            what = "gap" if b.lo > expect else "overlap"
            raise IRError(node, f"buckets[{i}].lo", b.lo, f"{what}: the previous bucket ends at {expect - 1}")
        expect = b.hi + 1
        if final and b.schedule is None:
            raise IRError(node, f"buckets[{i}].schedule", None, f"bucket {b.label} has no schedule")
        if b.stats is not None and b.stats.tokens not in b:
            raise IRError(node, f"buckets[{i}].stats.tokens", b.stats.tokens, f"outside {b.label}")
        if b.schedule is not None and b.schedule.kind == "hybrid" and b.schedule.row_threshold > b.hi:
            raise IRError(node, f"buckets[{i}].schedule.row_threshold", b.schedule.row_threshold,
                          f"no expert can reach it in {b.label}")
    if expect - 1 != sb.block.T_max:
        raise IRError(node, "buckets[-1].hi", expect - 1, f"need T_max = {sb.block.T_max}")
    return sb
