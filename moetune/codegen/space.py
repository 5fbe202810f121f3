"""A backend's tunable parameters for one schedule kind (`ParamSpace`): what the tuner searches and the contract's
`space(block, target)` returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParamSpace:
    """A backend's tunable parameters for one schedule kind: field name → allowed values.

    `params_type` is the backend's frozen parameter dataclass; its `__post_init__` may refuse a
    combination (raise UnsupportedSchedule with the reason), which the search scores as infeasible.
    `check`, when given, refuses what the target cannot run (a tile over the shared memory of one block):
    `make` and `admit` call it, so a space built for one target never offers what that target refuses.
    """

    params_type: type
    choices: tuple[tuple[str, tuple], ...]
    check: Callable[[Any], None] | None = field(default=None, compare=False, repr=False)

    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.choices)

    def make(self, **values):
        return self.admit(self.params_type(**values))

    def admit(self, params):
        """`params` when the target can run them; else UnsupportedSchedule from `check` with the reason."""
        if self.check is not None:
            self.check(params)
        return params

    def size(self) -> int:
        n = 1
        for _, vals in self.choices:
            n *= len(vals)
        return n

    def grid(self):
        """Every combination, in order (refused ones included: `make` raises for those)."""
        import itertools

        names = self.names()
        for combo in itertools.product(*(vals for _, vals in self.choices)):
            yield dict(zip(names, combo, strict=True))
