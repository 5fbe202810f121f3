"""hybrid on NVIDIA GPUs: the grouped GEMM for heavy experts, the streaming GEMV for light ones, summed.

With R the schedule's row_threshold and counts [E] the rows per expert (bincount on the device), a pair whose
expert has ≥ R rows is heavy. The grouped GEMM (grouped_gemm.py) runs on the ids with the light pairs made
sentinels (-1), the GEMV (stream_gemv.py) on the ids with the heavy pairs made sentinels; a sentinel pair
reads no weights in either kernel, so each expert's weights are streamed by one of the two. Their f32
outputs [T, D] are summed. Four launches, no host synchronisation: both grids are static (the GEMM's tile
bound and the GEMV's P pairs), the split is data on the device.

FP8 block-scaled weights are not read (formats: unquantised only): the grouped GEMM of its heavy half reads
unquantised weights only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from ...ir import MoEBlock, Schedule
from ...passes.stats import uniform_distinct
from ...targets import Target
from ..contract import KernelKind, sources
from ..pallas_tpu._common import bridged
from ..space import ParamSpace
from ..tiles import make
from . import grouped_gemm as gg
from . import stream_gemv as sg
from ._common import check_pow2, refusal
from .tiles import tiles

SOURCES = ("hybrid.py", "tiles.py", "grouped_gemm.py", "routing.py", "stream_gemv.py", "_common.py")


@dataclass(frozen=True)
class HybridParams:
    block_m: int = 64  # GEMM: rows per tile
    block_n: int = 64  # GEMM: output columns per program
    block_k: int = 64  # GEMM: reduction chunk
    num_warps: int = 4  # GEMM
    num_stages: int = 3  # both kernels' pipelining depth
    gemv_block_n: int = 16  # GEMV: output rows per program, both projections
    gemv_block_k: int = 256  # GEMV: reduction chunk, both projections
    gemv_warps: int = 4
    gemv_pairs: int = 1  # GEMV down: the pairs whose tiles one chunk loads together (GemvParams.down_pairs)

    def __post_init__(self) -> None:
        check_pow2("HybridParams", gemv_block_n=self.gemv_block_n, gemv_block_k=self.gemv_block_k,
                   gemv_warps=self.gemv_warps, gemv_pairs=self.gemv_pairs)
        self.gemm(), self.gemv()  # each half's own checks

    def gemm(self) -> gg.GemmParams:
        return gg.GemmParams(self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages)

    def gemv(self) -> sg.GemvParams:
        n, k, w = self.gemv_block_n, self.gemv_block_k, self.gemv_warps
        return sg.GemvParams(block_n=n, block_k=k, num_warps=w, num_stages=self.num_stages,
                             down_block_n=n, down_block_k=k, down_warps=w, down_pairs=self.gemv_pairs)


CHOICES = (
    ("block_m", (16, 32, 64, 128)),
    ("block_n", (16, 32, 64, 128)),
    ("block_k", (16, 32, 64, 128)),
    ("num_warps", (4, 8)),
    ("num_stages", (2, 3, 4)),
    ("gemv_block_n", (4, 8, 16, 32)),
    ("gemv_block_k", (16, 32, 64, 128, 256, 512)),
    ("gemv_warps", (2, 4, 8)),
    ("gemv_pairs", (1, 2, 4, 8, 16)),
)


def check(p: HybridParams, block: MoEBlock, target: Target | None) -> None:
    gg.check(p.gemm(), block, target)
    sg.check(p.gemv(), block)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(HybridParams, CHOICES, check=partial(check, block=block, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> HybridParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(HybridParams, tiles("hybrid", block, T, target, constraints))


def split(ids, E: int, R: int):
    """(heavy ids, light ids) [T, k]: each with the other half's pairs made sentinels (-1)."""
    import jax.numpy as jnp

    valid = (ids >= 0) & (ids < E)
    e = jnp.where(valid, ids, 0)
    counts = jnp.bincount(e.reshape(-1), weights=valid.reshape(-1).astype(jnp.int32), length=E)  # [E]
    heavy = valid & (counts[e] >= R)
    return jnp.where(heavy, ids, -1), jnp.where(heavy | ~valid, -1, ids)


def build_jax(block: MoEBlock, schedule: Schedule):
    """JaxExpertsFn of a hybrid schedule (params: HybridParams; R: the schedule's row_threshold)."""
    p, R = schedule.params, schedule.row_threshold
    check(p, block, None)
    gemm, gemv = p.gemm(), p.gemv()

    def fn(x, ids, weights, w):
        import jax.numpy as jnp

        heavy, light = split(ids.astype("int32"), block.E, R)
        out = (gg.experts_f32(block, gemm, x, heavy, weights, w)
               + sg.experts(block, gemv, x, light, weights, w, jnp.float32))
        return out.astype(x.dtype)

    return fn


def build(block: MoEBlock, schedule: Schedule):
    return bridged(block, build_jax(block, schedule))


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes) under uniform routing: the experts expected to reach R rows through the GEMM, the rest
    through the GEMV (the expected rows per active expert against R decides the whole split)."""
    p, R = schedule.params, schedule.row_threshold
    rows = tokens * block.k / max(1.0, uniform_distinct(block.E, block.k, tokens))
    if rows >= R:
        return gg.cost(block, Schedule("grouped_gemm", backend="pallas_gpu", params=p.gemm()), tokens)
    return sg.cost(block, Schedule("stream_gemv", backend="pallas_gpu", params=p.gemv()), tokens)


KIND = KernelKind("hybrid", HybridParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, build_jax=build_jax)
