"""The IR: MoEBlock (what a block computes), Schedule / ScheduledBlock (how), symbolic sizes."""

from .block import (
    DTYPE_BYTES,
    DTYPES,
    Activation,
    MoEBlock,
    Router,
    SharedExperts,
    WeightLayout,
    verify,
)
from .errors import (
    CacheError,
    CaptureError,
    ConfigError,
    IRError,
    MoetuneError,
    TunerUnavailable,
    UnsupportedSchedule,
)
from .schedule import (
    SCHEDULE_KINDS,
    Bucket,
    CandidateSpace,
    Fusion,
    Refusal,
    Roofline,
    RoutingStats,
    Schedule,
    ScheduledBlock,
    verify_scheduled,
)
from .symbolic import ExpertRows, SymInt

__all__ = [
    "DTYPES", "DTYPE_BYTES", "Activation", "MoEBlock", "Router", "SharedExperts", "WeightLayout", "verify",
    "CacheError", "CaptureError", "ConfigError", "IRError", "MoetuneError", "TunerUnavailable",
    "UnsupportedSchedule",
    "SCHEDULE_KINDS", "Bucket", "CandidateSpace", "Fusion", "Refusal", "Roofline", "RoutingStats",
    "Schedule", "ScheduledBlock", "verify_scheduled", "ExpertRows", "SymInt",
]
