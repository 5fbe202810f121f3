"""stream_gemv: every selected expert's weights streamed from HBM once; no padding rows to a tile.

One kernel, three projections (PROJ):
  0 gate/up   grid (slot, F-block): slot s = s-th distinct selected expert; its rows are served from one
              read of each [BN, BK] weight tile (ROWS = 1: FMA per row; ROWS ≥ 16: rows in passes of
              ROWS through tl.dot, one weight read per pass); SwiGLU fused; h [P, F] in x.dtype.
  1 down      grid (slot, D-block, K split): fp32 partial rows y [S, P, D] · routing weight, then
              combine.py sums splits and the k experts of each token (deterministic).
  2 down      grid (token, D-block): loops over the token's k experts and writes out [T, D] directly,
              one launch, no combine; an expert shared by several tokens is re-read per token. With
              down_nb > 1 a program walks that many D-blocks in one flattened pipelined loop.
Work comes from `counts`/`sorted_pairs` (routing.py) or, with `fused_route` and P ≤ 64, from the ids
themselves (`_fused_slot`): then the whole block is two launches (gate/up, down token).
All (token, expert) pairs of a projection run in one launch; the grid is static (min(P, E) slots).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import triton
import triton.language as tl

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
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
from .layout import act_args, call_args, cdiv, check_pow2, check_smem, dot_smem_bytes, flat_pairs, next_pow2
from .tiles import tiles

SOURCES = ("stream_gemv.py", "tiles.py", "_common.py", "layout.py", "routing.py", "combine.py", "launch.py")
FUSED_ROUTE_MAX_PAIRS = 64  # P above this: the routing kernel groups the pairs instead of each program


@dataclass(frozen=True)
class GemvParams:
    block_n: int = 8  # gate/up output rows (of F) per program
    block_k: int = 256  # reduction chunk along D
    rows: int = 1  # rows of one expert per weight read: 1..8 FMA (3-D for > 1), ≥ 16 a tl.dot pass
    num_warps: int = 4
    num_stages: int = 4  # depth of the cp.async pipeline of every K loop
    down_block_n: int = 4  # down output rows (of D) per program (token mode: × next_pow2(k) streams)
    down_block_k: int = 128  # reduction chunk along F
    down_warps: int = 4
    down_mode: Literal["token", "expert"] = "token"
    split_k: int = 1  # down, expert mode: F split in this many fp32 partials
    fused_route: bool = True  # P ≤ 64: each program groups the ids itself (no routing kernel)
    # token-mode down: D-blocks per program, walked in one flattened pipelined loop (the next block's chunks
    # load while the current one ends; the ids, weights and addresses are set up once for all of them)
    down_nb: int = 1

    def __post_init__(self) -> None:
        check_pow2("GemvParams", block_n=self.block_n, block_k=self.block_k, rows=self.rows,
                   down_block_n=self.down_block_n, down_block_k=self.down_block_k,
                   num_warps=self.num_warps, down_warps=self.down_warps)
        if self.down_mode not in ("token", "expert"):
            raise UnsupportedSchedule(f"GemvParams.down_mode = {self.down_mode!r}: 'token' or 'expert'")
        if self.down_nb not in (1, 2, 4, 8) or (self.down_nb > 1 and self.down_mode != "token"):
            raise UnsupportedSchedule(f"GemvParams.down_nb = {self.down_nb}: 1, 2, 4 or 8, and > 1 only with "
                                      "down_mode='token'")
        if self.split_k < 1 or (self.split_k > 1 and self.down_mode != "expert"):
            raise UnsupportedSchedule(f"GemvParams.split_k = {self.split_k}: ≥ 1, and > 1 only with "
                                      "down_mode='expert' (the token mode has no partials to combine)")
        regs = min(self.rows, 8) * self.block_n * self.block_k * 2 // (32 * self.num_warps)
        if self.rows < 16 and regs > 128:
            raise UnsupportedSchedule(
                f"GemvParams block_n={self.block_n} block_k={self.block_k} num_warps={self.num_warps}: "
                f"{regs} fp32 accumulator registers per thread, limit 128; lower block_k or raise num_warps")


def check(p: GemvParams, target: Target) -> None:
    """What `target` cannot run: the 16-row tl.dot pass's pipeline over the shared memory of one block."""
    if p.rows >= 16:
        check_smem(f"GemvParams rows={p.rows} block_n={p.block_n} block_k={p.block_k} num_stages={p.num_stages}",
                   dot_smem_bytes(p.rows, p.block_n, p.block_k, p.num_stages, 2), target,
                   "lower block_k or num_stages")


