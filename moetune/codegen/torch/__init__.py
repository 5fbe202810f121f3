"""torch backend: the float32 reference and the CPU schedule variants."""

from .reference import apply_activation, experts_reference, split_gate_up

__all__ = ["apply_activation", "experts_reference", "split_gate_up"]
