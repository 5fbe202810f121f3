"""stream_gemv for FP8 block-quantised experts (scheme fp8_block, float32 scales per 128×128 block).

The kernel of stream_gemv.py, whose tiles arrive in float8_e4m3fn with their block scales: each tile is
widened to x's dtype in VMEM and its scales multiply the activation per 128-group of the tile's outputs
(stream_gemv.py's module doc, "FP8"), so HBM carries one byte per weight. Targets without FP8 units
(tpu-v5e) are refused by the space's check with the reason.
"""

from __future__ import annotations

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ..contract import KernelKind, sources
from ._common import bridged
from .stream_gemv import PallasGemvParams, cost, default_params, space
from .stream_gemv import build_jax as _build_jax
from .stream_gemv import fp8_refusal as refusal

SOURCES = ("stream_gemv_fp8.py", "stream_gemv.py", "_common.py", "reference.py")


def build_jax(block: MoEBlock, schedule: Schedule, *, interpret_mode=None):
    """stream_gemv.build_jax of an fp8_block block (UnsupportedSchedule with the reason for another)."""
    why = refusal(block)
    if why:
        raise UnsupportedSchedule(why)
    return _build_jax(block, schedule, interpret_mode=interpret_mode)


def build(block: MoEBlock, schedule: Schedule):
    return bridged(block, build_jax(block, schedule))

KIND = KernelKind("stream_gemv", PallasGemvParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, formats=("fp8_block",), build_jax=build_jax)