# holds every default of `default_params` (tests/codegen/test_contract.py): 64-wide tiles for the 16-row dot
# pass, down_block_n 2 for the token-mode down at k > 8
CHOICES = (
    ("block_n", (4, 8, 16, 32, 64)),
    ("block_k", (128, 256, 512, 1024)),
    ("rows", (1, 2, 4, 16)),
    ("num_warps", (4, 8)),
    ("num_stages", (2, 3, 4)),
    ("down_block_n", (2, 4, 8, 16, 32, 64)),
    ("down_block_k", (128, 256, 512)),
    ("down_warps", (4, 8)),
    ("down_mode", ("token", "expert")),
    ("split_k", (1, 2, 4)),
    ("fused_route", (True, False)),
    ("down_nb", (1, 2, 4)),
)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(GemvParams, CHOICES, check=partial(check, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> GemvParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(GemvParams, tiles("stream_gemv", block, T, target, constraints))


@triton.jit
def _fused_slot(ids_ptr, P, E, slot, BP: tl.constexpr):
    """Without a routing kernel (P ≤ BP): the slot-th distinct expert in order of first appearance.
    Returns (e, m_e, match [BP] pairs of e, rank [BP] of each match among them)."""
    offs = tl.arange(0, BP)
    idv = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)  # [BP]
    valid = (idv >= 0) & (idv < E)
    earlier = (idv[:, None] == idv[None, :]) & (offs[None, :] < offs[:, None])  # [BP, BP]
    first = valid & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    rank = tl.cumsum(first.to(tl.int32), axis=0) - 1
    sel = first & (rank == slot)
    found = tl.sum(sel.to(tl.int32), axis=0)
    e = tl.sum(tl.where(sel, idv, 0), axis=0)
    match = valid & (idv == e) & (found > 0)
    mrank = tl.cumsum(match.to(tl.int32), axis=0) - 1
    m = tl.sum(match.to(tl.int32), axis=0)
    return e, m, match, mrank


@triton.jit
def _slot_work(ids_ptr, counts_ptr, P, E, slot, FUSED: tl.constexpr, BP: tl.constexpr, BLOCK_E: tl.constexpr):
    """The slot-th active expert's work, from the ids themselves (FUSED: `_fused_slot`) or from routing.py's
    counts (`_find_slot`): (expert as an int64 index, 0 for an empty slot; its first sorted row; m_e; and with
    FUSED the match and rank vectors that `_slot_pairs` reads, else 0)."""
    if FUSED:
        e, m, match, mrank = _fused_slot(ids_ptr, P, E, slot, BP)
        st = 0
    else:
        e, st, m = _find_slot(counts_ptr, E, slot, 0, False, BLOCK_E)
        match = 0
        mrank = 0
    return tl.where(m > 0, e, 0).to(tl.int64), st, m, match, mrank


@triton.jit
def _slot_pairs(sorted_ptr, st, match, mrank, c, rmask, FUSED: tl.constexpr, ROWS: tl.constexpr,
                BP: tl.constexpr):
    """Pair indices [ROWS] of the slot's rows c .. c+ROWS-1 (0 past its last; `_slot_work`)."""
    if FUSED:
        pairs = _fused_pairs(match, mrank, c, ROWS, BP)
    else:
        pairs = tl.load(sorted_ptr + st + c + tl.arange(0, ROWS), mask=rmask, other=0)
    return pairs


@triton.jit
def _fused_pairs(match, mrank, c, ROWS: tl.constexpr, BP: tl.constexpr):
    """Pair indices [ROWS] of matches c .. c+ROWS-1 (0 where past the end)."""
    offs = tl.arange(0, BP)
    r = tl.arange(0, ROWS)
    hit = match[None, :] & (mrank[None, :] == (c + r)[:, None])  # [ROWS, BP]
    return tl.sum(tl.where(hit, offs[None, :], 0), axis=1)


@triton.jit
def _token_pairs(ids_ptr, wts_ptr, t, E, K_TOP: tl.constexpr, KP: tl.constexpr):
    """Token t's k pairs as [KP] vectors: (pair index, valid, expert id (0 where not), routing weight)."""
    jk = tl.arange(0, KP)
    jm = jk < K_TOP
    p = t * K_TOP + jk  # [KP]
    e = tl.load(ids_ptr + p, mask=jm, other=-1).to(tl.int32)
    ok = jm & (e >= 0) & (e < E)
    ec = tl.where(ok, e, 0).to(tl.int64)
    wt = tl.load(wts_ptr + p, mask=ok, other=0.0).to(tl.float32)  # [KP]
    return p, ok, ec, wt


@triton.jit
def _token_rows(acc, ok, ec, wt, b_ptr, sbe, sbn, offs_n, nm, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr):
    """A token's [KP, BN, BK] products summed over K (+ bias) · routing weight: [KP, BN], one row per pair
    (their sum over the pairs is the token's output block)."""
    y = tl.sum(acc, axis=2)  # [KP, BN]
    if HAS_BIAS:
        b = tl.load(b_ptr + ec[:, None] * sbe + offs_n[None, :] * sbn, mask=ok[:, None] & nm[None, :],
                    other=0.0).to(tl.float32)
        y += b
    if not W_IN:
        y = y * wt[:, None]
    return y


@triton.jit
def _token_down(h_ptr, s_hp, ids_ptr, wts_ptr, t, E, w_ptr, se, sn, sk, b_ptr, sbe, sbn, n0, N, K,
                K_TOP: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, STAGES: tl.constexpr):
    """out[t, n0:n0+BN] = Σ_j w_tj · down[e_tj] · h[t·k + j]: all k experts of the token in one
    [KP, BN, BK] tile per K chunk (k weight streams in flight at once), pipelined K loop."""
    p, ok, ec, wt = _token_pairs(ids_ptr, wts_ptr, t, E, K_TOP, KP)
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    wbase = w_ptr + ec[:, None, None] * se + offs_n[None, :, None] * sn  # [KP, BN, 1]
    hbase = h_ptr + p.to(tl.int64)[:, None] * s_hp  # [KP, 1]
    m3 = ok[:, None, None] & nm[None, :, None]
    acc = tl.zeros([KP, BN, BK], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        hv = tl.load(hbase + offs_k[None, :], mask=ok[:, None] & km[None, :], other=0.0)  # [KP, BK]
        wv = tl.load(wbase + offs_k[None, None, :] * sk, mask=m3 & km[None, None, :], other=0.0,
                     eviction_policy="evict_first")  # [KP, BN, BK]
        acc += wv.to(tl.float32) * hv.to(tl.float32)[:, None, :]
    return tl.sum(_token_rows(acc, ok, ec, wt, b_ptr, sbe, sbn, offs_n, nm, HAS_BIAS, W_IN), axis=0)


@triton.jit
def _token_down_nb(h_ptr, s_hp, ids_ptr, wts_ptr, t, E, w_ptr, se, sn, sk, b_ptr, sbe, sbn, n_first, N, K,
                   y_row, K_TOP: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   NB: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, STAGES: tl.constexpr):
    """_token_down over NB consecutive D-blocks [n_first + b·BN, +BN) of one token in ONE pipelined loop
    (b, K chunk) flattened: the next block's first weight chunks are in flight while the current block
    finishes, and the program's set-up (ids, weights, addresses) is paid once for NB blocks. Each block's
    out[t, n0:n0+BN] is stored when its last K chunk is in."""
    p, ok, ec, wt = _token_pairs(ids_ptr, wts_ptr, t, E, K_TOP, KP)
    wbase = w_ptr + ec[:, None, None] * se  # [KP, 1, 1]
    hbase = h_ptr + p.to(tl.int64)[:, None] * s_hp  # [KP, 1]
    nk = tl.cdiv(K, BK)
    nb = tl.minimum(NB, tl.cdiv(N - n_first, BN))  # blocks of this program inside [0, N)
    acc = tl.zeros([KP, BN, BK], dtype=tl.float32)
    for i in tl.range(0, nb * nk, num_stages=STAGES):
        b = i // nk
        k0 = (i - b * nk) * BK
        offs_n = n_first + b * BN + tl.arange(0, BN)
        nm = offs_n < N
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        hv = tl.load(hbase + offs_k[None, :], mask=ok[:, None] & km[None, :], other=0.0)  # [KP, BK]
        wv = tl.load(wbase + offs_n[None, :, None] * sn + offs_k[None, None, :] * sk,
                     mask=ok[:, None, None] & nm[None, :, None] & km[None, None, :], other=0.0,
                     eviction_policy="evict_first")  # [KP, BN, BK]
        acc += wv.to(tl.float32) * hv.to(tl.float32)[:, None, :]
        if k0 + BK >= K:  # block b complete
            y = _token_rows(acc, ok, ec, wt, b_ptr, sbe, sbn, offs_n, nm, HAS_BIAS, W_IN)
            tl.store(y_row + offs_n, tl.sum(y, axis=0).to(y_row.dtype.element_ty), mask=nm)
            acc = tl.zeros([KP, BN, BK], dtype=tl.float32)


@triton.jit(do_not_specialize=["P"])
def stream_gemv_kernel(
    x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr,
    w_ptr, se, sn, sk, up, b_ptr, sbe, sbn, bup,
    h_ptr, s_hp, y_ptr, s_yt,
    P, E, N, K, k_split, alpha, limit,
    PROJ: tl.constexpr, K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BP: tl.constexpr,
    FUSED: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    STAGES: tl.constexpr, NB: tl.constexpr = 1,
):
    n0 = tl.program_id(1) * BN
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    if PROJ == 2 and NB > 1:
        t = tl.program_id(0)
        _token_down_nb(h_ptr, s_hp, ids_ptr, wts_ptr, t, E, w_ptr, se, sn, sk, b_ptr, sbe, sbn, n0 * NB, N, K,
                       y_ptr + t.to(tl.int64) * s_yt, K_TOP, KP, BN, BK, NB, HAS_BIAS, W_IN, STAGES)
    elif PROJ == 2:
        t = tl.program_id(0)
        out = _token_down(h_ptr, s_hp, ids_ptr, wts_ptr, t, E, w_ptr, se, sn, sk, b_ptr, sbe, sbn, n0, N, K,
                          K_TOP, KP, BN, BK, HAS_BIAS, W_IN, STAGES)
        tl.store(y_ptr + t.to(tl.int64) * s_yt + offs_n, out.to(y_ptr.dtype.element_ty), mask=nm)
    else:
        slot = tl.program_id(0)
        ks = tl.program_id(2)
        ec, st, m, match, mrank = _slot_work(ids_ptr, counts_ptr, P, E, slot, FUSED, BP, BLOCK_E)
        w_e = w_ptr + ec * se
        b_e = b_ptr + ec * sbe
        k_lo = ks * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        r = tl.arange(0, ROWS)
        for c in range(0, m, ROWS):
            rmask = c + r < m
            pairs = _slot_pairs(sorted_ptr, st, match, mrank, c, rmask, FUSED, ROWS, BP)
            wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [ROWS]
            if ROWS == 1:
                pair = tl.sum(pairs, axis=0)
                if PROJ == 0:
                    g1, u1 = _row_gate_up(x_ptr, s_xt, pair // K_TOP, w_e, sn, sk, up, n0, N, K,
                                          BN, BK, STAGES)
                    g = g1[None, :]
                    u = u1[None, :]
                else:
                    acc = _row_down(h_ptr + pair.to(tl.int64) * s_hp, w_e, sn, sk, n0, N, k_lo, k_hi,
                                    BN, BK, STAGES)[None, :]
            elif ROWS < 16:
                if PROJ == 0:
                    g, u = _rows_gate_up(x_ptr, s_xt, pairs // K_TOP, rmask, w_e, sn, sk, up, n0, N, K,
                                         ROWS, BN, BK, STAGES)
                else:
                    acc = _rows_down(h_ptr, s_hp, pairs, rmask, w_e, sn, sk, n0, N, k_lo, k_hi,
                                     ROWS, BN, BK, STAGES)
            else:
                if PROJ == 0:
                    g, u = _tile_gate_up(x_ptr, s_xt, pairs // K_TOP, rmask, w_e, sn, sk, up, n0, N, K, K,
                                         ROWS, BN, BK, UPCAST, False)
                else:
                    acc = _tile_down(h_ptr, s_hp, pairs, rmask, w_e, sn, sk, n0, N, k_lo, k_hi,
                                     ROWS, BN, BK, UPCAST)
            if PROJ == 0:
                _store_h(h_ptr, s_hp, pairs, rmask, g, u, wt, b_e, sbn, bup, n0, N,
                         alpha, limit, BN, ACT, HAS_BIAS, W_IN)
            else:
                _store_y(y_ptr + ks.to(tl.int64) * P * N, pairs, rmask, acc, wt, b_e, sbn,
                         (ks == 0).to(tl.float32), n0, N, BN, HAS_BIAS, W_IN)


def build(block: MoEBlock, schedule: Schedule):
    """ExpertsFn of a stream_gemv schedule (params: GemvParams)."""
    p = schedule.params
    E, k, D, F = block.E, block.k, block.D, block.F
    alpha, limit = act_args(block)

    memo: dict = {}  # call_args' per-weights host work

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a = call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, gb, db, wts_f = a.T, a.P, a.gs, a.ds, a.gate_up_bias, a.down_bias, a.weights
        ids_f = flat_pairs(ids)  # [P]
        fused = p.fused_route and P <= FUSED_ROUTE_MAX_PAIRS
        if fused:
            counts, sorted_pairs = ids_f, ids_f
        else:
            counts, sorted_pairs = routing.route(ids, E)
        meta = dict(a.meta, KP=next_pow2(k), BP=max(16, next_pow2(P)), FUSED=fused, ROWS=p.rows)
        slots = min(P, E)
        h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
        launch(stream_gemv_kernel, (slots, cdiv(F, p.block_n), 1),
            x, x.stride(0), ids_f, wts_f, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.sk, gs.up, gb, gs.sbe, gs.sbn, gs.bup,
            h, h.stride(0), h, 0, P, E, F, D, D, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, num_warps=p.num_warps, num_stages=p.num_stages,
            STAGES=p.num_stages, **meta)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        if p.down_mode == "token":
            launch(stream_gemv_kernel, (T, cdiv(cdiv(D, p.down_block_n), p.down_nb), 1),
                x, x.stride(0), ids_f, wts_f, counts, sorted_pairs,
                w.down, ds.se, ds.sn, ds.sk, 0, db, ds.sbe, ds.sbn, 0,
                h, h.stride(0), out, out.stride(0), P, E, D, F, F, alpha, limit,
                PROJ=2, BN=p.down_block_n, BK=p.down_block_k, NB=p.down_nb, num_warps=p.down_warps,
                num_stages=p.num_stages, STAGES=p.num_stages, **meta)
            return out
        k_split = cdiv(cdiv(F, p.split_k), p.down_block_k) * p.down_block_k
        S = cdiv(F, k_split)
        y = torch.empty(S, P, D, dtype=torch.float32, device=x.device)  # [S, P, D]
        launch(stream_gemv_kernel, (slots, cdiv(D, p.down_block_n), S),
            x, x.stride(0), ids_f, wts_f, counts, sorted_pairs,
            w.down, ds.se, ds.sn, ds.sk, 0, db, ds.sbe, ds.sbn, 0,
            h, h.stride(0), y, 0, P, E, D, F, k_split, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, num_warps=p.down_warps,
            num_stages=p.num_stages, STAGES=p.num_stages, **meta)
        return _combine.combine(y, ids, out, E)

    return run


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): each distinct expert's weights once, x and h traffic, y partials and combine."""
    params, distinct = schedule.params, uniform_distinct(block.E, block.k, tokens)
    wb = 2 if block.weight_dtype != "float32" else 4
    P = tokens * block.k
    flops = 2.0 * 3 * P * block.D * block.F
    by = distinct * block.weight_bytes_per_expert + tokens * block.D * wb * 2 + 2 * P * block.F * wb
    if params.down_mode == "expert":
        by += _combine.cost(params.split_k, P, tokens, block.D, wb)[1] + params.split_k * P * block.D * 4
    if not (params.fused_route and P <= FUSED_ROUTE_MAX_PAIRS):
        by += routing.cost(P, block.E)[1]
    return flops, by


KIND = KernelKind("stream_gemv", GemvParams, space, default_params, build, cost, sources(__file__, SOURCES))
