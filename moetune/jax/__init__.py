"""moetune's JAX front end (placeholder docstring, written below)."""

from .dispatch import REFERENCE, jax_backend, route, routes
from .experts import SCOPE, experts

__all__ = ["REFERENCE", "SCOPE", "experts", "jax_backend", "route", "routes"]
