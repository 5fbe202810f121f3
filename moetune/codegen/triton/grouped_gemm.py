"""grouped_gemm: expert-sorted rows in BLOCK_M tiles through tl.dot; tensor-core bound at many rows.

One kernel per operand path, two projections (PROJ) each:
  0 gate/up   tile × F-block: A = x rows of the tile's sorted pairs [BM, BK], B = gate and up tiles of
              the expert read in place; SwiGLU in the epilogue; h [P, F] in x.dtype (tma: the weights').
  1 down      tile × D-block (× split_k F ranges; pointer path: down_nb D-blocks per program in one
              flattened pipelined loop): A = h rows, B = down tile; routing weight in the
              epilogue; rows y [S, P, D] (S = split_k partial planes; fp32, or with y_half the 16-bit
              activation dtype), then combine.py sums the S planes and the k rows of each token in fp32.
Tiles come from `counts` (routing.py) through `_find_tile`: tile t of expert e holds sorted rows
[t·BM, t·BM + BM) of e.  The grid is static: ⌊P/BM⌋ + min(E, P) tiles bound Σ_e ⌈m_e/BM⌉; tiles past
the real ones skip their K loop.  Program order is grouped (GROUP_M tiles per N-block sweep) so the
tiles of one expert share its weight tiles in L2.

Operand paths:
  pointer  `grouped_gemm_kernel`: A gathered row by row (pair → token), B through the layout's strides;
           h and y in pair order. Any layout.
  tma      `grouped_gemm_tma_kernel` (GemmParams.tma): routing.gather first copies the token rows into
           sorted order, xs [P, D]; then a tile's A is one box [row0, row0 + BM) of xs (gate/up) or of h,
           which gate/up writes in sorted order, and B one box of the weights viewed [E·2F, D] / [E·D, F]
           (standard layout, read in place): every operand through the tensor memory accelerator, no
           address registers, no padding rows (rows of the tile past its expert belong to the next one:
           computed and dropped). Workspace + xs [P, D].
           With GemmParams.one_dot the gate/up weights are seen as [2E, F, D] (gate of e at 2e, up at
           2e + 1) and one box [2, BN, BK] holds both tiles: reshaped in shared memory to [2·BN, BK], it
           feeds ONE tl.dot of N = 2·BN (sm_90: wgmma m64n256k16 at BN = 128 instead of two m64n128k16
           that each read the A tile again), and one TMA load per K step instead of two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...passes.stats import uniform_distinct
from ...targets import Target
from ..contract import KernelKind, sources
from ..space import ParamSpace
from ..tensors import ExpertTensors
from ..tiles import make
from . import combine as _combine
from . import routing
from ._common import _dot_step, _find_tile, _store_h, _store_y, _tile_down, _tile_gate_up
from .launch import launch
from .layout import act_args, call_args, cdiv, check_pow2, check_smem, dot_smem_bytes, interpreting, tma_refusal
from .tiles import tiles

SOURCES = ("grouped_gemm.py", "tiles.py", "_common.py", "layout.py", "routing.py", "combine.py", "launch.py")


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
    one_dot: bool = False  # gate/up as one N = 2·block_n tl.dot instead of two (pointer: interleaved B tile;
    # tma: one [2, block_n, block_k] box of the gate and up rows)
    split_k: int = 1  # down: F split in this many partial planes of y (more tiles: a shorter last wave)
    tma: bool = False  # both operands of both GEMMs through TMA descriptors (standard layout; see above)
    # down: y rows in x's dtype instead of fp32 (a 16-bit x: half the bytes the down GEMM writes and the
    # combine reads, S·P·D·2 each; each (pair, column) value rounded once, the sum over k stays fp32)
    y_half: bool = False
    # down (pointer path): D-column blocks per program, walked in one flattened pipelined loop (the next
    # block's tiles load while the current one ends; the tile's set-up is paid once for all of them; the
    # store inside the loop takes a staging tile of its own)
    down_nb: int = 1

    def __post_init__(self) -> None:
        if self.down_nb not in (1, 2, 4, 8):
            raise UnsupportedSchedule(f"GemmParams.down_nb = {self.down_nb}: 1, 2, 4 or 8")
        if self.down_nb > 1 and self.tma:  # the TMA down loop flattened over column blocks holds more shared memory
            raise UnsupportedSchedule("GemmParams.down_nb > 1 with tma: the pointer path only (the TMA down "
                                      "loop flattened over column blocks needs more shared memory and runs slower)")
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


def check(p: GemmParams, target: Target) -> None:
    """What `target` cannot run: each GEMM's tl.dot pipeline over the shared memory of one block."""
    for name, bn, bk, st, smem in (
        ("gate/up", p.block_n, p.block_k, p.num_stages,
         dot_smem_bytes(p.block_m, p.block_n, p.block_k, p.num_stages, 2)),
        # down_nb > 1: the store inside the loop takes its own [BM, BN] fp32 staging tile
        ("down", p.down_block_n, p.down_block_k, p.down_stages,
         dot_smem_bytes(p.block_m, p.down_block_n, p.down_block_k, p.down_stages, 1)
         + (p.block_m * p.down_block_n * 4 if p.down_nb > 1 else 0)),
    ):
        check_smem(f"GemmParams {name} tile block_m={p.block_m} block_n={bn} block_k={bk} stages={st}", smem,
                   target, "lower block_k or the stages")


