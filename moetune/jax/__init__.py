"""moetune's JAX front end (placeholder docstring, written below)."""

try:
    import jax as _jax  # noqa: F401
except ImportError as e:  # pragma: no cover - the jax extra is not installed
    raise ImportError(f"moetune.jax needs JAX ({e}); pip install 'moetune[jax]'") from e

from .capture import Finding, Match
from .compile import compile, explain
from .dispatch import REFERENCE, jax_backend, route, routes
from .experts import SCOPE, experts

__all__ = ["REFERENCE", "SCOPE", "Finding", "Match", "compile", "experts", "explain", "jax_backend", "route",
           "routes"]
