"""The Triton backend's tile rule: the default tiles of every kind, and where they change, in one place.

Each kind's `default_params(block, T, target)` returns `tiles(kind, block, T, target)` as its parameters. The
rule reads the rows per active expert at T (`moetune.passes.policy.rows_per_active`), finds the rung of the
kind's ladder in `CUTS` (the rows at which each next rung starts), and returns that rung's fields, shaped to
the block: the FP8 kinds' tiles kept within one scale block, the token-mode down's rows sized to the k weight
streams of a token, the TMA path only where the layout admits it. Fields a kind leaves out take their
dataclass defaults. `constraints` overrides any field (the rule's pick for the rest), as a test or a user
pinning one tile would.

The search (`space` of each kind) is not bound by the rule: it only names the point the tuner starts from and
that the runtime runs where a table has no entry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...ir import MoEBlock
from ...targets import Target
from ..tiles import rung
from .layout import next_pow2, tma_refusal

# rows per active expert at which each kind's next rung starts (rows ≥ cut); "@fp8_block": the kind's FP8 kernel
CUTS: dict[str, tuple[float, ...]] = {
    "stream_gemv": (math.nextafter(1.5, math.inf),),  # FMA rows while about one row, then 16-row dots
    "stream_gemv@fp8_block": (math.nextafter(1.5, math.inf),),
    "grouped_gemm": (12, 48, 128),  # 16-, 64-, 128-row tiles, then TMA with the split down
    "grouped_gemm@fp8_block": (20, 48),  # 16-, 32- (TMA), 64-row tiles (TMA, 8 warps)
    "hybrid": (4,),  # 16-row GEMM tiles and wide GEMV programs, then 64-row tiles
    "hybrid@fp8_block": (4,),
    "fused_gemv": (),
    "fused_gemv@fp8_block": (),
}


def _rung(key: str, block: MoEBlock, T: int) -> int:
    return rung(CUTS[key], block, T)


def _scale_block(block: MoEBlock) -> tuple[int, int]:
    """The weights' scale block (rows, columns); 128 × 128 where the weights are not block-quantised."""
    return block.weight_format.block if block.weight_format.quantized else (128, 128)


def _token_rows(block: MoEBlock) -> int:
    """Output rows of a token-mode down program: 32 over the k weight streams of a token, at least 2."""
    return max(2, 32 // next_pow2(block.k))


def _fma_chunk(c: int) -> int:
    """The FP8 FMA rows' reduction chunk: two scale block columns (16-byte loads of the 1-byte weights)."""
    return 2 * c if c <= 128 else c


def _stream_gemv(block: MoEBlock, r: int) -> dict:
    """One row per weight read (pipelined FMA, the token-mode down: no combine) while the rows per active
    expert stay about one; beyond, 16-row tl.dot passes over each weight tile with the expert-mode down."""
    if r == 0:
        return dict(down_block_n=_token_rows(block))
    return dict(rows=16, block_n=64, block_k=128, down_block_n=64, down_block_k=128, down_mode="expert",
                fused_route=False)


def _stream_gemv_fp8(block: MoEBlock, r: int) -> dict:
    """While the rows per active expert stay about one: FMA rows with long chunks (16-byte loads of the 1-byte
    weights in every thread) and the token-mode down (no combine); beyond, 16-row tl.dot passes over each tile,
    one read of each weight for all of an expert's rows, and the expert-mode down."""
    sr, sc = _scale_block(block)
    bk = min(128, sc)
    if r == 0 or min(sr, sc) < 16:  # tl.dot needs tiles of ≥ 16
        return dict(block_n=min(16, sr), block_k=_fma_chunk(sc), down_block_n=min(sr, _token_rows(block)),
                    down_block_k=bk)
    return dict(rows=16, block_n=min(64, sr), block_k=bk, down_block_n=min(64, sr), down_block_k=bk,
                down_mode="expert", fused_route=False)


def _grouped_gemm(block: MoEBlock, r: int) -> dict:
    """16-row tl.dot tiles while experts get a few rows, 64-row tiles beyond, then 128-row tiles with the
    gate/up as one N = 256 tl.dot (one N = 256 dot beats two N = 128 dots at many rows per expert); from 128
    rows per expert every operand through TMA where the layout allows it (standard layout; slower than the
    pointer path at fewer rows), the gate/up as one dot from one [2, 128, 64] box and the down GEMM split in
    two along F with 16-bit y rows."""
    if r == 0:
        return dict(block_m=16, block_n=64, block_k=128, num_stages=4, down_block_n=64, down_block_k=128,
                    down_stages=4)
    if r == 1:
        return dict(block_m=64, block_n=64, block_k=64, num_stages=4, down_block_n=128, down_block_k=64,
                    down_stages=4)
    wide = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, one_dot=True, down_block_n=256,
                down_block_k=64, down_warps=8, down_stages=4)
    if r == 2 or tma_refusal(block):
        return wide
    return dict(wide, tma=True, down_stages=3, split_k=2, y_half=True)


