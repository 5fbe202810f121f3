"""What every pass sees besides the IR: the target, the routing model, the policy and, optionally,
the backend whose kernels will run the schedules.

The backend is read through two calls only, `kinds(block)` (the kinds it refuses, with reasons) and
`default(block, kind, T)` / `cost(block, schedule, T)` (its parameters and the bytes they move), so the
default-schedule pass can pick what that backend should run; without one the passes stay
backend-neutral.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..targets import Target
from . import policy as _policy
from .policy import Policy, Regime
from .stats import RoutingModel


@dataclass(frozen=True, eq=False)
class PassContext:
    target: Target
    routing: RoutingModel
    policy: Policy = field(default_factory=Policy)
    backend: Any = None  # a moetune.codegen Backend, or None

    def regime(self, T: int) -> Regime:
        return _policy.regime(self.routing, T, self.policy)
