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
no Triton. `for_target(name, target)` is the backend for another target description than its own (a TPU
generation's VMEM bounding the Pallas spaces): the one way the search, the CLI and the table get one.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

from ..ir import MoEBlock, Schedule, UnsupportedSchedule
from .space import ParamSpace
from .tensors import ExpertsFn

_REGISTRY: dict[str, Backend] = {}
_FOR_TARGET: dict[tuple[str, str], Backend] = {}
_MODULES = {"torch": "moetune.codegen.torch", "triton": "moetune.codegen.triton",
            "pallas_tpu": "moetune.codegen.pallas_tpu", "pallas_gpu": "moetune.codegen.pallas_gpu"}


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


def for_target(name: str, target: str) -> Backend:
    """Backend `name` whose spaces and defaults read the limits of the target description `target`: the
    registered backend when it already is that target's, or when `target` is not a described target of the
    kind of the backend's own (a torch backend asked for a GPU's table); else one made for it, once (a
    KernelBackend takes its target: `PallasTpuBackend("tpu-v5e")`)."""
    from ..targets import ALIASES, TARGETS, get_target

    be = get(name)
    own = getattr(be, "target", None)
    if own is None or (target not in TARGETS and target not in ALIASES):
        return be
    t = get_target(target)
    if t.name == own.name or t.kind != own.kind:
        return be
    made = _FOR_TARGET.get((name, t.name))
    if made is None:
        made = _FOR_TARGET[(name, t.name)] = type(be)(t.name)
    return made
