"""Shared Triton jit helpers and host-side plumbing of the Triton backend.

Dimension letters (see moetune/ir/block.py): E experts, k top-k, D hidden, F intermediate, T tokens,
P = T·k (token, expert) pairs, m_e rows of expert e.  A "pair" p is the flat index t·k + j of ids [T, k].

Device-side work lists.  Every compute kernel finds its work from `counts [E]` (rows per expert) and
`sorted_pairs [P]` (pair indices grouped by expert, written by routing.py), or, when P is small, straight
from `ids` (`_fused_slot`: no routing kernel at all).  A program turns its id into (expert, rows) with a
prefix sum over E in registers, so no host ever sees the routing and every launch has a static grid:
programs past the real work exit after a few instructions.

Weights are read in place through strides (`GateUpStrides`, `DownStrides`): the standard layout
gate_up [E, 2F, D] / down [E, D, F], transposed [E, D, 2F] / [E, F, D], gate|up halves or interleaved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...ir import MoEBlock, UnsupportedSchedule
from ..common import ExpertTensors

H200_SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90 (opt-in maximum)
FUSED_ROUTE_MAX_PAIRS = 64  # P above this: the routing kernel groups the pairs instead of each program
ACT_CODES = {"swiglu": 0, "clamped_swiglu": 1}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ on the host (triton.cdiv is a constexpr function: slower to call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def check_pow2(owner: str, **fields: int) -> None:
    for name, v in fields.items():
        if not is_pow2(v):
            raise UnsupportedSchedule(f"{owner}.{name} = {v!r}: must be a power of two (Triton block size)")


def dot_smem_bytes(bm: int, bn: int, bk: int, stages: int, n_b: int, elem: int = 2) -> int:
    """Shared memory of a pipelined tl.dot loop: `stages` copies of the A tile and `n_b` B tiles."""
    return stages * (bm * bk + n_b * bk * bn) * elem


# ----------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class GateUpStrides:
    """Element strides of gate_up: gate row n, column k of expert e is at e·se + n·sn + k·sk;
    the up row n is `up` elements after the gate row n.  Bias: e·sbe + n·sbn, up at + bup."""

    se: int
    sn: int
    sk: int
    up: int
    sbe: int = 0
    sbn: int = 0
    bup: int = 0


@dataclass(frozen=True)
class DownStrides:
    """down row n (of D), column k (of F) of expert e at e·se + n·sn + k·sk; bias e·sbe + n·sbn."""

    se: int
    sn: int
    sk: int
    sbe: int = 0
    sbn: int = 0


def layout_strides(block: MoEBlock, w: ExpertTensors) -> tuple[GateUpStrides, DownStrides]:
    """Read the strides of the model's own tensors (views and non-contiguous tensors included)."""
    lay, F = block.layout, block.F
    gu, dn = w.gate_up, w.down
    if lay.transposed:  # gate_up [E, D, 2F], down [E, F, D]
        g_row, g_k = gu.stride(2), gu.stride(1)
        d_n, d_k = dn.stride(2), dn.stride(1)
    else:  # gate_up [E, 2F, D], down [E, D, F]
        g_row, g_k = gu.stride(1), gu.stride(2)
        d_n, d_k = dn.stride(1), dn.stride(2)
    g_n, g_up = (2 * g_row, g_row) if lay.interleaved else (g_row, F * g_row)
    sbe = sbn = bup = dbe = dbn = 0
    if lay.has_bias:
        b = w.gate_up_bias
        sbe, sbn, bup = b.stride(0), (2 if lay.interleaved else 1) * b.stride(1), (
            b.stride(1) if lay.interleaved else F * b.stride(1))
        dbe, dbn = w.down_bias.stride(0), w.down_bias.stride(1)
    return (GateUpStrides(gu.stride(0), g_n, g_k, g_up, sbe, sbn, bup),
            DownStrides(dn.stride(0), d_n, d_k, dbe, dbn))


