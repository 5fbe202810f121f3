"""hybrid for FP8 block-quantised experts: in one launch per projection, experts with m_e ≥ R take GEMM tiles
and the rest GEMV rows, reading e4m3 weights in place (weight format fp8_block, as stream_gemv_fp8.py).

The layout of hybrid.py (program ids [0, G·NB) GEMM tiles over the heavy experts, tile-fastest; the ids after
them GEMV programs over the light experts, one per expert × output block), with stream_gemv_fp8.py's FP8
pieces: a GEMM tile is BM expert-sorted rows through tl.dot on the weight tile widened to the activations'
dtype, each K step within one scale block column and its product times that block's multiplier
(`_tile_gate_up8` / `_tile_down8`, w8a16: activations stay in the model's dtype); a light expert's rows go
one at a time through the FMA GEMV, dequantising in registers (`_row_gate_up8` / `_row_down8`). Down writes
fp32 rows y [1, P, D] with the routing weight applied; combine.py sums them per token. R is the Schedule's
`row_threshold`. Sizes are whole scale blocks (`hybrid_refusal`): no row mask on the weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...targets import Target
from ..contract import KernelKind, sources
from ..space import ParamSpace
from ..tensors import ExpertTensors
from ..tiles import make
from . import combine as _combine
from . import routing
from ._common import _find_slot, _heavy_tile, _store_h, _store_y
from .hybrid import POW2_FIELDS, cost, grid_parts
from .launch import launch
from .layout import act_args, check_pow2, check_smem, dot_smem_bytes
from .stream_gemv_fp8 import (
    _aligned,
    _row_down8,
    _row_gate_up8,
    _tile_down8,
    _tile_gate_up8,
    fp8_call_args,
    whole_blocks_refusal,
)
from .tiles import tiles

SOURCES = ("hybrid_fp8.py", "tiles.py", "hybrid.py", "stream_gemv_fp8.py", "_fp8.py", "stream_gemv.py", "_common.py",
           "layout.py", "routing.py", "combine.py", "launch.py")


@dataclass(frozen=True)
class Fp8HybridParams:
    block_m: int = 16  # GEMM tile rows (expert-sorted pairs)
    block_n: int = 64  # GEMM tile columns of the output; divides the scale block's rows
    block_k: int = 128  # GEMM K step; divides the scale block's columns
    num_warps: int = 4
    num_stages: int = 4
    gemv_block_n: int = 16  # a light expert's output rows per program; divides the scale block's rows
    gemv_block_k: int = 256  # its reduction chunk: a multiple or a divisor of the scale block's columns
    down_block_n: int = 64
    down_block_k: int = 128
    down_gemv_block_n: int = 4
    down_gemv_block_k: int = 128
    down_warps: int = 4
    down_stages: int = 4

    def __post_init__(self) -> None:
        check_pow2("Fp8HybridParams", **{f: getattr(self, f) for f in POW2_FIELDS})
        small = [f"{n} = {getattr(self, n)}" for n in ("block_m", "block_n", "block_k", "down_block_n",
                                                       "down_block_k") if getattr(self, n) < 16]
        if small:
            raise UnsupportedSchedule(f"Fp8HybridParams: tl.dot tiles need ≥ 16, got {', '.join(small)}")
        for name, bn, bk, warps in (("gate/up", self.gemv_block_n, self.gemv_block_k, self.num_warps),
                                    ("down", self.down_gemv_block_n, self.down_gemv_block_k, self.down_warps)):
            regs = (2 if name == "gate/up" else 1) * bn * bk // (32 * warps)
            if regs > 128:
                raise UnsupportedSchedule(f"Fp8HybridParams {name} GEMV rows of {bn} × {bk} on {warps} warps: "
                                          f"{regs} fp32 accumulator registers per thread, limit 128")


def check(p: Fp8HybridParams, block: MoEBlock, target: Target) -> None:
    """Tiles that straddle a scale block, and each GEMM part's pipeline over the target's shared memory."""
    r, c = block.weight_format.block if block.weight_format.quantized else (128, 128)
    what = f"Fp8HybridParams on {r}x{c} scale blocks"
    for name in ("block_n", "gemv_block_n", "down_block_n", "down_gemv_block_n"):
        if r % getattr(p, name):
            raise UnsupportedSchedule(f"{what}: {name} = {getattr(p, name)} must divide the block rows {r}")
    for name in ("block_k", "down_block_k"):
        if c % getattr(p, name):
            raise UnsupportedSchedule(f"{what}: {name} = {getattr(p, name)} must divide the block columns {c}")
    for name in ("gemv_block_k", "down_gemv_block_k"):
        if not _aligned(getattr(p, name), c):
            raise UnsupportedSchedule(f"{what}: {name} = {getattr(p, name)} must divide or be a multiple of the "
                                      f"block columns {c}")
    for name, bn, bk, stages, mats in (("gate/up", p.block_n, p.block_k, p.num_stages, 2),
                                       ("down", p.down_block_n, p.down_block_k, p.down_stages, 1)):
        check_smem(f"Fp8HybridParams {name} GEMM tile (block_m={p.block_m}, {bn}×{bk}, stages={stages})",
                   dot_smem_bytes(p.block_m, 0, bk, stages, 0) + stages * mats * bk * bn, target,
                   "lower block_k or the stages")  # activation tiles, and the 1-byte weight tiles


# the candidates for 128 x 128 blocks (check refuses what another block cannot take); they hold every default
CHOICES = (
    ("block_m", (16, 32, 64)),
    ("block_n", (32, 64, 128)),
    ("block_k", (32, 64, 128)),
    ("num_warps", (4, 8)),
    ("num_stages", (2, 3, 4)),
    ("gemv_block_n", (4, 8, 16, 32)),
    ("gemv_block_k", (128, 256, 512)),
    ("down_block_n", (32, 64, 128)),
    ("down_block_k", (32, 64, 128)),
    ("down_gemv_block_n", (2, 4, 8, 16, 32)),
    ("down_gemv_block_k", (64, 128, 256)),
    ("down_warps", (4, 8)),
    ("down_stages", (2, 3, 4)),
)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(Fp8HybridParams, CHOICES, check=partial(check, block=block, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> Fp8HybridParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(Fp8HybridParams, tiles("hybrid@fp8_block", block, T, target, constraints))


@triton.jit(do_not_specialize=["P", "g_tiles", "n_gemm"])
def hybrid_fp8_kernel(
    x_ptr, s_xt, wts_ptr, counts_ptr, sorted_ptr,
    w_ptr, se, sn, up, s_ptr, sse, ssn, ssk, sup, b_ptr, sbe, sbn, bup,
    h_ptr, s_hp, y_ptr, P, E, N, K, R, g_tiles, n_gemm, alpha, limit,
    PROJ: tl.constexpr, K_TOP: tl.constexpr, BLOCK_E: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BNV: tl.constexpr, BKV: tl.constexpr,
    RB: tl.constexpr, CB: tl.constexpr, UE8M0: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_gemm:
        tile = pid % g_tiles
        n0 = (pid // g_tiles) * BN
        pairs, rmask, ec, k_end = _heavy_tile(counts_ptr, sorted_ptr, E, tile, BM, R, K, BLOCK_E)
        w_e = w_ptr + ec * se
        sc = s_ptr + ec * sse + (n0 // RB) * ssn
        wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)
        if PROJ == 0:
            g, u = _tile_gate_up8(x_ptr, s_xt, pairs // K_TOP, rmask, w_e, sn, up, sc, ssk, sup, n0, k_end,
                                  BM, BN, BK, CB, STAGES, UE8M0, UPCAST, False)
            _store_h(h_ptr, s_hp, pairs, rmask, g, u, wt, b_ptr + ec * sbe, sbn, bup, n0, N, alpha, limit,
                     BN, ACT, HAS_BIAS, W_IN)
        else:
            acc = _tile_down8(h_ptr, s_hp, pairs, rmask, w_e, sn, sc, ssk, n0, 0, k_end,
                              BM, BN, BK, CB, STAGES, UE8M0, UPCAST, False)
            _store_y(y_ptr, pairs, rmask, acc, wt, b_ptr + ec * sbe, sbn, 1.0, n0, N, BN, HAS_BIAS, W_IN)
    else:
        CW: tl.constexpr = BKV if BKV < CB else CB
        J: tl.constexpr = BKV // CW
        j = pid - n_gemm
        slot = j // (N // BNV)
        v_n0 = (j % (N // BNV)) * BNV
        v_e, v_st, v_m = _find_slot(counts_ptr, E, slot, R, True, BLOCK_E)
        v_ec = tl.where(v_m > 0, v_e, 0).to(tl.int64)
        w_e = w_ptr + v_ec * se
        sc = s_ptr + v_ec * sse + (v_n0 // RB) * ssn
        one = tl.arange(0, 1)
        for c in range(0, v_m):
            pairs = tl.load(sorted_ptr + v_st + c + one)  # [1]
            rmask = one < 1
            wt = tl.load(wts_ptr + pairs).to(tl.float32)
            pair = tl.sum(pairs, axis=0)
            if PROJ == 0:
                g1, u1 = _row_gate_up8(x_ptr, s_xt, pair // K_TOP, w_e, sn, up, sc, ssk, sup, v_n0, K,
                                       BNV, J, CW, CB, STAGES, UE8M0)
                _store_h(h_ptr, s_hp, pairs, rmask, g1[None, :], u1[None, :], wt, b_ptr + v_ec * sbe, sbn, bup,
                         v_n0, N, alpha, limit, BNV, ACT, HAS_BIAS, W_IN)
            else:
                acc = _row_down8(h_ptr + pair.to(tl.int64) * s_hp, w_e, sn, sc, ssk, v_n0, 0, K, K,
                                 BNV, J, CW, CB, STAGES, UE8M0)[None, :]
                _store_y(y_ptr, pairs, rmask, acc, wt, b_ptr + v_ec * sbe, sbn, 1.0, v_n0, N, BNV, HAS_BIAS, W_IN)


def build(block: MoEBlock, schedule: Schedule):
    """ExpertsFn of a hybrid schedule on fp8_block weights (params: Fp8HybridParams; R: its row_threshold)."""
    why = hybrid_refusal(block)
    if why:
        raise UnsupportedSchedule(why)
    p, R = schedule.params, schedule.row_threshold
    E, D, F = block.E, block.D, block.F
    RB, CB = block.weight_format.block
    alpha, limit = act_args(block)
    memo: dict = {}  # call_args' per-weights host work

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a, gsc, dsc, ue8 = fp8_call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, gb, db, wts_f = a.T, a.P, a.gs, a.ds, a.gate_up_bias, a.down_bias, a.weights
        counts, sorted_pairs = routing.route(ids, E)
        meta = dict(a.meta, BM=p.block_m, RB=RB, CB=CB, UE8M0=ue8)
        g_tiles, v_slots = grid_parts(P, E, p.block_m, R)
        h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
        n_gemm = g_tiles * (F // p.block_n)
        launch(hybrid_fp8_kernel, (n_gemm + v_slots * (F // p.gemv_block_n),),
            x, x.stride(0), wts_f, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.up, gsc, gsc.stride(0), gsc.stride(1), gsc.stride(2),
            (F // RB) * gsc.stride(1), gb, gs.sbe, gs.sbn, gs.bup,
            h, h.stride(0), h, P, E, F, D, R, g_tiles, n_gemm, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, BNV=p.gemv_block_n, BKV=p.gemv_block_k,
            num_warps=p.num_warps, num_stages=p.num_stages, STAGES=p.num_stages, **meta)
        y = torch.empty(1, P, D, dtype=torch.float32, device=x.device)  # [1, P, D]
        n_gemm = g_tiles * (D // p.down_block_n)
        launch(hybrid_fp8_kernel, (n_gemm + v_slots * (D // p.down_gemv_block_n),),
            x, x.stride(0), wts_f, counts, sorted_pairs,
            w.down, ds.se, ds.sn, 0, dsc, dsc.stride(0), dsc.stride(1), dsc.stride(2), 0, db, ds.sbe, ds.sbn, 0,
            h, h.stride(0), y, P, E, D, F, R, g_tiles, n_gemm, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, BNV=p.down_gemv_block_n, BKV=p.down_gemv_block_k,
            num_warps=p.down_warps, num_stages=p.down_stages, STAGES=p.down_stages, **meta)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        return _combine.combine(y, ids, out, E)

    return run


def hybrid_refusal(block: MoEBlock) -> str | None:
    return whole_blocks_refusal(block, "hybrid")


KIND = KernelKind("hybrid", Fp8HybridParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=hybrid_refusal, formats=("fp8_block",))
