"""A registered backend with JAX kernels for every schedule kind, for the dispatch tests of moetune.jax while
the Pallas kernels live elsewhere. It is a real KernelBackend (KernelKinds with spaces, defaults, costs,
sources and `build_jax`); each kernel computes the float32 JAX reference inside a named scope that names its
kind and tile, so a lowered program says which schedule it runs. Nothing here imitates a Pallas kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moetune.codegen.backend import _REGISTRY, register
from moetune.codegen.contract import KernelBackend, KernelKind
from moetune.codegen.pallas_tpu._common import bridged
from moetune.codegen.space import ParamSpace
from moetune.ir import SCHEDULE_KINDS, UnsupportedSchedule
from moetune.jax.dispatch import reference_fn

NAME = "jax_test"


@dataclass(frozen=True)
class TileParams:
    tile: int = 8

    def __post_init__(self) -> None:
        if self.tile not in (8, 16):
            raise UnsupportedSchedule(f"TileParams(tile={self.tile}): 8 or 16")


SPACE = ParamSpace(TileParams, (("tile", (8, 16)),))


def scope(kind: str, tile: int) -> str:
    return f"{NAME}_{kind}_tile{tile}"


def _build_jax(block, schedule):
    import jax

    ref = reference_fn(block)
    name = scope(schedule.kind, schedule.params.tile)

    def run(x, ids, weights, w):
        with jax.named_scope(name):
            return ref(x, ids, weights, w)

    return run


def _refusal(block) -> str | None:
    return None if block.D % 8 == 0 else f"D = {block.D} is not a multiple of the tile rows 8"


def _kind(kind: str) -> KernelKind:
    return KernelKind(kind, TileParams, space=lambda block, target: SPACE, refusal=_refusal,
                      default_params=lambda block, T, target: TileParams(),
                      build=lambda block, s: bridged(block, _build_jax(block, s)),
                      cost=lambda block, s, T: (2.0 * T * block.k * 3 * block.D * block.F,
                                                block.weight_bytes_per_expert * min(block.E, T * block.k)),
                      sources=(Path(__file__),), build_jax=_build_jax)


class JaxTestBackend(KernelBackend):
    name = NAME
    library = "jax"
    KINDS = tuple(_kind(k) for k in SCHEDULE_KINDS)
    TARGET = "cpu"


def registered() -> JaxTestBackend:
    return _REGISTRY.get(NAME) or register(JaxTestBackend())
