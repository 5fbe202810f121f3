"""The pallas_gpu backend's tile rule: the default tiles of every kind, and where they change, in one place.

Each kind's `default_params(block, T, target)` returns `tiles(kind, block, T, target)` as its parameters (as the
Triton backend's `moetune.codegen.triton.tiles`). `CUTS` holds the rows per active expert at which a kind's
next rung starts; the GEMV's tiles follow its grid instead (T·D/BN down programs against the SMs). Every tile
shrinks to divide small D and F; on FP8 weights each is cut to one scale block. `constraints` overrides any
field. Fields left out take their dataclass defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import gcd
from typing import Any

from ...ir import MoEBlock
from ...targets import Target
from ..tiles import rung
from ._common import MIN_BK, REG_ELEMS, pow2_divisor

# rows per active expert at which each kind's next rung starts (rows ≥ cut); "@fp8_block": the FP8 kernel
CUTS: dict[str, tuple[float, ...]] = {
    "grouped_gemm": (16,),  # 16-row tiles (a decode bucket pads less), then 64-row tiles
    "grouped_gemm@fp8_block": (16,),
    "stream_gemv": (),
    "stream_gemv@fp8_block": (),
}


def _grouped_gemm(block: MoEBlock, T: int, target: Target) -> dict:
    """64-row tiles (16 below the cut), 64-wide output tiles and 64-wide chunks, shrunk to divide small D and F."""
    side = pow2_divisor(gcd(block.D, block.F), 64)
    return dict(block_m=64 if rung(CUTS["grouped_gemm"], block, max(1, T)) else 16, block_n=side, block_k=side)


def _grouped_gemm_fp8(block: MoEBlock, T: int, target: Target) -> dict:
    """grouped_gemm's tiles with the output tile cut to a scale block's rows and the K step to its columns, at
    least MIN_BK."""
    p = _grouped_gemm(block, T, target)
    r, c = block.weight_format.block
    return dict(p, block_n=min(p["block_n"], r), block_k=min(max(p["block_k"], MIN_BK), c))


def _stream_gemv(block: MoEBlock, T: int, target: Target) -> dict:
    """16-row gate/up tiles over 256-wide chunks (T·k·F/16 programs: several per SM from one token on); the
    down grid has only T·D/BN_d programs, so its tile narrows (to 4 rows) until there are two programs per SM.
    The down loads the tiles of G pairs a chunk, G the largest power of two ≤ 8 that divides k (no idle lane);
    they are in registers at once (REG_ELEMS a thread over 4 warps), so the rows are cut further where that would
    leave a chunk under 128 columns, and the chunk takes the width that remains (at most 512). Every tile
    shrinks to divide small D and F."""
    lanes, regs = pow2_divisor(block.k, 8), REG_ELEMS * 32 * 4
    bn = 16
    while bn > 4 and T * block.D // bn < 2 * (target.sm_count or 1):
        bn //= 2
    bn = pow2_divisor(block.D, max(1, min(bn, regs // (lanes * 128))))
    bk = max(1, min(512, regs // (lanes * bn)))
    return dict(block_n=pow2_divisor(block.F, 16), block_k=pow2_divisor(block.D, 256), down_block_n=bn,
                down_block_k=pow2_divisor(block.F, bk), down_pairs=lanes)


def _stream_gemv_fp8(block: MoEBlock, T: int, target: Target) -> dict:
    """stream_gemv's tiles with every reduction chunk cut to one scale block's columns."""
    p = _stream_gemv(block, T, target)
    r, c = block.weight_format.block
    return dict(p, block_n=min(p["block_n"], r), block_k=min(p["block_k"], c),
                down_block_n=min(p["down_block_n"], r), down_block_k=min(p["down_block_k"], c))


def _hybrid(block: MoEBlock, T: int, target: Target) -> dict:
    """The two kinds' tiles at T (the GEMM side's cut), the GEMV's tile used for both of its projections (and its
    down's groups of pairs)."""
    m, v = _grouped_gemm(block, T, target), _stream_gemv(block, T, target)
    return dict(m, gemv_block_n=min(v["block_n"], v["down_block_n"]), gemv_block_k=min(v["block_k"], v["down_block_k"]),
                gemv_pairs=v["down_pairs"])


RULES = {
    "grouped_gemm": _grouped_gemm,
    "grouped_gemm@fp8_block": _grouped_gemm_fp8,
    "stream_gemv": _stream_gemv,
    "stream_gemv@fp8_block": _stream_gemv_fp8,
    "hybrid": _hybrid,
}


def tiles(key: str, block: MoEBlock, T: int, target: Target, constraints: Mapping[str, Any] | None = None) -> dict:
    """The default fields of kernel `key` on `block` at T tokens, with `constraints` over them."""
    return {**RULES[key](block, T, target), **(constraints or {})}
