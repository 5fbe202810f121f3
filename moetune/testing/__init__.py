"""Tiny real transformers MoE models for the tests and the demo (families as data: `models.FAMILIES`).

Imported by the tests and the command line only; the compiler layers (ir, passes, codegen, runtime,
search) never import it.
"""

from .models import (
    BASE,
    FAMILIES,
    UNHOOKED,
    VOCAB,
    D,
    F,
    Family,
    build,
    config,
    describe,
    moe_blocks,
    run_forward,
)

__all__ = [
    "BASE", "D", "F", "FAMILIES", "Family", "UNHOOKED", "VOCAB",
    "build", "config", "describe", "moe_blocks", "run_forward",
]
