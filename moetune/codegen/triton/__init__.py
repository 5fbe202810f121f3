"""Triton backend (NVIDIA GPUs; runs interpreted on CPU under TRITON_INTERPRET=1).

Kernel files, one per schedule kind, each with its kernel, launcher, parameters, space, default and cost
(the per-kind contract, moetune.codegen.contract):
    stream_gemv.py   weight-streaming GEMV (schedule kind stream_gemv)
    stream_gemv_fp8.py  the same on FP8 block-quantised weights (stream_gemv, weight format fp8_block)
    fused_gemv.py    the few-rows regime in one launch, unquantised and FP8 weights (fused_gemv)
    grouped_gemm.py  grouped GEMM over expert-sorted rows (grouped_gemm)
    grouped_gemm_fp8.py  the grouped GEMM on FP8 block-quantised weights, w8a16 and w8a8 (grouped_gemm, fp8_block);
                     its device code in grouped_gemm_fp8_kernels.py
    hybrid.py        GEMM tiles for heavy experts + GEMV for light ones in one launch (hybrid)
    hybrid_fp8.py    the hybrid on FP8 block-quantised weights, w8a16 (hybrid, fp8_block)
What they share:
    routing.py       device-side counts [E] and expert-sorted pair order [P]
    combine.py       sum of the per-pair rows back to token order
    quant_rows.py    the w8a8 activation pre-pass: rows → e4m3 and a scale per row and group
    tiles.py         the tile rule: every kind's default tiles at T and the rows per expert where they change
    _common.py       jit helpers used by more than one kernel file
    _fp8.py          those of the FP8 kernel files: block scales (float32, ue8m0), e4m3 rounding of activations
    layout.py        host side: strides, launch arguments, constexprs, the target's limits
    launch.py        launching a compiled kernel without Triton's per-call dispatch

The backend's target is a GPU's description (moetune.targets): its shared memory per block bounds
every space and every build. The registered backend describes DEFAULT_GPU; a compiled model and the tuner use
`codegen.backend.for_target("triton", <the GPU's target>)`.
"""

from __future__ import annotations

import os

from ...targets import DEFAULT_GPU
from ..backend import register
from ..contract import KernelBackend
from . import fused_gemv, grouped_gemm, grouped_gemm_fp8, hybrid, hybrid_fp8, stream_gemv, stream_gemv_fp8
from .fused_gemv import FusedGemvParams
from .grouped_gemm import GemmParams
from .hybrid import HybridParams
from .hybrid_fp8 import Fp8HybridParams
from .stream_gemv import GemvParams
from .stream_gemv_fp8 import Fp8GemvParams


class TritonBackend(KernelBackend):
    name = "triton"
    library = "triton"
    KINDS = (stream_gemv.KIND, grouped_gemm.KIND, hybrid.KIND, stream_gemv_fp8.KIND, grouped_gemm_fp8.KIND,
             hybrid_fp8.KIND, fused_gemv.KIND)
    TARGET = DEFAULT_GPU  # the target of a kernel run: codegen.backend.for_target(name, the GPU's)

    def available(self) -> str | None:
        import torch

        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            return None
        return "no CUDA device and TRITON_INTERPRET is not set"


BACKEND = register(TritonBackend())

__all__ = ["BACKEND", "Fp8GemvParams", "FusedGemvParams", "Fp8HybridParams", "GemmParams", "GemvParams", "HybridParams",
           "TritonBackend"]
