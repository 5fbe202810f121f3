"""Pallas backend for NVIDIA GPUs (registered as "pallas_gpu"): Pallas kernels lowered through Pallas' Triton
backend (`jax.experimental.pallas.triton.CompilerParams(num_warps=, num_stages=)`, the same spelling in the
jax releases this package supports), run by XLA as Triton custom calls; Pallas' interpreter on CPU.

Kernel files, one per schedule kind, each with its kernel, parameters, space, default, cost and a
`build_jax` (the per-kind contract, moetune.codegen.contract); `build` is the torch-facing wrapper of
`build_jax` (moetune.codegen.pallas_tpu._common.bridged), so the search checks and times the function JAX runs:
    stream_gemv.py   one program per (pair, output tile), token-mode down with no atomics (stream_gemv)
    stream_gemv_fp8.py  the same on FP8 block-quantised weights, dequantised in registers (stream_gemv, fp8_block)
    grouped_gemm.py  expert-sorted rows in BM-row tiles, `pl.dot` (grouped_gemm)
    grouped_gemm_fp8.py  the same on FP8 block-quantised weights, widened in registers (grouped_gemm, fp8_block)
    hybrid.py        the two above on the heavy and the light experts, summed (hybrid)
    routing.py       the grouped GEMM's tile plan: a counting sort of the pairs into its tiles (one or two launches)
FP8 block-quantised blocks run the streaming GEMV and the grouped GEMM (w8a16): the hybrid reads unquantised
weights, so the contract's format rule refuses it on fp8_block blocks.
What they share:
    _common.py       interpret switch, compiler parameters, refusals, weight tiles, the in-kernel activation

The target is a GPU's description (moetune.targets; DEFAULT_GPU for the registered backend,
`codegen.backend.for_target` for another): its shared memory per block bounds the GEMM tiles. Available where
JAX sees a CUDA device, or anywhere with MOETUNE_PALLAS_GPU_INTERPRET set.
"""

from __future__ import annotations

from ...targets import DEFAULT_GPU
from ..backend import register
from ..contract import KernelBackend
from . import grouped_gemm, grouped_gemm_fp8, hybrid, stream_gemv, stream_gemv_fp8
from ._common import INTERPRET_ENV, interpret_requested, on_cuda
from .grouped_gemm import GemmParams
from .hybrid import HybridParams
from .stream_gemv import GemvParams


class PallasGpuBackend(KernelBackend):
    name = "pallas_gpu"
    library = "jax"
    KINDS = (stream_gemv.KIND, grouped_gemm.KIND, hybrid.KIND, stream_gemv_fp8.KIND, grouped_gemm_fp8.KIND)
    TARGET = DEFAULT_GPU  # the target of a kernel run: codegen.backend.for_target(name, the GPU's)

    def available(self) -> str | None:
        try:
            from jax.experimental.pallas import triton  # noqa: F401
        except ImportError as e:
            return f"JAX with Pallas' Triton backend is not installed ({e}); pip install 'moetune[jax]'"
        if interpret_requested() or on_cuda():
            return None
        return f"no CUDA device visible to JAX and {INTERPRET_ENV} is not set"


BACKEND = register(PallasGpuBackend())

__all__ = ["BACKEND", "GemmParams", "GemvParams", "HybridParams", "PallasGpuBackend"]
