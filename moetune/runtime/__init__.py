"""Run time: the compiled model (experts hook + custom op), dispatch by token bucket, defaults.

Importing this package registers "moetune" in transformers' ExpertsInterface (when transformers is
installed) and defines the custom op `moetune::experts`. It never imports the search.
"""

from .compiled import PLANS, Plan, compile, experts_forward, plans, uncompile
from .default import default_kind, default_schedule, rows_per_active
from .dispatch import Dispatcher, DispatchWarning, Route, default_buckets, regime_buckets

__all__ = [
    "PLANS",
    "Plan",
    "compile",
    "experts_forward",
    "plans",
    "uncompile",
    "default_kind",
    "default_schedule",
    "rows_per_active",
    "Dispatcher",
    "DispatchWarning",
    "Route",
    "default_buckets",
    "regime_buckets",
]
