"""Triton backend (NVIDIA GPUs; runs interpreted on CPU under TRITON_INTERPRET=1).

Kernels, one per file with its launcher, parameters, space and cost:
    routing.py       device-side counts [E] and expert-sorted pair order [P]
    stream_gemv.py   weight-streaming GEMV (schedule kind stream_gemv)
    grouped_gemm.py  grouped GEMM over expert-sorted rows (grouped_gemm)
    hybrid.py        GEMM tiles for heavy experts + GEMV for light ones in one launch (hybrid)
    combine.py       sum of the fp32 per-pair rows back to token order
"""

from __future__ import annotations

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ..backend import register
from ..common import ExpertsFn, ParamSpace
from . import grouped_gemm, hybrid, stream_gemv
from .grouped_gemm import GemmParams
from .hybrid import HybridParams
from .stream_gemv import GemvParams

_KINDS = {"stream_gemv": stream_gemv, "grouped_gemm": grouped_gemm, "hybrid": hybrid}


def expected_distinct(block: MoEBlock, tokens: int) -> float:
    """E·(1 − (1 − k/E)^T): expected distinct experts under uniform routing."""
    return block.E * (1.0 - (1.0 - block.k / block.E) ** tokens)


class TritonBackend:
    name = "triton"

    def available(self) -> str | None:
        import os

        import torch

        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            return None
        return "no CUDA device and TRITON_INTERPRET is not set"

    def kinds(self, block: MoEBlock) -> dict[str, str | None]:
        return {kind: None for kind in _KINDS}

    def space(self, block: MoEBlock, kind: str) -> ParamSpace:
        return self._module(kind).SPACE

    def default(self, block: MoEBlock, kind: str, tokens: int) -> Schedule:
        """Heuristic of rows per expert: stream one row per weight read while rows per active expert
        is about one, tl.dot passes of 16 rows when a few, 64-row tiles when many."""
        rows = tokens * block.k / max(expected_distinct(block, tokens), 1.0)
        if kind == "stream_gemv":
            p = GemvParams(rows=1 if rows < 1.5 else 16,
                           down_mode="token" if rows < 1.5 else "expert",
                           split_k=1 if rows < 1.5 or block.F >= 2048 else 2)
            return Schedule("stream_gemv", backend="triton", params=p)
        if kind == "grouped_gemm":
            bm = 16 if rows <= 16 else (64 if rows <= 128 else 128)
            p = GemmParams(block_m=bm, block_n=64 if bm < 128 else 128, block_k=64 if bm < 128 else 64,
                           num_warps=4 if bm < 128 else 8, num_stages=4 if bm <= 64 else 3)
            return Schedule("grouped_gemm", backend="triton", params=p)
        if kind == "hybrid":
            return Schedule("hybrid", row_threshold=2 if rows < 4 else 8, backend="triton",
                            params=HybridParams(block_m=16 if rows < 32 else 64))
        raise UnsupportedSchedule(f"triton backend: unknown schedule kind {kind!r}")

    def build(self, block: MoEBlock, schedule: Schedule) -> ExpertsFn:
        if schedule.backend not in (None, "triton"):
            raise UnsupportedSchedule(f"schedule for backend {schedule.backend!r} given to triton")
        return self._module(schedule.kind).build(block, schedule)

    def cost(self, block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
        mod = self._module(schedule.kind)
        params = schedule.params or self.default(block, schedule.kind, tokens).params
        return mod.cost(block, params, tokens, expected_distinct(block, tokens))

    @staticmethod
    def _module(kind: str):
        if kind not in _KINDS:
            raise UnsupportedSchedule(
                f"triton backend: unknown schedule kind {kind!r}; known: {', '.join(_KINDS)}")
        return _KINDS[kind]


BACKEND = register(TritonBackend())

__all__ = ["BACKEND", "GemmParams", "GemvParams", "HybridParams", "TritonBackend", "expected_distinct"]
