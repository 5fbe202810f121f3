"""moetune's JAX front end (placeholder docstring, written below)."""

from .capture import Finding, Match
from .compile import compile, explain
from .dispatch import REFERENCE, jax_backend, route, routes
from .experts import SCOPE, experts

__all__ = ["REFERENCE", "SCOPE", "Finding", "Match", "compile", "experts", "explain", "jax_backend", "route",
           "routes"]