CHOICES = (
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
    ("tma", (False, True)),
    ("y_half", (False, True)),
    ("down_nb", (1, 2, 4)),
)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(GemmParams, CHOICES, check=partial(check, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> GemmParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(GemmParams, tiles("grouped_gemm", block, T, target, constraints))


@triton.jit
def _grouped_tile(pid, n_tiles, N, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program → (row tile, first column n0) in grouped order: GROUP_M row tiles sweep each column
    block together, so the tiles of one expert share its weight tiles in L2."""
    nb_n = tl.cdiv(N, BN)
    in_group = GROUP_M * nb_n
    first = (pid // in_group) * GROUP_M
    gsize = tl.minimum(n_tiles - first, GROUP_M)
    tile = first + (pid % in_group) % gsize
    n0 = ((pid % in_group) // gsize) * BN
    return tile, n0


@triton.jit
def _nb_step(i, nk, k_lo, n_first, BK: tl.constexpr, BN: tl.constexpr):
    """Step i of a down loop over column blocks, nk K steps each, flattened: (its first K column, its block's
    first column)."""
    b = i // nk
    return k_lo + (i - b * nk) * BK, n_first + b * BN


@triton.jit
def _tile_down_nb(h_ptr, s_hp, pairs, rmask, w_e, sn, sk, n_first, N, k_lo, k_hi, y_ptr, wt, b_e, sbn,
                  first_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr,
                  UPCAST: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr):
    """_tile_down + _store_y over NB consecutive column blocks [n_first + b·BN, +BN) of one row tile in ONE
    pipelined loop (b, K step) flattened: at a short reduction (F = 768: 6 steps of 128) the next block's
    first tiles load while the current one finishes, and the tile's set-up (counts, pairs, weights) is
    paid once for NB blocks. Each block's y rows are stored when its last K step is in."""
    nk = tl.cdiv(k_hi - k_lo, BK)
    nb = tl.minimum(NB, tl.cdiv(N - n_first, BN))
    arow = h_ptr + pairs.to(tl.int64)[:, None] * s_hp
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i in range(0, nb * nk):
        k0, n0 = _nb_step(i, nk, k_lo, n_first, BK, BN)
        offs_n = n0 + tl.arange(0, BN)
        acc = _dot_step(arow, w_e + offs_n[None, :] * sn, sk, k0, k_hi, rmask, offs_n < N, acc, BK, UPCAST)
        if k0 + BK >= k_hi:  # block b complete
            _store_y(y_ptr, pairs, rmask, acc, wt, b_e, sbn, first_split, n0, N, BN, HAS_BIAS, W_IN)
            acc = tl.zeros([BM, BN], dtype=tl.float32)


@triton.jit(do_not_specialize=["P", "n_tiles"])
def grouped_gemm_kernel(
    x_ptr, s_xt, wts_ptr, counts_ptr, sorted_ptr,
    w_ptr, se, sn, sk, up, b_ptr, sbe, sbn, bup,
    h_ptr, s_hp, y_ptr, P, E, N, K, n_tiles, k_split, alpha, limit,
    PROJ: tl.constexpr, K_TOP: tl.constexpr, BLOCK_E: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    ONE_DOT: tl.constexpr = False, NB: tl.constexpr = 1,
):
    tile, n0 = _grouped_tile(tl.program_id(0), n_tiles, N, BN * NB, GROUP_M)
    e, row0, left = _find_tile(counts_ptr, E, tile, BM, 0, False, BLOCK_E)
    r = tl.arange(0, BM)
    rmask = r < left
    pairs = tl.load(sorted_ptr + row0 + r, mask=rmask, other=0)  # [BM]
    ec = tl.where(left > 0, e, 0).to(tl.int64)
    k_end = tl.where(left > 0, K, 0)
    wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [BM]
    if PROJ == 0:
        g, u = _tile_gate_up(x_ptr, s_xt, pairs // K_TOP, rmask, w_ptr + ec * se, sn, sk, up, n0, N, K,
                             k_end, BM, BN, BK, UPCAST, ONE_DOT)
        _store_h(h_ptr, s_hp, pairs, rmask, g, u, wt, b_ptr + ec * sbe, sbn, bup, n0, N, alpha, limit,
                 BN, ACT, HAS_BIAS, W_IN)
    else:
        ks = tl.program_id(1)  # split of the F reduction: fp32 partial planes y [S, P, D]
        k_lo = ks * k_split
        k_hi = tl.where(left > 0, tl.minimum(k_lo + k_split, K), k_lo)
        if NB == 1:
            acc = _tile_down(h_ptr, s_hp, pairs, rmask, w_ptr + ec * se, sn, sk, n0, N, k_lo, k_hi,
                             BM, BN, BK, UPCAST)
            _store_y(y_ptr + ks.to(tl.int64) * P * N, pairs, rmask, acc, wt, b_ptr + ec * sbe, sbn,
                     (ks == 0).to(tl.float32), n0, N, BN, HAS_BIAS, W_IN)
        else:  # NB column blocks in one flattened loop
            _tile_down_nb(h_ptr, s_hp, pairs, rmask, w_ptr + ec * se, sn, sk, n0, N, k_lo, k_hi,
                          y_ptr + ks.to(tl.int64) * P * N, wt, b_ptr + ec * sbe, sbn, (ks == 0).to(tl.float32),
                          BM, BN, BK, NB, UPCAST, HAS_BIAS, W_IN)


@triton.jit(do_not_specialize=["P", "n_tiles"])
def grouped_gemm_tma_kernel(
    a_desc, b_desc, wts_ptr, counts_ptr, sorted_ptr, b_ptr, sbe, sbn, bup,
    h_ptr, y_ptr, P, E, N, K, n_tiles, k_split, alpha, limit,
    BLOCK_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PROJ: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    ONE_DOT: tl.constexpr = False,
):
    """The TMA operand path. a_desc: xs [P, D] (PROJ 0) or h [P, F] (PROJ 1), sorted order, box [BM, BK];
    b_desc: gate_up as [E·2F, D] (gate rows e·2F + n, up rows e·2F + F + n) or down as [E·D, F], box
    [BN, BK]; with ONE_DOT gate_up as [2E, F, D], box [2, BN, BK]. Boxes past a tensor's edge read
    zeros."""
    tile, n0 = _grouped_tile(tl.program_id(0), n_tiles, N, BN, GROUP_M)
    e, row0, left = _find_tile(counts_ptr, E, tile, BM, 0, False, BLOCK_E)
    if left > 0:
        r = tl.arange(0, BM)
        rmask = r < left
        pairs = tl.load(sorted_ptr + row0 + r, mask=rmask, other=0)  # [BM]
        wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [BM]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if PROJ == 0 and ONE_DOT:
            acc2 = tl.zeros([BM, 2 * BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                a = a_desc.load([row0, k0])  # [BM, BK]
                b = tl.reshape(b_desc.load([2 * e, n0, k0]), [2 * BN, BK])  # gate rows, then up rows
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc2 = tl.dot(a, b.T, acc2)  # [BM, 2BN]: gate columns, then up columns
            acc, accu = tl.split(tl.permute(tl.reshape(acc2, [BM, 2, BN]), [0, 2, 1]))
            _store_h(h_ptr, N, row0 + r, rmask, acc, accu, wt, b_ptr + e * sbe, sbn, bup, n0, N, alpha, limit,
                     BN, ACT, HAS_BIAS, W_IN)
        elif PROJ == 0:
            accu = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                a = a_desc.load([row0, k0])  # [BM, BK]
                bg = b_desc.load([e * 2 * N + n0, k0])  # [BN, BK]
                bu = b_desc.load([e * 2 * N + N + n0, k0])  # [BN, BK]
                if UPCAST:
                    a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
                acc = tl.dot(a, bg.T, acc)
                accu = tl.dot(a, bu.T, accu)
            # h in sorted order: row row0 + r
            _store_h(h_ptr, N, row0 + r, rmask, acc, accu, wt, b_ptr + e * sbe, sbn, bup, n0, N, alpha, limit,
                     BN, ACT, HAS_BIAS, W_IN)
        else:
            ks = tl.program_id(1)  # split of the F reduction: fp32 partial planes y [S, P, D]
            k_lo = ks * k_split
            for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BK):
                a = a_desc.load([row0, k0])  # [BM, BK]
                b = b_desc.load([e * N + n0, k0])  # [BN, BK]
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b.T, acc)
            _store_y(y_ptr + ks.to(tl.int64) * P * N, pairs, rmask, acc, wt, b_ptr + e * sbe, sbn,
                     (ks == 0).to(tl.float32), n0, N, BN, HAS_BIAS, W_IN)


def max_tiles(P: int, E: int, bm: int) -> int:
    """Upper bound of Σ_e ⌈m_e / BM⌉ over any routing of P pairs."""
    return max(1, P // bm + min(E, P))


def _desc(t: torch.Tensor, shape: list[int], strides: list[int], box: list[int]) -> TensorDescriptor:
    """A descriptor over `t` seen as `shape` with element `strides` (the last one 1)."""
    es = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * es % 16 for s in strides[:-1]):
        raise UnsupportedSchedule(f"grouped_gemm tma: tensor {tuple(t.shape)} strides {t.stride()} cannot be "
                                  "a TMA operand (last dimension contiguous, 16-byte aligned rows needed)")
    return TensorDescriptor(t, shape, strides, box)


def build(block: MoEBlock, schedule: Schedule):
    """ExpertsFn of a grouped_gemm schedule (params: GemmParams)."""
    p = schedule.params
    E, D, F = block.E, block.D, block.F
    alpha, limit = act_args(block)
    if p.tma:
        why = tma_refusal(block)
        if why:
            raise UnsupportedSchedule(why)
        return _build_tma(block, p, alpha, limit)

    memo: dict = {}  # call_args' per-weights host work

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a = call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, gb, db, wts_f = a.T, a.P, a.gs, a.ds, a.gate_up_bias, a.down_bias, a.weights
        counts, sorted_pairs = routing.route(ids, E)
        meta = dict(a.meta, BM=p.block_m, GROUP_M=p.group_m)
        nt = max_tiles(P, E, p.block_m)
        h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
        launch(grouped_gemm_kernel, (nt * cdiv(F, p.block_n),),
            x, x.stride(0), wts_f, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.sk, gs.up, gb, gs.sbe, gs.sbn, gs.bup,
            h, h.stride(0), h, P, E, F, D, nt, D, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, ONE_DOT=p.one_dot, num_warps=p.num_warps,
            num_stages=p.num_stages, **meta)
        k_split = cdiv(cdiv(F, p.split_k), p.down_block_k) * p.down_block_k
        S = cdiv(F, k_split)
        y = torch.empty(S, P, D, dtype=x.dtype if p.y_half else torch.float32, device=x.device)  # [S, P, D]
        launch(grouped_gemm_kernel, (nt * cdiv(cdiv(D, p.down_block_n), p.down_nb), S),
            x, x.stride(0), wts_f, counts, sorted_pairs,
            w.down, ds.se, ds.sn, ds.sk, 0, db, ds.sbe, ds.sbn, 0,
            h, h.stride(0), y, P, E, D, F, nt, k_split, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, NB=p.down_nb, num_warps=p.down_warps,
            num_stages=p.down_stages, **meta)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        return _combine.combine(y, ids, out, E)

    return run


def _build_tma(block: MoEBlock, p: GemmParams, alpha: float, limit: float):
    E, D, F = block.E, block.D, block.F
    weight_descs: dict = {}  # the last weights' two descriptors (host objects), by pointer, shape and strides

    memo: dict = {}  # call_args' per-weights host work

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a = call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, wts_f = a.T, a.P, a.gs, a.ds, a.weights
        gu, dn = w.gate_up, w.down
        key = (gu.data_ptr(), dn.data_ptr(), gu.shape, dn.shape, gu.stride(), dn.stride(), gu.dtype)
        if key not in weight_descs:
            if gs.se != 2 * F * gs.sn or ds.se != D * ds.sn or gs.up != F * gs.sn:
                raise UnsupportedSchedule(f"grouped_gemm tma: expert weights gate_up {tuple(gu.stride())} / down "
                                          f"{tuple(dn.stride())} are not one [E·rows, cols] matrix each")
            weight_descs.clear()
            gu_desc = (_desc(gu, [2 * E, F, D], [gs.up, gs.sn, 1], [2, p.block_n, p.block_k]) if p.one_dot
                       else _desc(gu, [E * 2 * F, D], [gs.sn, 1], [p.block_n, p.block_k]))  # one_dot: gate 2e, up 2e+1
            weight_descs[key] = (gu_desc, _desc(dn, [E * D, F], [ds.sn, 1], [p.down_block_n, p.down_block_k]))
        gu_desc, dn_desc = weight_descs[key]
        counts, sorted_pairs = routing.route(ids, E)
        meta = {n: v for n, v in a.meta.items() if n != "K_TOP"}
        meta.update(BM=p.block_m, GROUP_M=p.group_m)
        nt = max_tiles(P, E, p.block_m)
        rows = max(P, 1)
        xs = routing.gather(x, counts, sorted_pairs, block.k, gu.dtype)  # [P, D] sorted token rows
        h = torch.empty(rows, F, dtype=gu.dtype, device=x.device)  # [P, F] sorted order
        grouped_gemm_tma_kernel[(nt * cdiv(F, p.block_n),)](  # descriptors: new objects each call
            _desc(xs, [rows, D], [D, 1], [p.block_m, p.block_k]), gu_desc,
            wts_f, counts, sorted_pairs, a.gate_up_bias, gs.sbe, gs.sbn, gs.bup,
            h, h, P, E, F, D, nt, D, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, ONE_DOT=p.one_dot, num_warps=p.num_warps,
            num_stages=p.num_stages, **meta)
        k_split = cdiv(cdiv(F, p.split_k), p.down_block_k) * p.down_block_k
        S = cdiv(F, k_split)
        y = torch.empty(S, P, D, dtype=x.dtype if p.y_half else torch.float32, device=x.device)  # [S, P, D]
        grouped_gemm_tma_kernel[(nt * cdiv(D, p.down_block_n), S)](
            _desc(h, [rows, F], [F, 1], [p.block_m, p.down_block_k]), dn_desc,
            wts_f, counts, sorted_pairs, a.down_bias, ds.sbe, ds.sbn, 0,
            h, y, P, E, D, F, nt, k_split, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, num_warps=p.down_warps, num_stages=p.down_stages,
            **meta)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        return _combine.combine(y, ids, out, E)

    return run


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): weights of each distinct expert once (L2 serves the other tiles), x, h, y."""
    params, distinct = schedule.params, uniform_distinct(block.E, block.k, tokens)
    wb = 2 if block.weight_dtype != "float32" else 4
    yb = wb if params.y_half else 4
    P = tokens * block.k
    tiles = P / params.block_m + distinct
    flops = 2.0 * 3 * tiles * params.block_m * block.D * block.F  # padded rows included
    by = (distinct * block.weight_bytes_per_expert + tokens * block.D * wb + 2 * P * block.F * wb
          + (2 * P * block.D * wb if params.tma else 0)  # the sorted copy xs: written, read
          + _combine.cost(params.split_k, P, tokens, block.D, wb, yb)[1] + params.split_k * P * block.D * yb
          + routing.cost(P, block.E)[1])
    return flops, by


KIND = KernelKind("grouped_gemm", GemmParams, space, default_params, build, cost, sources(__file__, SOURCES))