def check_call(block: MoEBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """x [T, D] with a contiguous hidden dimension, ids and weights [T, k]; UnsupportedSchedule names the
    tensor and both shapes (the weights: `ExpertTensors.check`)."""
    if x.dim() != 2 or x.shape[1] != block.D:
        raise UnsupportedSchedule(f"x has shape {tuple(x.shape)}, block needs [T, {block.D}]")
    T = x.shape[0]
    if tuple(ids.shape) != (T, block.k) or tuple(weights.shape) != (T, block.k):
        raise UnsupportedSchedule(
            f"ids {tuple(ids.shape)} / weights {tuple(weights.shape)}: need [{T}, {block.k}]")
    if x.stride(1) != 1:
        raise UnsupportedSchedule(f"x stride {x.stride()}: the hidden dimension must be contiguous")


@dataclass(frozen=True)
class CallArgs:
    """What every launcher derives from one call: sizes, the weights' strides and bias pointers, the
    flat routing weights and the constexprs all kernels share (from `call_args`)."""

    T: int
    P: int
    gs: GateUpStrides
    ds: DownStrides
    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    weights: torch.Tensor  # [P]
    meta: dict


def call_args(block: MoEBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              w: ExpertTensors, memo: dict) -> CallArgs:
    """Check one call's shapes and gather the launch arguments every kernel needs.

    `memo` (one dict per built kernel) keeps what the weights' shapes, strides and dtypes and x's
    dtype decide (the weight shape check, strides, constexprs), keyed by exactly those: a call with
    the same weights skips that host work (bench/host_overhead.py). Tensors are never kept."""
    check_call(block, x, ids, weights)
    gu, dn, gb, db = w.gate_up, w.down, w.gate_up_bias, w.down_bias
    key = (x.dtype, gu.dtype, gu.shape, gu.stride(), dn.dtype, dn.shape, dn.stride(),
           None if gb is None else (gb.shape, gb.stride()), None if db is None else (db.shape, db.stride()))
    hit = memo.get(key)
    if hit is None:
        w.check(block)
        gs, ds = layout_strides(block, w)
        hit = gs, ds, dict(K_TOP=block.k, BLOCK_E=max(16, next_pow2(block.E)), **consts(block, x, w))
        if len(memo) >= 16:  # weights swapped many times over: start afresh
            memo.clear()
        memo[key] = hit
    gs, ds, meta = hit
    T = x.shape[0]
    gb, db = bias_args(block, w)
    return CallArgs(T, T * block.k, gs, ds, gb, db, weights.reshape(-1), meta)


def act_args(block: MoEBlock) -> tuple[float, float]:
    """(alpha, limit) of the activation as kernel scalars (0 where it has none)."""
    act = block.activation
    return float(act.alpha or 0.0), float(act.limit or 0.0)


def bias_args(block: MoEBlock, w: ExpertTensors):
    """(gate_up bias, down bias) pointers; the weights themselves stand in when there is no bias."""
    if block.layout.has_bias:
        return w.gate_up_bias, w.down_bias
    return w.gate_up, w.down


def consts(block: MoEBlock, x: torch.Tensor, w: ExpertTensors) -> dict:
    """Constexprs every kernel shares; UPCAST: bf16 tl.dot is wrong when interpreted, so upcast there."""
    bf16 = torch.bfloat16 in (x.dtype, w.gate_up.dtype, w.down.dtype)
    return dict(ACT=ACT_CODES[block.activation.kind], HAS_BIAS=block.layout.has_bias,
                W_IN=block.weight_application == "input", UPCAST=interpreting() and bf16)


# ------------------------------------------------------------------------------------ jit helpers


@triton.jit
def _act(g, u, ACT: tl.constexpr, alpha, limit):
    """h = act(g, u) in fp32 (ACT 0: silu(g)·u; 1: GPT-OSS clamped swiglu)."""
    if ACT == 0:
        h = g * tl.sigmoid(g) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = (u + 1.0) * g * tl.sigmoid(g * alpha)
    return h


@triton.jit
def _find_slot(counts_ptr, E, slot, R, LIGHT_ONLY: tl.constexpr, BLOCK_E: tl.constexpr):
    """The slot-th active expert (m_e ≥ 1; with LIGHT_ONLY also m_e < R): (e, first sorted row, m_e).
    m_e = 0 when there is no such slot."""
    ei = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + ei, mask=ei < E, other=0)  # [BLOCK_E]
    start = tl.cumsum(cnt, axis=0) - cnt
    act = cnt > 0
    if LIGHT_ONLY:
        act = act & (cnt < R)
    aend = tl.cumsum(act.to(tl.int32), axis=0)
    e = tl.sum((aend <= slot).to(tl.int32), axis=0)
    sel = (ei == e) & act
    m = tl.sum(tl.where(sel, cnt, 0), axis=0)
    st = tl.sum(tl.where(sel, start, 0), axis=0)
    return e, st, m


