"""stream_gemv for FP8 block-quantised experts (weight format fp8_block) on NVIDIA GPUs: the kernels of
stream_gemv.py reading float8_e4m3fn weights, dequantised in registers.

Weights (moetune.codegen.quant): gate_up [E, 2F, D] and down [E, D, F] in float8_e4m3fn with one float32
multiplier per (r, c) block, gate_up_scale [E, 2⌈F/r⌉, ⌈D/c⌉] and down_scale [E, ⌈D/r⌉, ⌈F/c⌉]. Every tile's
BN rows divide r and its BK columns divide c, so a [BN, BK] tile lies in one block: its e4m3 values are
widened to f32 for the FMA and the tile's row sums [BN] are multiplied by the block's one scale (BN
multiplies per chunk, not BN·BK). Activations stay in the model's dtype, products and sums in f32; h and the
output as in stream_gemv.py. Standard layout (gate | up halves) only: the scales follow it; D and F in whole
blocks, so each half's blocks are the fused matrix's row blocks. The kernels read the e4m3 matrices as uint32
words of four values (moetune.codegen.pallas_gpu._common.packed_e4m3): Pallas' Triton lowering offsets an
array of at most 2^32 bytes with 32-bit integers, which wrap beyond 2^31 elements, and a word view has at
most 2^30 there, so every size lowers (qwen3.5-397b-a17b-fp8's gate_up is 2^32 bytes, 2^30 words).
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
from . import stream_gemv as sg
from ._common import check_divides, fp8_refusal
from .stream_gemv import GemvParams
from .tiles import tiles

SOURCES = ("stream_gemv_fp8.py", "tiles.py", "stream_gemv.py", "_common.py")


def refusal(block: MoEBlock) -> str | None:
    return fp8_refusal(block, "pallas_gpu fp8 stream_gemv")


def check(p: GemvParams, block: MoEBlock) -> None:
    """stream_gemv's checks, and every tile inside one scale block."""
    sg.check(p, block)
    why = refusal(block)
    if why:
        raise UnsupportedSchedule(why)
    r, c = block.weight_format.block
    check_divides(f"pallas_gpu fp8 stream_gemv with {r}×{c} scale blocks", block_n=(p.block_n, r),
                  block_k=(p.block_k, c), down_block_n=(p.down_block_n, r), down_block_k=(p.down_block_k, c))


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(GemvParams, sg.CHOICES, check=partial(check, block=block))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> GemvParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(GemvParams, tiles("stream_gemv@fp8_block", block, T, target, constraints))


def build_jax(block: MoEBlock, schedule: Schedule):
    """JaxExpertsFn of an fp8_block stream_gemv schedule (params: GemvParams)."""
    p = schedule.params
    check(p, block)

    def fn(x, ids, weights, w):
        return sg.experts(block, p, x, ids, weights, w, x.dtype)

    return fn


def build(block: MoEBlock, schedule: Schedule):
    return bridged(block, build_jax(block, schedule))


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """stream_gemv's (flops, bytes) with the block's e4m3 weights and scales (`weight_bytes_per_expert`)."""
    return sg.cost(block, schedule, tokens)


KIND = KernelKind("stream_gemv", GemvParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, formats=("fp8_block",), build_jax=build_jax)
