"""torch backend: the float32 reference and the CPU schedule variants (registered as "torch")."""

from ..backend import register
from .backend import BACKEND, TorchBackend
from .reference import apply_activation, experts_reference, split_gate_up
from .tolerance import tolerances, worst_error

register(BACKEND)

__all__ = [
    "BACKEND",
    "TorchBackend",
    "apply_activation",
    "experts_reference",
    "split_gate_up",
    "tolerances",
    "worst_error",
]