@triton.jit
def _find_tile(counts_ptr, E, tile, BM: tl.constexpr, R, HEAVY_ONLY: tl.constexpr, BLOCK_E: tl.constexpr):
    """The tile-th BM-row tile over expert-sorted rows (experts with m_e ≥ R when HEAVY_ONLY):
    (e, first sorted row of the tile, rows left from there: ≤ 0 when the tile does not exist)."""
    ei = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + ei, mask=ei < E, other=0)  # [BLOCK_E]
    start = tl.cumsum(cnt, axis=0) - cnt
    nt = (cnt + BM - 1) // BM
    if HEAVY_ONLY:
        nt = tl.where(cnt >= R, nt, 0)
    tend = tl.cumsum(nt, axis=0)
    e = tl.sum((tend <= tile).to(tl.int32), axis=0)
    sel = ei == e
    m = tl.sum(tl.where(sel, cnt, 0), axis=0)
    st = tl.sum(tl.where(sel, start, 0), axis=0)
    t0 = tl.sum(tl.where(sel, tend - nt, 0), axis=0)
    local = tile - t0
    return e, st + local * BM, m - local * BM


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
def _fused_pairs(match, mrank, c, ROWS: tl.constexpr, BP: tl.constexpr):
    """Pair indices [ROWS] of matches c .. c+ROWS-1 (0 where past the end)."""
    offs = tl.arange(0, BP)
    r = tl.arange(0, ROWS)
    hit = match[None, :] & (mrank[None, :] == (c + r)[:, None])  # [ROWS, BP]
    return tl.sum(tl.where(hit, offs[None, :], 0), axis=1)


