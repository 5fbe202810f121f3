"""Tiny models built once per test session (read-only: tests that change a model build their own)."""

import functools

import pytest
import torch

from moetune import testing as tm


@functools.cache
def _tiny(family: str, dtype: str) -> torch.nn.Module:
    return tm.build(family, dtype=getattr(torch, dtype))


@pytest.fixture(scope="session")
def tiny():
    """tiny(family, "float32" | "bfloat16") → a shared tiny model; do not modify it."""
    return _tiny
