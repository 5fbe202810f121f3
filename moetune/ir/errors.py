"""Typed errors that carry the object, the value, the limit and the knob."""

from __future__ import annotations


class MoetuneError(Exception):
    """Base class of every error moetune raises on purpose."""


class IRError(MoetuneError):
    """An IR node breaks an invariant: names the node, the field and the values."""

    def __init__(self, node: str, field: str, value: object, why: str):
        self.node, self.field, self.value, self.why = node, field, value, why
        super().__init__(f"{node}.{field} = {value!r}: {why}")


class CaptureError(MoetuneError):
    """A module or config cannot be described as a MoEBlock; the message is the reason."""


class UnsupportedSchedule(MoetuneError):
    """A backend refuses a schedule (or its parameters) for a block, with the reason."""


class CacheError(MoetuneError):
    """A dispatch-table file is unreadable, corrupt or of another version; names the file."""


class ConfigError(MoetuneError):
    """A bad option value (a flag, a file, a setting): names it, the value and what was expected."""


class TunerUnavailable(MoetuneError):
    """The tuner cannot run here (Optuna missing, a backend not usable on this machine): says why."""
