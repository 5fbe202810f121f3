"""Pallas backend for TPUs (registered as "pallas_tpu"; runs in TPU interpret mode on CPU).

Kernel files, one per schedule kind, each with its kernel, parameters, space, default, cost and a
`build_jax` (the per-kind contract, moetune.codegen.contract); `build` is the torch-facing wrapper of
`build_jax` (`_common.bridged`), so the search checks and times the function moetune.jax runs.
    stream_gemv.py      weight-streaming GEMV: scalar-prefetched expert ids drive the weight tiles into VMEM,
                        each selected expert read once, gate/up/activation/down and the k-sum fused (stream_gemv)
    stream_gemv_fp8.py  the same kernel on fp8_block weights (stream_gemv, weight format fp8_block)
    grouped_gemm.py     grouped GEMM over expert-sorted rows, megablox-style tile metadata (grouped_gemm; bf16,
                        f32 and fp8_block)
    hybrid.py           heavy experts in wide row tiles, light ones in narrow tiles, one grouped GEMM (hybrid)
What they share:
    tiles.py       the grouped GEMM's parameters, VMEM checks and space, and the tile rule: the tiles of least
                   modelled time at T (the defaults of grouped_gemm and of hybrid's heavy side)
    _common.py     JaxExperts, the torch bridge, the interpret switch
    reference.py   the float32 reference in JAX

The backend's target is a TPU description (moetune.targets: tpu-v5e, tpu-v6e, tpu-v7): its VMEM per
core bounds every space and its bandwidth and peaks give the floors the default tiles are costed against.
It is available where JAX sees a TPU, or anywhere with MOETUNE_PALLAS_INTERPRET set (TPU interpret mode).
"""

from __future__ import annotations

from ..backend import register
from ..contract import KernelBackend
from . import grouped_gemm, hybrid, stream_gemv, stream_gemv_fp8
from ._common import INTERPRET_ENV, interpret_requested, on_tpu


class PallasTpuBackend(KernelBackend):
    name = "pallas_tpu"
    library = "jax"
    KINDS = (grouped_gemm.KIND, hybrid.KIND, stream_gemv.KIND, stream_gemv_fp8.KIND)
    TARGET = "tpu-v7"

    def available(self) -> str | None:
        try:
            import jax  # noqa: F401
            from jax.experimental import pallas  # noqa: F401
        except ImportError as e:
            return f"JAX with Pallas is not installed ({e}); pip install 'moetune[jax]'"
        if on_tpu() or interpret_requested() is not None:
            return None
        return f"no TPU and {INTERPRET_ENV} is not set"


BACKEND = register(PallasTpuBackend())

__all__ = ["BACKEND", "PallasTpuBackend"]
