"""The interface every backend offers, and the registry the runtime and the search read.

    class Backend(Protocol):
        name: str                                   # "torch" | "triton" | "pallas_tpu" | "pallas_gpu"
        def available(self) -> str | None            # None when usable here, else the reason
        def kinds(self, block) -> dict[kind, str | None]   # schedule kind → None or refusal reason
        def space(self, block, kind) -> ParamSpace   # the kernel's tunables for that kind
        def default(self, block, kind, tokens) -> Schedule    # tested heuristic params for that kind
        def build(self, block, schedule) -> ExpertsFn         # or raise UnsupportedSchedule(reason)
        def cost(self, block, schedule, tokens) -> tuple[float, float]   # (flops, bytes) it moves
        def sources(self, kind, scheme="none") -> tuple[Path, ...]  # the files of the kind's kernels for a format

The backends of this package implement it from their kernel files' per-kind contract
(`moetune.codegen.contract.KernelBackend`). Backends register themselves with `register(backend)` when
their package is imported; `get(name)` imports the package on first use, so importing moetune pulls in
no Triton.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

from ..ir import MoEBlock, Schedule, UnsupportedSchedule
from .common import ExpertsFn, ParamSpace

_REGISTRY: dict[str, Backend] = {}
_MODULES = {"torch": "moetune.codegen.torch", "triton": "moetune.codegen.triton",
            "pallas_tpu": "moetune.codegen.pallas", "pallas_gpu": "moetune.codegen.pallas_gpu"}


class Backend(Protocol):
    name: str

    def available(self) -> str | None: ...
    def kinds(self, block: MoEBlock) -> dict[str, str | None]: ...
    def space(self, block: MoEBlock, kind: str) -> ParamSpace: ...
    def default(self, block: MoEBlock, kind: str, tokens: int) -> Schedule: ...
    def build(self, block: MoEBlock, schedule: Schedule) -> ExpertsFn: ...
    def cost(self, block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]: ...
    def sources(self, kind: str, scheme: str = "none") -> tuple[Path, ...]: ...


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        if name not in _MODULES:
            raise UnsupportedSchedule(f"unknown backend {name!r}; known: {', '.join(_MODULES)}")
        importlib.import_module(_MODULES[name])
    if name not in _REGISTRY:
        raise UnsupportedSchedule(f"backend {name!r} did not register itself on import")
    return _REGISTRY[name]
