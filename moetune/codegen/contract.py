"""The per-kind kernel contract every backend implements, and the Backend built from it.

A backend is one folder (torch/, triton/) with one kernel file per schedule kind. Each kernel file ends
with a `KernelKind` naming what it provides for its kind:

    params          the frozen parameter dataclass of the kind's kernels (checked in __post_init__)
    space           space(block, target) -> ParamSpace       the tunables, with the target's limits
    default_params  default_params(block, T, target) -> params   the backend's tile rule at T (its tiles.py)
    build           build(block, schedule) -> ExpertsFn      or raise UnsupportedSchedule(reason)
    cost            cost(block, schedule, T) -> (flops, bytes)   what one call at T tokens moves
    sources         the files whose code the kind's kernels are made of, declared beside the kernel
                    (module-level SOURCES, names in the kernel file's folder): what versions the kind
    refusal         refusal(block) -> str | None             why the kind cannot run the block (None: it can)
    formats         the weight-format schemes its kernels read (MoEBlock.weight_format.scheme); a block
                    of another format is refused with that reason, so a new format adds kernel files: a
                    backend may list several KernelKinds of one kind whose formats do not overlap, and the
                    block's format picks the one that runs it

A kind's parameters may carry `act_quant` ("none", or how the kernels quantise activations, e.g. "fp8_1x128"
for w8a8): a schedule with quantised activations is checked against the float32 reference with the
looser tolerance of `moetune.codegen.torch.tolerance` and says so in `explain`.

A hybrid default's row threshold is the schedule policy's (`moetune.passes.policy.hybrid_threshold`), not
a kernel's choice.

The backend's `__init__.py` is a registry: a `KernelBackend` subclass listing its kinds, its target and
its `available()`. A new backend or kind adds files that fill this contract, not branches in shared code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ir import MoEBlock, Schedule, UnsupportedSchedule
from ..passes.policy import hybrid_threshold, rows_per_active
from ..targets import Target, get_target
from .space import ParamSpace
from .tensors import ExpertsFn

SHARED_SOURCES = (Path(__file__).resolve().parent / "tensors.py",)  # ExpertTensors: every kernel's inputs
QUANT_SOURCES = (Path(__file__).resolve().parent / "quant.py",)  # the block-quantisation rule


def sources(kernel_file: str, names: tuple[str, ...]) -> tuple[Path, ...]:
    """The declared source files `names`, in the folder of `kernel_file` (a kernel module's __file__)."""
    folder = Path(kernel_file).resolve().parent
    return tuple(folder / n for n in names)


def _accepts(block: MoEBlock) -> str | None:
    return None


@dataclass(frozen=True)
class KernelKind:
    """What one kernel file provides for one schedule kind (module doc)."""

    kind: str
    params: type
    space: Callable[[MoEBlock, Target], ParamSpace]
    default_params: Callable[[MoEBlock, int, Target], Any]
    build: Callable[[MoEBlock, Schedule], ExpertsFn]
    cost: Callable[[MoEBlock, Schedule, int], tuple[float, float]]
    sources: tuple[Path, ...]
    refusal: Callable[[MoEBlock], str | None] = _accepts
    formats: tuple[str, ...] = ("none",)
    build_jax: Callable[[MoEBlock, Schedule], Callable] | None = None

    def __post_init__(self) -> None:
        if not self.sources:
            raise UnsupportedSchedule(f"kernel kind {self.kind}: no source files declared")
        missing = [str(p) for p in self.sources if not p.is_file()]
        if missing:
            raise UnsupportedSchedule(f"kernel kind {self.kind}: declared sources missing: {', '.join(missing)}")


def _format_refusal(backend: str, kinds: list[KernelKind], block: MoEBlock) -> str:
    scheme = block.weight_format.scheme
    there = ", ".join("unquantised" if f == "none" else f for k in kinds for f in k.formats)
    return f"{backend} {kinds[0].kind} reads {there} weights, not {block.weight_format} (scheme {scheme!r})"


class KernelBackend:
    """A Backend (moetune.codegen.backend) made of its kernel files' KernelKinds.

    Subclasses set `name`, `library` (what compiles its kernels, whose version a timing records), `KINDS`
    and `TARGET` (the target description whose device limits the spaces and defaults read) and override
    `available()`."""

    name: str = ""
    library: str = ""
    KINDS: tuple[KernelKind, ...] = ()
    TARGET: str = "cpu"

    def __init__(self, target: str | Target | None = None) -> None:
        self.target = get_target(target if target is not None else self.TARGET)
        self._kinds: dict[str, list[KernelKind]] = {}
        for k in self.KINDS:
            same = self._kinds.setdefault(k.kind, [])
            clash = [f for o in same for f in o.formats if f in k.formats]
            if clash:
                raise UnsupportedSchedule(f"{self.name} backend: two {k.kind} kernels read {', '.join(clash)}")
            same.append(k)

    def available(self) -> str | None:
        return None

    def kinds(self, block: MoEBlock) -> dict[str, str | None]:
        out = {}
        for name in self._kinds:
            k = self._for_scheme(name, block.weight_format.scheme)
            out[name] = k.refusal(block) if k is not None else _format_refusal(self.name, self._kinds[name], block)
        return out

    def _for_scheme(self, kind: str, scheme: str) -> KernelKind | None:
        return next((k for k in self._kinds.get(kind, ()) if scheme in k.formats), None)

    def kind(self, kind: str, block: MoEBlock | None = None) -> KernelKind:
        """The kernel file of `kind` that reads `block`'s weight format (unquantised when no block is given);
        UnsupportedSchedule naming the formats there are when none does."""
        if kind not in self._kinds:
            raise UnsupportedSchedule(
                f"{self.name} backend: unknown schedule kind {kind!r}; known: {', '.join(self._kinds)}")
        k = self._for_scheme(kind, block.weight_format.scheme if block is not None else "none")
        if k is None:
            if block is None:
                return self._kinds[kind][0]
            raise UnsupportedSchedule(_format_refusal(self.name, self._kinds[kind], block))
        return k

    def schemes(self, kind: str) -> tuple[str, ...]:
        """The weight-format schemes the backend's `kind` kernels read."""
        return tuple(f for k in self._kinds.get(kind, ()) for f in k.formats)

    def space(self, block: MoEBlock, kind: str) -> ParamSpace:
        return self.kind(kind, block).space(block, self.target)

    def default(self, block: MoEBlock, kind: str, tokens: int) -> Schedule:
        """The kind's default parameters at `tokens` (the kind itself is the caller's choice)."""
        k = self.kind(kind, block)
        rt = hybrid_threshold(rows_per_active(block, max(1, tokens))) if kind == "hybrid" else None
        return Schedule(kind, row_threshold=rt, backend=self.name,
                        params=k.default_params(block, tokens, self.target))

    def build(self, block: MoEBlock, schedule: Schedule) -> ExpertsFn:
        k, schedule = self._resolve(block, schedule, block.T_max)
        k.space(block, self.target).admit(schedule.params)
        return k.build(block, schedule)

    def build_jax(self, block: MoEBlock, schedule: Schedule):
        """The JaxExpertsFn of `schedule` (its kind's `build_jax`), parameters resolved and admitted as in
        `build`; UnsupportedSchedule when the kind has no JAX kernel."""
        k, schedule = self._resolve(block, schedule, block.T_max)
        if k.build_jax is None:
            raise UnsupportedSchedule(f"{self.name} {schedule.kind}: no JAX kernel (KernelKind.build_jax)")
        k.space(block, self.target).admit(schedule.params)
        return k.build_jax(block, schedule)

    def cost(self, block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
        k, schedule = self._resolve(block, schedule, tokens)
        return k.cost(block, schedule, tokens)

    def sources(self, kind: str, scheme: str = "none") -> tuple[Path, ...]:
        """The files whose code the kind's kernels for `scheme` weights are made of: their declared SOURCES
        and codegen/tensors.py (and codegen/quant.py for quantised weights)."""
        k = self._for_scheme(kind, scheme)
        if k is None:
            raise UnsupportedSchedule(f"{self.name} backend: no {kind} kernel reads {scheme} weights")
        return k.sources + SHARED_SOURCES + (QUANT_SOURCES if scheme != "none" else ())

    def _resolve(self, block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[KernelKind, Schedule]:
        """The schedule's kind, and the schedule with its parameters (the default at `tokens` when None)."""
        if schedule.backend not in (None, self.name):
            raise UnsupportedSchedule(f"{self.name} backend given a {schedule.backend} schedule: "
                                      f"{schedule.describe()}")
        k = self.kind(schedule.kind, block)
        if schedule.params is None:
            return k, dataclasses.replace(schedule, params=k.default_params(block, tokens, self.target),
                                          backend=self.name)
        if not isinstance(schedule.params, k.params):
            raise UnsupportedSchedule(f"{self.name} {schedule.kind} takes {k.params.__name__}, "
                                      f"got {type(schedule.params).__name__}")
        return k, schedule
