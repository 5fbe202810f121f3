"""Triton jit helpers shared by the kernel files (stream_gemv.py, grouped_gemm.py, hybrid.py).

Dimension letters (see moetune/ir/block.py): E experts, k top-k, D hidden, F intermediate, T tokens,
P = T·k (token, expert) pairs, m_e rows of expert e.  A "pair" p is the flat index t·k + j of ids [T, k].

Device-side work lists.  Every compute kernel finds its work from `counts [E]` (rows per expert) and
`sorted_pairs [P]` (pair indices grouped by expert, written by routing.py), or, when P is small, straight
from `ids` (stream_gemv's `_fused_slot`: no routing kernel at all).  A program turns its id into
(expert, rows) with a prefix sum over E in registers (`_find_slot`, `_find_tile`), so no host ever sees
the routing and every launch has a static grid: programs past the real work exit after a few instructions.

Row helpers: `_row_*` one row per weight read (FMA), `_rows_*` RP rows of one expert per weight read (FMA),
`_tile_*` BM rows through tl.dot; `_store_h` / `_store_y` the gate/up and down epilogues.

Programmatic dependent launch (sm_90; a kernel launched with Triton's `launch_pdl`): such a kernel may start
while the one before it on the stream is still running. `_grid_wait` holds it until that kernel has finished
and its writes are visible, so nothing it reads from the kernel before may be read ahead of it; what it
reads of the block's inputs (ids, weights) may be. `_grid_release` lets the kernel after this one start
(else it starts when this one ends). A kernel released before its own wait may still be waiting for the one
before it, so the kernel after it may read ahead of its wait only the block's inputs; what an earlier
kernel wrote only when every kernel between released after its wait. `_prefetch_l2` asks L2 for lines it
will read after the wait.

A chain of such launches holds every buffer its kernels touch until its last launch is issued. torch's
caching allocator hands a freed block to the next allocation at once, trusting stream order; a kernel that
writes before its wait breaks that trust, for it may write while the kernel before it still reads a buffer
the host has already dropped, now the same block as the new one.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _grid_wait():
    """PTX griddepcontrol.wait (module doc); a no-op in a launch that is not programmatic."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _grid_release():
    """PTX griddepcontrol.launch_dependents (module doc)."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(ptrs):
    """PTX prefetch.global.L2 of the line at each pointer of `ptrs`; nothing is loaded into registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                              pack=1)


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
def _heavy_tile(counts_ptr, sorted_ptr, E, tile, BM: tl.constexpr, R, K, BLOCK_E: tl.constexpr):
    """A hybrid GEMM program's tile over the experts with m_e ≥ R (`_find_tile`): (its pairs [BM], their row
    mask, the expert as an int64 index, the K loop's end), expert 0 and end 0 past the last tile (it reads
    nothing)."""
    e, row0, left = _find_tile(counts_ptr, E, tile, BM, R, True, BLOCK_E)
    r = tl.arange(0, BM)
    rmask = r < left
    pairs = tl.load(sorted_ptr + row0 + r, mask=rmask, other=0)  # [BM]
    return pairs, rmask, tl.where(left > 0, e, 0).to(tl.int64), tl.where(left > 0, K, 0)


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
