"""grouped_gemm for FP8 block-quantised experts (weight format fp8_block, w8a16) on NVIDIA GPUs: the kernels
of grouped_gemm.py reading float8_e4m3fn weights, widened in registers to the activations' dtype.

Weights (moetune.codegen.quant): gate_up [E, 2F, D] and down [E, D, F] in float8_e4m3fn with one float32
multiplier per (r, c) block, gate_up_scale [E, 2⌈F/r⌉, ⌈D/c⌉] and down_scale [E, ⌈D/r⌉, ⌈F/c⌉]. Every K step
of BK columns divides c and every output tile of BN rows divides r, so a [BN, BK] weight tile lies in one
block: the step's [BM, BN] f32 partial (tensor-core dots of the bf16/f16/f32 activations with the widened
e4m3 values) is multiplied by that block's one scale before it joins the accumulator. The weights are read
as uint32 words of four e4m3 values (moetune.codegen.pallas_gpu._common.packed_e4m3), so every size lowers
under Pallas' 32-bit offsets; a K step is four dots of BK/4 columns, hence BK ≥ 64. Standard layout (gate |
up halves) only: the scales follow it; D and F in whole blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...targets import Target
from ..contract import KernelKind, sources
from ..pallas_tpu._common import bridged
from ..space import ParamSpace
from ..tiles import make
from . import grouped_gemm as gg
from ._common import MIN_BK, MIN_TILE, check_divides, fp8_refusal
from .grouped_gemm import GemmParams
from .tiles import tiles

SOURCES = ("grouped_gemm_fp8.py", "tiles.py", "grouped_gemm.py", "routing.py", "_common.py")


def refusal(block: MoEBlock) -> str | None:
    """The fp8_block kernels' refusals (layout, scale dtype, blocks, whole blocks) and blocks whose scale block
    columns are narrower than one K step."""
    why = fp8_refusal(block, "pallas_gpu fp8 grouped_gemm")
    if why:
        return why
    c = block.weight_format.block[1]
    if c < MIN_BK:
        return f"pallas_gpu fp8 grouped_gemm steps K by ≥ {MIN_BK} columns within a scale block; blocks {c} wide"
    return None


def check(p: GemmParams, block: MoEBlock, target: Target | None) -> None:
    """grouped_gemm's checks, every tile inside one scale block and K steps of at least MIN_BK columns."""
    gg.check(p, block, target)
    why = refusal(block)
    if why:
        raise UnsupportedSchedule(why)
    r, c = block.weight_format.block
    check_divides(f"pallas_gpu fp8 grouped_gemm with {r}×{c} scale blocks", block_n=(p.block_n, r),
                  block_k=(p.block_k, c))
    if p.block_k < MIN_BK:
        raise UnsupportedSchedule(f"pallas_gpu fp8 grouped_gemm: block_k = {p.block_k} below {MIN_BK} (four dots "
                                  f"of block_k/4 ≥ {MIN_TILE} columns per K step)")


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(GemmParams, gg.CHOICES, check=partial(check, block=block, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> GemmParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(GemmParams, tiles("grouped_gemm@fp8_block", block, T, target, constraints))


def build_jax(block: MoEBlock, schedule: Schedule):
    """JaxExpertsFn of an fp8_block grouped_gemm schedule (params: GemmParams)."""
    p = schedule.params
    check(p, block, None)

    def fn(x, ids, weights, w):
        return gg.experts_f32(block, p, x, ids, weights, w).astype(x.dtype)

    return fn


def build(block: MoEBlock, schedule: Schedule):
    return bridged(block, build_jax(block, schedule))


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """grouped_gemm's (flops, bytes) with the block's e4m3 weights and scales (`weight_bytes_per_expert`)."""
    return gg.cost(block, schedule, tokens)


KIND = KernelKind("grouped_gemm", GemmParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, formats=("fp8_block",), build_jax=build_jax)