def _grouped_gemm_fp8(block: MoEBlock, r: int) -> dict:
    """w8a8 (activations quantised per 1 × C group, C the weight block's columns): wherever the tuner timed
    both on the H200 it beat the weight-only tiles (bench/README.md, "FP8 experts"), and transformers' own FP8
    experts quantise activations the same way. 16-row tiles while experts get a few rows, then 32-row and
    64-row tiles through TMA (8 warps on the 64-row ones); 128 weight columns per tile and K steps of one scale
    block column; none spills registers on sm_90. Weight-only (act_quant "none") and 128-row tiles stay in the
    space for the tuner."""
    # w8a8: activations quantised per 1 × C group, C the weight block's columns; K steps of one scale column
    c = block.weight_format.block[1] if block.weight_format.block else 128
    bk = min(128, c)
    base = dict(block_n=128, block_k=bk, group_m=1, num_stages=4, down_block_n=128, down_block_k=bk,
                down_stages=4, y_half=True, act_quant=f"fp8_1x{c}")
    if r == 0:
        return dict(base, block_m=16)
    if r == 1:
        return dict(base, block_m=32, tma=True)
    return dict(base, block_m=64, num_warps=8, down_stages=3, tma=True)


def _hybrid(block: MoEBlock, r: int) -> dict:
    """16-row GEMM tiles and wide GEMV programs while experts get a few rows each; 64-row tiles beyond."""
    few = r == 0
    return dict(block_m=16 if few else 64, block_n=64, block_k=128 if few else 64, num_stages=4,
                gemv_block_n=8 if few else 4, gemv_block_k=256 if few else 128, down_block_n=64 if few else 128,
                down_block_k=128 if few else 64, down_gemv_block_n=4 if few else 2, down_gemv_block_k=128,
                down_stages=4)


def _hybrid_fp8(block: MoEBlock, r: int) -> dict:
    """16-row GEMM tiles one scale block column deep and stream_gemv_fp8's GEMV rows while experts get a few
    rows each; 64-row tiles beyond. Within the block's scale blocks for any block of ≥ 16 × 16."""
    sr, sc = _scale_block(block)
    bk, bn = min(128, sc), min(64, sr)
    return dict(block_m=16 if r == 0 else 64, block_n=bn, block_k=bk, gemv_block_n=min(16, sr),
                gemv_block_k=_fma_chunk(sc), down_block_n=bn, down_block_k=bk,
                down_gemv_block_n=min(sr, _token_rows(block)), down_gemv_block_k=bk)


def _fused_gemv(block: MoEBlock, r: int) -> dict:
    """8-row gate/up items with 16-byte loads per thread along D (16 rows double the accumulators and cost the
    grid a resident program per SM); down items of 32 rows over all of a token's weight streams
    (block_d · next_pow2(k) = 32), chunks of 128 along F; no L2 prefetch of the down weights (its requests
    compete with the gate/up stream)."""
    return dict(block_f=8, block_k=256, block_d=_token_rows(block), down_block_k=128)


def _fused_gemv_fp8(block: MoEBlock, r: int) -> dict:
    """fused_gemv's items within one scale block, the gate/up chunk two column blocks long (stream_gemv_fp8's
    FMA rows)."""
    sr, sc = _scale_block(block)
    return dict(block_f=min(8, sr), block_k=_fma_chunk(sc), block_d=min(_token_rows(block), sr),
                down_block_k=min(128, sc))


RUNGS = {
    "stream_gemv": _stream_gemv,
    "stream_gemv@fp8_block": _stream_gemv_fp8,
    "grouped_gemm": _grouped_gemm,
    "grouped_gemm@fp8_block": _grouped_gemm_fp8,
    "hybrid": _hybrid,
    "hybrid@fp8_block": _hybrid_fp8,
    "fused_gemv": _fused_gemv,
    "fused_gemv@fp8_block": _fused_gemv_fp8,
}


def tiles(key: str, block: MoEBlock, T: int, target: Target, constraints: Mapping[str, Any] | None = None) -> dict:
    """The default fields of kernel `key` ("grouped_gemm", "stream_gemv@fp8_block", …) on `block` at T tokens,
    with `constraints` over them."""
    fields = RUNGS[key](block, _rung(key, block, T))
    return {**fields, **(constraints or {})}

