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
from ...passes.stats import uniform_distinct
from ..backend import register
from ..common import ExpertsFn, ParamSpace
from . import grouped_gemm, hybrid, stream_gemv
from .grouped_gemm import GemmParams
from .hybrid import HybridParams
from .stream_gemv import GemvParams

_KINDS = {"stream_gemv": stream_gemv, "grouped_gemm": grouped_gemm, "hybrid": hybrid}


def expected_distinct(block: MoEBlock, tokens: int) -> float:
    """Expected distinct experts of `tokens` tokens under uniform routing (the passes' closed form)."""
    return uniform_distinct(block.E, block.k, tokens)


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
        """Heuristic of rows per active expert, from the H200 sweep (bench/results/NOTES.md): one row
        per weight read (pipelined FMA, token-mode down) while it is about one; 16-row tl.dot tiles
        from ~1.05 up to ~12; 64- then 128-row tiles beyond, gate/up as one N = 256 tl.dot (measured 1–3 %
        faster than two N = 128 dots at mixtral-8x7b T = 512/1024 and qwen3-30b-a3b T = 1024); from 128
        rows per expert every operand through TMA (standard layout; measured 8–12 % faster at mixtral-8x7b
        T = 512/1024, slower at 32–64 rows: qwen3-30b-a3b and deepseek-v3 T = 1024), the gate/up as one
        dot from one [2, 128, 64] box and the down GEMM split in two along F with bf16 y rows (session 10:
        1499.8 µs at mixtral-8x7b T = 1024 against 1571.8 for two gate/up dots)."""
        rows = tokens * block.k / max(expected_distinct(block, tokens), 1.0)
        if kind == "stream_gemv":
            if rows <= 1.5:
                kp = 1 << (block.k - 1).bit_length()
                p = GemvParams(down_block_n=max(2, 32 // kp))
            else:
                p = GemvParams(rows=16, block_n=64, block_k=128, down_block_n=64, down_block_k=128,
                               down_mode="expert", fused_route=False)
            return Schedule("stream_gemv", backend="triton", params=p)
        if kind == "grouped_gemm":
            if rows < 12:
                p = GemmParams(block_m=16, block_n=64, block_k=128, num_stages=4, down_block_n=64,
                               down_block_k=128, down_stages=4)
            elif rows < 48:
                p = GemmParams(block_m=64, block_n=64, block_k=64, num_stages=4, down_block_n=128,
                               down_block_k=64, down_stages=4)
            elif rows < 128 or grouped_gemm.tma_refusal(block):
                p = GemmParams(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, one_dot=True,
                               down_block_n=256, down_block_k=64, down_warps=8, down_stages=4)
            else:
                p = GemmParams(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, tma=True,
                               one_dot=True, down_block_n=256, down_block_k=64, down_warps=8, down_stages=3,
                               split_k=2, y_half=True)
            return Schedule("grouped_gemm", backend="triton", params=p)
        if kind == "hybrid":
            small = rows < 4
            p = HybridParams(block_m=16 if small else 64, block_n=64, block_k=128 if small else 64,
                             num_stages=4, gemv_block_n=8 if small else 4, gemv_block_k=256 if small else 128,
                             down_block_n=64 if small else 128, down_block_k=128 if small else 64,
                             down_gemv_block_n=4 if small else 2, down_gemv_block_k=128, down_stages=4)
            return Schedule("hybrid", row_threshold=2 if small else 8, backend="triton", params=p)
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
