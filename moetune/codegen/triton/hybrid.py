"""hybrid: in one launch per projection, experts with m_e ≥ R take GEMM tiles and the rest GEMV programs.

Program ids [0, G·NB) are GEMM tiles over the heavy experts (tile-fastest, so the tiles of one expert
run together and share its weight tiles in L2); ids after that are GEMV slots over the light experts
(1 ≤ m_e < R), one slot per expert × output block; its rows (< R) share one read of each weight
chunk (`_rows_gate_up` / `_rows_down`, FMA over [R−1 rounded up to 2^n, BN, BK]).  Both
halves read `counts`/`sorted_pairs` from routing.py.  R is the Schedule's `row_threshold`.
Down writes fp32 rows y [1, P, D] with the routing weight applied; combine.py sums them per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

from ...ir import DTYPE_BYTES, MoEBlock, Schedule, UnsupportedSchedule
from ...passes.stats import uniform_distinct
from ...targets import Target
from ..contract import KernelKind, sources
from ..space import ParamSpace
from ..tensors import ExpertTensors
from ..tiles import make
from . import combine as _combine
from . import routing
from ._common import (
    _find_slot,
    _heavy_tile,
    _row_down,
    _row_gate_up,
    _rows_down,
    _rows_gate_up,
    _store_h,
    _store_y,
    _tile_down,
    _tile_gate_up,
)
from .launch import launch
from .layout import act_args, call_args, cdiv, check_pow2, check_smem, dot_smem_bytes, interpreting, next_pow2
from .tiles import tiles

SOURCES = ("hybrid.py", "tiles.py", "_common.py", "layout.py", "routing.py", "combine.py", "launch.py")


# the tile sizes and warps of a hybrid's parameters (here and hybrid_fp8.py's): powers of two
POW2_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "gemv_block_n", "gemv_block_k", "down_block_n",
               "down_block_k", "down_gemv_block_n", "down_gemv_block_k", "down_warps")


@dataclass(frozen=True)
class HybridParams:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    gemv_block_n: int = 16
    gemv_block_k: int = 256
    down_block_n: int = 64
    down_block_k: int = 64
    down_gemv_block_n: int = 16
    down_gemv_block_k: int = 256
    down_warps: int = 4
    down_stages: int = 3

    def __post_init__(self) -> None:
        check_pow2("HybridParams", **{f: getattr(self, f) for f in POW2_FIELDS})
        if not interpreting() and min(self.block_m, self.block_n, self.block_k,
                                      self.down_block_n, self.down_block_k) < 16:
            raise UnsupportedSchedule(f"HybridParams {self}: tl.dot needs every GEMM block ≥ 16")


def check(p: HybridParams, target: Target) -> None:
    """What `target` cannot run: each GEMM part's tl.dot pipeline over the shared memory of one block."""
    for name, smem in (
        ("gate/up", dot_smem_bytes(p.block_m, p.block_n, p.block_k, p.num_stages, 2)),
        ("down", dot_smem_bytes(p.block_m, p.down_block_n, p.down_block_k, p.down_stages, 1)),
    ):
        check_smem(f"HybridParams {name} GEMM tile (block_m={p.block_m}, stages={p.num_stages}/{p.down_stages})",
                   smem, target, "lower block_k or the stages")


