"""grouped_gemm: expert-sorted rows in BLOCK_M tiles through tl.dot; tensor-core bound at many rows.

One kernel, two projections (PROJ):
  0 gate/up   tile × F-block: A = x[token of each sorted pair] [BM, BK], B = gate and up tiles of the
              expert [BK, BN] read in place; SwiGLU in the epilogue; h [P, F] (pair order) in x.dtype.
  1 down      tile × D-block: A = h[pairs], B = down tile; routing weight in the epilogue; fp32 rows
              y [1, P, D], then combine.py sums the k rows of each token.
Tiles come from `counts` (routing.py) through `_find_tile`: tile t of expert e holds sorted rows
[t·BM, t·BM + BM) of e.  The grid is static: ⌊P/BM⌋ + min(E, P) tiles bound Σ_e ⌈m_e/BM⌉; tiles past
the real ones skip their K loop.  Program order is grouped (GROUP_M tiles per N-block sweep) so the
tiles of one expert share its weight tiles in L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ..common import ExpertTensors, ParamSpace
from . import combine as _combine
from . import routing
from ._common import (
    H200_SMEM_LIMIT,
    _find_tile,
    _store_h,
    _store_y,
    _tile_down,
    _tile_gate_up,
    _tile_gate_up_one,
    act_args,
    call_args,
    check_pow2,
    dot_smem_bytes,
    interpreting,
)


@dataclass(frozen=True)
class GemmParams:
    block_m: int = 64
    block_n: int = 64  # gate/up: F columns per tile (two accumulators: gate and up)
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int = 64  # down: D columns per tile
    down_block_k: int = 64
    down_warps: int = 4
    down_stages: int = 3
    one_dot: bool = False  # gate/up as one N = 2·block_n tl.dot (interleaved B tile) instead of two
    split_k: int = 1  # down: F split in this many fp32 partial planes (more tiles: a shorter last wave)

    def __post_init__(self) -> None:
        check_pow2("GemmParams", block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                   down_block_n=self.down_block_n, down_block_k=self.down_block_k,
                   num_warps=self.num_warps, down_warps=self.down_warps)
        if not interpreting() and min(self.block_m, self.block_n, self.block_k,
                                      self.down_block_n, self.down_block_k) < 16:
            raise UnsupportedSchedule(f"GemmParams {self}: tl.dot needs every block ≥ 16")
        if self.split_k not in (1, 2, 4, 8):
            raise UnsupportedSchedule(f"GemmParams.split_k = {self.split_k}: 1, 2, 4 or 8")
        if self.group_m < 1:
            raise UnsupportedSchedule(f"GemmParams.group_m = {self.group_m}: must be ≥ 1")
        for name, smem in (
            ("gate/up", dot_smem_bytes(self.block_m, self.block_n, self.block_k, self.num_stages, 2)),
            ("down", dot_smem_bytes(self.block_m, self.down_block_n, self.down_block_k, self.down_stages, 1)),
        ):
            if smem > H200_SMEM_LIMIT:
                bn, bk, st = ((self.block_n, self.block_k, self.num_stages) if name == "gate/up"
                              else (self.down_block_n, self.down_block_k, self.down_stages))
                raise UnsupportedSchedule(
                    f"GemmParams {name} tile block_m={self.block_m} block_n={bn} block_k={bk} stages={st}: "
                    f"needs {smem // 1024} KiB shared memory, limit {H200_SMEM_LIMIT // 1024} KiB; "
                    "lower block_k or the stages")


SPACE = ParamSpace(GemmParams, (
    ("block_m", (16, 32, 64, 128)),
    ("block_n", (32, 64, 128)),
    ("block_k", (64, 128)),
    ("group_m", (1, 8, 32)),
    ("num_warps", (4, 8)),
    ("num_stages", (2, 3, 4)),
    ("down_block_n", (64, 128, 256)),
    ("down_block_k", (64, 128)),
    ("down_warps", (4, 8)),
    ("down_stages", (2, 3, 4)),
    ("one_dot", (False, True)),
    ("split_k", (1, 2, 4)),
))


@triton.jit(do_not_specialize=["P", "n_tiles"])
def grouped_gemm_kernel(
    x_ptr, s_xt, wts_ptr, counts_ptr, sorted_ptr,
    w_ptr, se, sn, sk, up, b_ptr, sbe, sbn, bup,
    h_ptr, s_hp, y_ptr, P, E, N, K, n_tiles, k_split, alpha, limit,
    PROJ: tl.constexpr, K_TOP: tl.constexpr, BLOCK_E: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    ONE_DOT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    nb_n = tl.cdiv(N, BN)
    in_group = GROUP_M * nb_n
    first = (pid // in_group) * GROUP_M
    gsize = tl.minimum(n_tiles - first, GROUP_M)
    tile = first + (pid % in_group) % gsize
    n0 = ((pid % in_group) // gsize) * BN
    e, row0, left = _find_tile(counts_ptr, E, tile, BM, 0, False, BLOCK_E)
    r = tl.arange(0, BM)
    rmask = r < left
    pairs = tl.load(sorted_ptr + row0 + r, mask=rmask, other=0)  # [BM]
    ec = tl.where(left > 0, e, 0).to(tl.int64)
    k_end = tl.where(left > 0, K, 0)
    wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [BM]
    if PROJ == 0:
        if ONE_DOT:
            g, u = _tile_gate_up_one(x_ptr, s_xt, pairs // K_TOP, rmask, w_ptr + ec * se, sn, sk, up, n0, N,
                                     K, k_end, BM, BN, BK, UPCAST)
        else:
            g, u = _tile_gate_up(x_ptr, s_xt, pairs // K_TOP, rmask, w_ptr + ec * se, sn, sk, up, n0, N, K,
                                 k_end, BM, BN, BK, UPCAST)
        _store_h(h_ptr, s_hp, pairs, rmask, g, u, wt, b_ptr + ec * sbe, sbn, bup, n0, N, alpha, limit,
                 BN, ACT, HAS_BIAS, W_IN)
    else:
        ks = tl.program_id(1)  # split of the F reduction: fp32 partial planes y [S, P, D]
        k_lo = ks * k_split
        k_hi = tl.where(left > 0, tl.minimum(k_lo + k_split, K), k_lo)
        acc = _tile_down(h_ptr, s_hp, pairs, rmask, w_ptr + ec * se, sn, sk, n0, N, k_lo, k_hi,
                         BM, BN, BK, UPCAST)
        _store_y(y_ptr + ks.to(tl.int64) * P * N, pairs, rmask, acc, wt, b_ptr + ec * sbe, sbn,
                 (ks == 0).to(tl.float32), n0, N, BN, HAS_BIAS, W_IN)


def max_tiles(P: int, E: int, bm: int) -> int:
    """Upper bound of Σ_e ⌈m_e / BM⌉ over any routing of P pairs."""
    return max(1, P // bm + min(E, P))


def build(block: MoEBlock, schedule: Schedule):
    p = schedule.params if schedule.params is not None else GemmParams()
    if not isinstance(p, GemmParams):
        raise UnsupportedSchedule(f"grouped_gemm takes GemmParams, got {type(p).__name__}")
    E, D, F = block.E, block.D, block.F
    alpha, limit = act_args(block)

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a = call_args(block, x, ids, weights, w)
        T, P, gs, ds, gb, db, wts_f = a.T, a.P, a.gs, a.ds, a.gate_up_bias, a.down_bias, a.weights
        counts, sorted_pairs = routing.route(ids, E)
        meta = dict(a.meta, BM=p.block_m, GROUP_M=p.group_m)
        nt = max_tiles(P, E, p.block_m)
        h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
        grouped_gemm_kernel[(nt * triton.cdiv(F, p.block_n),)](
            x, x.stride(0), wts_f, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.sk, gs.up, gb, gs.sbe, gs.sbn, gs.bup,
            h, h.stride(0), h, P, E, F, D, nt, D, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, ONE_DOT=p.one_dot, num_warps=p.num_warps,
            num_stages=p.num_stages, **meta)
        k_split = triton.cdiv(triton.cdiv(F, p.split_k), p.down_block_k) * p.down_block_k
        S = triton.cdiv(F, k_split)
        y = torch.empty(S, P, D, dtype=torch.float32, device=x.device)  # [S, P, D]
        grouped_gemm_kernel[(nt * triton.cdiv(D, p.down_block_n), S)](
            x, x.stride(0), wts_f, counts, sorted_pairs,
            w.down, ds.se, ds.sn, ds.sk, 0, db, ds.sbe, ds.sbn, 0,
            h, h.stride(0), y, P, E, D, F, nt, k_split, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, num_warps=p.down_warps,
            num_stages=p.down_stages, **meta)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        return _combine.combine(y, ids, out, E)

    return run


def cost(block: MoEBlock, params: GemmParams, tokens: int, distinct: float) -> tuple[float, float]:
    """(flops, bytes): weights of each distinct expert once (L2 serves the other tiles), x, h, y."""
    wb = 2 if block.weight_dtype != "float32" else 4
    P = tokens * block.k
    tiles = P / params.block_m + distinct
    flops = 2.0 * 3 * tiles * params.block_m * block.D * block.F  # padded rows included
    by = (distinct * block.weight_bytes_per_expert + tokens * block.D * wb + 2 * P * block.F * wb
          + _combine.cost(params.split_k, P, tokens, block.D, wb)[1] + params.split_k * P * block.D * 4
          + routing.cost(P, block.E)[1])
    return flops, by