@triton.jit
def _row_gate_up(x_ptr, s_xt, tok, w_e, sn, sk, up, n0, N, K,
                 BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """One row: (gate [BN], up [BN]) = W[n0:n0+BN] · x[tok], fp32; FMA into [BN, BK], one final sum.
    The K loop is software-pipelined (cp.async into shared memory, STAGES deep): the bytes in flight
    cost no registers, so many programs per SM keep HBM busy."""
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    accg = tl.zeros([BN, BK], dtype=tl.float32)
    accu = tl.zeros([BN, BK], dtype=tl.float32)
    wrow = w_e + offs_n[:, None] * sn  # [BN, 1]
    xrow = x_ptr + tok.to(tl.int64) * s_xt
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        m2 = nm[:, None] & km[None, :]
        xv = tl.load(xrow + offs_k, mask=km, other=0.0).to(tl.float32)[None, :]  # [1, BK]
        # [BN, BK]
        wg = tl.load(wrow + offs_k[None, :] * sk, mask=m2, other=0.0, eviction_policy="evict_first")
        wu = tl.load(wrow + offs_k[None, :] * sk + up, mask=m2, other=0.0, eviction_policy="evict_first")
        accg += wg.to(tl.float32) * xv
        accu += wu.to(tl.float32) * xv
    return tl.sum(accg, axis=1), tl.sum(accu, axis=1)


@triton.jit
def _row_down(h_row, w_e, sn, sk, n0, N, k_lo, k_hi, BN: tl.constexpr, BK: tl.constexpr,
              STAGES: tl.constexpr):
    """One row: y [BN] = W[n0:n0+BN, k_lo:k_hi] · h[k_lo:k_hi], fp32 (pipelined K loop)."""
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    wrow = w_e + offs_n[:, None] * sn
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < k_hi
        hv = tl.load(h_row + offs_k, mask=km, other=0.0).to(tl.float32)  # [BK]
        wv = tl.load(wrow + offs_k[None, :] * sk, mask=nm[:, None] & km[None, :], other=0.0,
                     eviction_policy="evict_first")  # [BN, BK]
        acc += wv.to(tl.float32) * hv[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _rows_gate_up(x_ptr, s_xt, toks, rmask, w_e, sn, sk, up, n0, N, K,
                  RP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """RP rows of one expert from one read of each weight chunk: (gate, up) [RP, BN] fp32 (FMA)."""
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    accg = tl.zeros([RP, BN, BK], dtype=tl.float32)
    accu = tl.zeros([RP, BN, BK], dtype=tl.float32)
    wrow = w_e + offs_n[:, None] * sn  # [BN, 1]
    xrow = x_ptr + toks.to(tl.int64)[:, None] * s_xt  # [RP, 1]
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        xv = tl.load(xrow + offs_k[None, :], mask=rmask[:, None] & km[None, :], other=0.0).to(tl.float32)
        m2 = nm[:, None] & km[None, :]
        wg = tl.load(wrow + offs_k[None, :] * sk, mask=m2, other=0.0, eviction_policy="evict_first")
        wu = tl.load(wrow + offs_k[None, :] * sk + up, mask=m2, other=0.0, eviction_policy="evict_first")
        accg += wg.to(tl.float32)[None, :, :] * xv[:, None, :]
        accu += wu.to(tl.float32)[None, :, :] * xv[:, None, :]
    return tl.sum(accg, axis=2), tl.sum(accu, axis=2)


@triton.jit
def _rows_down(h_ptr, s_hp, pairs, rmask, w_e, sn, sk, n0, N, k_lo, k_hi,
               RP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """RP rows of one expert from one read of each down chunk: y [RP, BN] fp32 (FMA)."""
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    acc = tl.zeros([RP, BN, BK], dtype=tl.float32)
    wrow = w_e + offs_n[:, None] * sn
    hrow = h_ptr + pairs.to(tl.int64)[:, None] * s_hp  # [RP, 1]
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < k_hi
        hv = tl.load(hrow + offs_k[None, :], mask=rmask[:, None] & km[None, :], other=0.0).to(tl.float32)
        wv = tl.load(wrow + offs_k[None, :] * sk, mask=nm[:, None] & km[None, :], other=0.0,
                     eviction_policy="evict_first")
        acc += wv.to(tl.float32)[None, :, :] * hv[:, None, :]
    return tl.sum(acc, axis=2)


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


@triton.jit
def _tile_gate_up(x_ptr, s_xt, tok, rmask, w_e, sn, sk, up, n0, N, K, k_end,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr,
                  ONE_DOT: tl.constexpr):
    """BM rows with tl.dot: (gate [BM, BN], up [BM, BN]) fp32. k_end = 0 skips the loop.
    ONE_DOT: one tl.dot per K step on a B tile [BK, 2·BN] that interleaves gate row n0 + c (column 2c)
    and up row n0 + c (column 2c + 1), so the tensor cores see one N = 2·BN product; the accumulator
    [BM, 2·BN] is split back into (gate, up) once, after the loop. Otherwise two N = BN dots."""
    arow = x_ptr + tok.to(tl.int64)[:, None] * s_xt  # [BM, 1]
    if ONE_DOT:
        c = tl.arange(0, 2 * BN)
        rown = n0 + c // 2
        colm = rown < N
        bcol = w_e + rown[None, :] * sn + (c % 2)[None, :] * up  # [1, 2BN]
        acc = tl.zeros([BM, 2 * BN], dtype=tl.float32)
        for k0 in range(0, k_end, BK):
            acc = _dot_step(arow, bcol, sk, k0, K, rmask, colm, acc, BK, UPCAST)  # B [BK, 2BN]
        accg, accu = tl.split(tl.reshape(acc, [BM, BN, 2]))
    else:
        offs_n = n0 + tl.arange(0, BN)
        nm = offs_n < N
        accg = tl.zeros([BM, BN], dtype=tl.float32)
        accu = tl.zeros([BM, BN], dtype=tl.float32)
        bcol = w_e + offs_n[None, :] * sn  # [1, BN]
        for k0 in range(0, k_end, BK):
            offs_k = k0 + tl.arange(0, BK)
            km = offs_k < K
            a = tl.load(arow + offs_k[None, :], mask=rmask[:, None] & km[None, :], other=0.0)  # [BM, BK]
            bp = bcol + offs_k[:, None] * sk  # [BK, BN]
            bm2 = km[:, None] & nm[None, :]
            bg = tl.load(bp, mask=bm2, other=0.0)
            bu = tl.load(bp + up, mask=bm2, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                bg = bg.to(tl.float32)
                bu = bu.to(tl.float32)
            else:
                a = a.to(bg.dtype)
            accg = tl.dot(a, bg, accg)
            accu = tl.dot(a, bu, accu)
    return accg, accu


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
def _tile_down(h_ptr, s_hp, pairs, rmask, w_e, sn, sk, n0, N, k_lo, k_hi,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """BM rows with tl.dot: y [BM, BN] = h[pairs, k_lo:k_hi] · W[n0:n0+BN, k_lo:k_hi]ᵀ, fp32."""
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    arow = h_ptr + pairs.to(tl.int64)[:, None] * s_hp
    bcol = w_e + offs_n[None, :] * sn
    for k0 in range(k_lo, k_hi, BK):
        acc = _dot_step(arow, bcol, sk, k0, k_hi, rmask, nm, acc, BK, UPCAST)
    return acc


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
        b = i // nk
        k0 = k_lo + (i - b * nk) * BK
        n0 = n_first + b * BN
        offs_n = n0 + tl.arange(0, BN)
        acc = _dot_step(arow, w_e + offs_n[None, :] * sn, sk, k0, k_hi, rmask, offs_n < N, acc, BK, UPCAST)
        if k0 + BK >= k_hi:  # block b complete
            _store_y(y_ptr, pairs, rmask, acc, wt, b_e, sbn, first_split, n0, N, BN, HAS_BIAS, W_IN)
            acc = tl.zeros([BM, BN], dtype=tl.float32)


@triton.jit
def _dot_step(arow, bcol, sk, k0, k_hi, rmask, cmask, acc, BK: tl.constexpr, UPCAST: tl.constexpr):
    """One K step of a tile: acc += A[rows, k0:k0+BK] · B[k0:k0+BK, cols] (A rows at arow [R, 1], B columns
    at bcol [1, C] with K stride sk; reduction index < k_hi, rows in rmask, columns in cmask)."""
    offs_k = k0 + tl.arange(0, BK)
    km = offs_k < k_hi
    a = tl.load(arow + offs_k[None, :], mask=rmask[:, None] & km[None, :], other=0.0)  # [R, BK]
    b = tl.load(bcol + offs_k[:, None] * sk, mask=km[:, None] & cmask[None, :], other=0.0)  # [BK, C]
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    else:
        a = a.to(b.dtype)
    return tl.dot(a, b, acc)


@triton.jit
def _store_h(h_ptr, s_hp, pairs, rmask, g, u, wt, b_e, sbn, bup, n0, N, alpha, limit,
             BN: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr):
    """Gate/up epilogue on [R, BN] accumulators: (weight on the input) + bias → act → h[pairs, n]."""
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    if W_IN:
        g = g * wt[:, None]
        u = u * wt[:, None]
    if HAS_BIAS:
        bg = tl.load(b_e + offs_n * sbn, mask=nm, other=0.0).to(tl.float32)
        bu = tl.load(b_e + offs_n * sbn + bup, mask=nm, other=0.0).to(tl.float32)
        g = g + bg[None, :]
        u = u + bu[None, :]
    h = _act(g, u, ACT, alpha, limit)
    hp = h_ptr + pairs.to(tl.int64)[:, None] * s_hp + offs_n[None, :]
    tl.store(hp, h.to(h_ptr.dtype.element_ty), mask=rmask[:, None] & nm[None, :])


@triton.jit
def _store_y(y_ptr, pairs, rmask, acc, wt, b_e, sbn, first_split, n0, N,
             BN: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr):
    """Down epilogue on [R, BN]: (+ bias on the first K split) · routing weight → y[pairs, n] fp32."""
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    if HAS_BIAS:
        b = tl.load(b_e + offs_n * sbn, mask=nm, other=0.0).to(tl.float32)
        acc = acc + b[None, :] * first_split
    if not W_IN:
        acc = acc * wt[:, None]
    yp = y_ptr + pairs.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(yp, acc, mask=rmask[:, None] & nm[None, :])