# holds every default of `default_params` (tests/codegen/test_contract.py)
CHOICES = (
    ("block_m", (16, 32, 64)),
    ("block_n", (32, 64, 128)),
    ("block_k", (64, 128)),
    ("num_warps", (4, 8)),
    ("num_stages", (2, 3, 4)),
    ("gemv_block_n", (4, 8, 16, 32)),
    ("gemv_block_k", (128, 256, 512)),
    ("down_block_n", (64, 128)),
    ("down_block_k", (64, 128)),
    ("down_gemv_block_n", (2, 4, 8, 16, 32)),
    ("down_gemv_block_k", (128, 256, 512)),
    ("down_warps", (4, 8)),
    ("down_stages", (2, 3, 4)),
)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(HybridParams, CHOICES, check=partial(check, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> HybridParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(HybridParams, tiles("hybrid", block, T, target, constraints))


@triton.jit(do_not_specialize=["P", "g_tiles", "n_gemm"])
def hybrid_kernel(
    x_ptr, s_xt, wts_ptr, counts_ptr, sorted_ptr,
    w_ptr, se, sn, sk, up, b_ptr, sbe, sbn, bup,
    h_ptr, s_hp, y_ptr, P, E, N, K, R, g_tiles, n_gemm, alpha, limit,
    PROJ: tl.constexpr, K_TOP: tl.constexpr, BLOCK_E: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BNV: tl.constexpr, BKV: tl.constexpr, RP: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_gemm:
        tile = pid % g_tiles
        n0 = (pid // g_tiles) * BN
        pairs, rmask, ec, k_end = _heavy_tile(counts_ptr, sorted_ptr, E, tile, BM, R, K, BLOCK_E)
        wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)
        if PROJ == 0:
            g, u = _tile_gate_up(x_ptr, s_xt, pairs // K_TOP, rmask, w_ptr + ec * se, sn, sk, up, n0, N,
                                 K, k_end, BM, BN, BK, UPCAST, False)
            _store_h(h_ptr, s_hp, pairs, rmask, g, u, wt, b_ptr + ec * sbe, sbn, bup, n0, N, alpha, limit,
                     BN, ACT, HAS_BIAS, W_IN)
        else:
            acc = _tile_down(h_ptr, s_hp, pairs, rmask, w_ptr + ec * se, sn, sk, n0, N, 0, k_end,
                             BM, BN, BK, UPCAST)
            _store_y(y_ptr, pairs, rmask, acc, wt, b_ptr + ec * sbe, sbn, 1.0, n0, N, BN, HAS_BIAS, W_IN)
    else:
        j = pid - n_gemm
        nbv = tl.cdiv(N, BNV)
        slot = j // nbv
        v_n0 = (j % nbv) * BNV
        v_e, v_st, v_m = _find_slot(counts_ptr, E, slot, R, True, BLOCK_E)
        v_ec = tl.where(v_m > 0, v_e, 0).to(tl.int64)
        v_r = tl.arange(0, RP)
        for v_c in range(0, v_m, RP):
            v_rmask = v_c + v_r < v_m
            v_pairs = tl.load(sorted_ptr + v_st + v_c + v_r, mask=v_rmask, other=0)  # [RP]
            v_wt = tl.load(wts_ptr + v_pairs, mask=v_rmask, other=0.0).to(tl.float32)
            if PROJ == 0:
                if RP == 1:
                    v_tok = tl.sum(v_pairs, axis=0) // K_TOP
                    v_g1, v_u1 = _row_gate_up(x_ptr, s_xt, v_tok, w_ptr + v_ec * se, sn, sk, up, v_n0, N, K,
                                              BNV, BKV, STAGES)
                    v_g = v_g1[None, :]
                    v_u = v_u1[None, :]
                else:
                    v_g, v_u = _rows_gate_up(x_ptr, s_xt, v_pairs // K_TOP, v_rmask, w_ptr + v_ec * se,
                                             sn, sk, up, v_n0, N, K, RP, BNV, BKV, STAGES)
                _store_h(h_ptr, s_hp, v_pairs, v_rmask, v_g, v_u, v_wt, b_ptr + v_ec * sbe, sbn, bup,
                         v_n0, N, alpha, limit, BNV, ACT, HAS_BIAS, W_IN)
            else:
                if RP == 1:
                    v_y = _row_down(h_ptr + tl.sum(v_pairs, axis=0).to(tl.int64) * s_hp, w_ptr + v_ec * se,
                                    sn, sk, v_n0, N, 0, K, BNV, BKV, STAGES)[None, :]
                else:
                    v_y = _rows_down(h_ptr, s_hp, v_pairs, v_rmask, w_ptr + v_ec * se, sn, sk, v_n0, N, 0, K,
                                     RP, BNV, BKV, STAGES)
                _store_y(y_ptr, v_pairs, v_rmask, v_y, v_wt, b_ptr + v_ec * sbe, sbn, 1.0, v_n0, N, BNV,
                         HAS_BIAS, W_IN)


def grid_parts(P: int, E: int, bm: int, R: int) -> tuple[int, int]:
    """(GEMM tile bound, GEMV slot bound): heavy experts ≤ P/R, light ones ≤ min(E, P)."""
    return max(1, P // bm + min(E, P // R)), max(1, min(E, P))


def build(block: MoEBlock, schedule: Schedule):
    """ExpertsFn of a hybrid schedule (params: HybridParams; R: the schedule's row_threshold)."""
    p = schedule.params
    R = schedule.row_threshold
    E, D, F = block.E, block.D, block.F
    alpha, limit = act_args(block)

    memo: dict = {}  # call_args' per-weights host work

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a = call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, gb, db, wts_f = a.T, a.P, a.gs, a.ds, a.gate_up_bias, a.down_bias, a.weights
        counts, sorted_pairs = routing.route(ids, E)
        meta = dict(a.meta, BM=p.block_m, RP=next_pow2(R - 1))
        g_tiles, v_slots = grid_parts(P, E, p.block_m, R)
        h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
        n_gemm = g_tiles * cdiv(F, p.block_n)
        launch(hybrid_kernel, (n_gemm + v_slots * cdiv(F, p.gemv_block_n),),
            x, x.stride(0), wts_f, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.sk, gs.up, gb, gs.sbe, gs.sbn, gs.bup,
            h, h.stride(0), h, P, E, F, D, R, g_tiles, n_gemm, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, BNV=p.gemv_block_n, BKV=p.gemv_block_k,
            num_warps=p.num_warps, num_stages=p.num_stages, STAGES=p.num_stages, **meta)
        y = torch.empty(1, P, D, dtype=torch.float32, device=x.device)  # [1, P, D]
        n_gemm = g_tiles * cdiv(D, p.down_block_n)
        launch(hybrid_kernel, (n_gemm + v_slots * cdiv(D, p.down_gemv_block_n),),
            x, x.stride(0), wts_f, counts, sorted_pairs,
            w.down, ds.se, ds.sn, ds.sk, 0, db, ds.sbe, ds.sbn, 0,
            h, h.stride(0), y, P, E, D, F, R, g_tiles, n_gemm, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, BNV=p.down_gemv_block_n, BKV=p.down_gemv_block_k,
            num_warps=p.down_warps, num_stages=p.down_stages, STAGES=p.down_stages, **meta)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        return _combine.combine(y, ids, out, E)

    return run


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): like grouped_gemm for the bytes (each distinct expert's weights once, in their format,
    block scales included), activations in the block's compute dtype; hybrid_fp8.py's too."""
    distinct = uniform_distinct(block.E, block.k, tokens)
    wb = DTYPE_BYTES[block.weight_format.compute_dtype]
    P = tokens * block.k
    flops = 2.0 * 3 * P * block.D * block.F
    by = (distinct * block.weight_bytes_per_expert + tokens * block.D * wb + 2 * P * block.F * wb
          + _combine.cost(1, P, tokens, block.D, wb)[1] + P * block.D * 4 + routing.cost(P, block.E)[1])
    return flops, by


KIND = KernelKind("hybrid", HybridParams, space, default_params, build, cost, sources(__file__, SOURCES))
