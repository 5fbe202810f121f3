"""The device code of the FP8 grouped GEMM (grouped_gemm_fp8.py, whose module doc describes it): its jit helpers
and its two kernels, the pointer path (`grouped_gemm_fp8_kernel`) and the TMA path (`grouped_gemm_fp8_tma_kernel`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import _act, _find_tile, _grid_release, _grid_wait, _store_y
from ._fp8 import _quant_groups, _round_bf16, _scale_of, _ue8m0, _widen_e4m3
from .grouped_gemm import _grouped_tile, _nb_step


@triton.jit
def _w_scale(srow, s0, off, nm, BN: tl.constexpr, R: tl.constexpr, UE8M0: tl.constexpr):
    """A K step's weight scales for the tile's columns: one value when its BN columns lie in one block row
    (BN divides R; s0 is their scale's address), else one per column, [1, BN] (srow [BN]: each column's);
    `off` the step's block column offset."""
    if R % BN == 0:
        if UE8M0:
            s = _ue8m0(tl.load(s0 + off))
        else:
            s = tl.load(s0 + off)
    else:
        s = _scale_of(srow + off, nm, UE8M0)[None, :]
    return s


@triton.jit
def _load_a(arow, asrow, k0, rmask, BM: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, A8: tl.constexpr,
            QLOAD: tl.constexpr, EMULATE: tl.constexpr):
    """The A tile of one K step, A[rows, k0:k0+BK] (rows at arow [BM, 1]), as the dot takes it, and its rows'
    scales [BM, 1]: 16-bit rows (scale 1); e4m3 rows with their stored scales (A8, at asrow [BM]); or 16-bit
    rows quantised here, per row over the step's BK = G channels (A8 with QLOAD)."""
    offs_k = k0 + tl.arange(0, BK)
    a = tl.load(arow + offs_k[None, :], mask=rmask[:, None], other=0.0)  # [BM, BK]
    if A8 and QLOAD:
        a, sa = _quant_groups(a.to(tl.float32), BM, BK, BK, EMULATE)  # [BM, BK] e4m3, [BM, 1]
    elif A8:
        sa = tl.load(asrow + k0 // G, mask=rmask, other=0.0)[:, None]  # [BM, 1]
    else:
        sa = tl.full([BM, 1], 1.0, tl.float32)
    return a, sa


@triton.jit
def _mma(a, bcol, sk, k0, cmask, acc, sc, BK: tl.constexpr, A8: tl.constexpr, FOLD: tl.constexpr,
         EMULATE: tl.constexpr):
    """One K step on pointers: `_dot` of a with the e4m3 weight columns at bcol [1, C] (K stride sk) over
    [k0, k0 + BK)."""
    offs_k = k0 + tl.arange(0, BK)
    b = tl.load(bcol + offs_k[:, None] * sk, mask=cmask[None, :], other=0.0)  # [BK, C] e4m3
    return _dot(a, b, acc, sc, A8, FOLD, EMULATE)


@triton.jit
def _dot(a, b, acc, sc, A8: tl.constexpr, FOLD: tl.constexpr, EMULATE: tl.constexpr):
    """acc += (a · b) · sc for a [R, BK] (16-bit, or e4m3 with A8), b [BK, C] e4m3, sc the step's scales
    ([R | 1, C]). FOLD (16-bit a, sc [1, C]): acc += a · dtype(b · sc) instead, the product accumulated in place.
    EMULATE (interpreted): every operand widened to fp32 (e4m3 NaN kept, the fold's rounding done in fp32) and
    multiplied in fp32, the exact products of the same values (a bf16 tl.dot is wrong there)."""
    if EMULATE:
        if A8:
            a32 = _widen_e4m3(a)
        else:
            a32 = a.to(tl.float32)
        b32 = _widen_e4m3(b)
        if FOLD:
            if a.dtype == tl.bfloat16:
                b32 = _round_bf16(b32 * sc)
            else:
                b32 = (b32 * sc).to(a.dtype).to(tl.float32)
            acc = tl.dot(a32, b32, acc)
        else:
            acc = acc + tl.dot(a32, b32) * sc
    elif FOLD:
        acc = tl.dot(a, (b.to(tl.float32) * sc).to(a.dtype), acc)  # the dequantised weights, rounded once
    elif A8:
        acc = acc + tl.dot(a, b) * sc  # e4m3 × e4m3 on the FP8 tensor cores
    else:
        acc = acc + tl.dot(a, b.to(a.dtype)) * sc  # e4m3 → bf16 / fp16: exact
    return acc


@triton.jit
def _store_hq(h_ptr, s_hp, hs_ptr, s_hsp, rows, rmask, g, u, wt, n0, N, alpha, limit, BM: tl.constexpr,
              BN: tl.constexpr, G: tl.constexpr, ACT: tl.constexpr, W_IN: tl.constexpr, EMULATE: tl.constexpr):
    """Gate/up epilogue of w8a8: (weight on the input) → act → h quantised per row and G columns: e4m3 at
    h[rows, n0 + [0, BN)], scales at hs[rows, n0 / G + [0, BN / G)]."""
    offs_n = n0 + tl.arange(0, BN)
    if W_IN:
        g = g * wt[:, None]
        u = u * wt[:, None]
    q, s = _quant_groups(_act(g, u, ACT, alpha, limit), BM, BN, G, EMULATE)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * s_hp + offs_n[None, :], q,
             mask=rmask[:, None] & (offs_n < N)[None, :])
    offs_g = n0 // G + tl.arange(0, BN // G)
    tl.store(hs_ptr + rows.to(tl.int64)[:, None] * s_hsp + offs_g[None, :], s,
             mask=rmask[:, None] & (offs_g < N // G)[None, :])


@triton.jit
def _store_h16(h_ptr, s_hp, pairs, rmask, g, u, wt, n0, N, alpha, limit, BN: tl.constexpr, ACT: tl.constexpr,
               W_IN: tl.constexpr, EMULATE: tl.constexpr):
    """Gate/up epilogue in the activations' 16-bit dtype: (weight on the input) → act → h[pairs, n0 + [0, BN)]
    (interpreted, bf16 rounded to nearest first: the interpreter's cast truncates)."""
    offs_n = n0 + tl.arange(0, BN)
    if W_IN:
        g = g * wt[:, None]
        u = u * wt[:, None]
    h = _act(g, u, ACT, alpha, limit)
    if EMULATE and h_ptr.dtype.element_ty == tl.bfloat16:
        h = _round_bf16(h)
    tl.store(h_ptr + pairs.to(tl.int64)[:, None] * s_hp + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & (offs_n < N)[None, :])


@triton.jit
def _down_step(arow, asrow, rmask, bcol, sk, srow, s0, ssk, k0, nm, acc, BM: tl.constexpr, BN: tl.constexpr,
               KS: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr,
               A8: tl.constexpr, UE8M0: tl.constexpr, FOLD: tl.constexpr, QLOAD: tl.constexpr,
               EMULATE: tl.constexpr):
    """One K step of the down GEMM on pointers, [k0, k0 + BK): BK / KS dots, each with its block column's
    weight scales (srow, s0 as `_w_scale` takes them) and, with A8, its activation group's."""
    for j in tl.static_range(BK // KS):
        kj = k0 + j * KS
        a, sa = _load_a(arow, asrow, kj, rmask, BM, KS, G, A8, QLOAD, EMULATE)
        sc = _w_scale(srow, s0, (kj // C) * ssk, nm, BN, R, UE8M0)
        if A8:
            sc = sa * sc
        acc = _mma(a, bcol, sk, kj, nm, acc, sc, KS, A8, FOLD, EMULATE)
    return acc


@triton.jit
def _down_step_tma(a_desc, b_desc, row0, brow, asrow, rmask, srow, s0, ssk, k0, nm, acc, BM: tl.constexpr,
                   BN: tl.constexpr, KS: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                   G: tl.constexpr, A8: tl.constexpr, UE8M0: tl.constexpr, FOLD: tl.constexpr, QLOAD: tl.constexpr,
                   EMULATE: tl.constexpr):
    """`_down_step` on TMA boxes: A [row0, +BM) of h's sorted rows (its scales by sorted row at asrow), B the
    down rows [brow, +BN) of [E·D, F]."""
    for j in tl.static_range(BK // KS):
        kj = k0 + j * KS
        a = a_desc.load([row0, kj])  # [BM, KS]
        if A8 and QLOAD:
            a, sa = _quant_groups(a.to(tl.float32), BM, KS, KS, EMULATE)
        elif A8:
            sa = tl.load(asrow + kj // G, mask=rmask, other=0.0)[:, None]
        sc = _w_scale(srow, s0, (kj // C) * ssk, nm, BN, R, UE8M0)
        if A8:
            sc = sa * sc
        acc = _dot(a, b_desc.load([brow, kj]).T, acc, sc, A8, FOLD, EMULATE)
    return acc


@triton.jit
def _tile_down_nb(arow, asrow, rmask, w_e, sn, sk, ws_e, ssn, ssk, n_first, N, k_lo, k_hi, y_ptr, pairs, wt,
                  first_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                  NB: tl.constexpr, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, A8: tl.constexpr,
                  UE8M0: tl.constexpr, FOLD: tl.constexpr, QLOAD: tl.constexpr, EMULATE: tl.constexpr,
                  W_IN: tl.constexpr, a_desc=None, b_desc=None, row0=0, brow0=0, TMA: tl.constexpr = False):
    """The down GEMM of one row tile over NB consecutive column blocks [n_first + b·BN, +BN) in one pipelined
    loop, (b, K step) flattened, each step with its own block's scales (ws_e: the expert's); each block's y rows
    stored when its last K step is in (grouped_gemm._tile_down_nb's walk). Operands on pointers (arow, w_e: the
    expert's weights) or, with TMA, boxes (a_desc at row0, b_desc at down row brow0 + the block's column)."""
    nk = tl.cdiv(k_hi - k_lo, BK)
    nb = tl.minimum(NB, tl.cdiv(N - n_first, BN))
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i in range(0, nb * nk):
        k0, n0 = _nb_step(i, nk, k_lo, n_first, BK, BN)
        offs_n = n0 + tl.arange(0, BN)
        nm = offs_n < N
        srow = ws_e + (offs_n // R) * ssn  # [BN]
        if TMA:
            acc = _down_step_tma(a_desc, b_desc, row0, brow0 + n0, asrow, rmask, srow, ws_e + (n0 // R) * ssn, ssk,
                                 k0, nm, acc, BM, BN, KS, BK, R, C, G, A8, UE8M0, FOLD, QLOAD, EMULATE)
        else:
            acc = _down_step(arow, asrow, rmask, w_e + offs_n[None, :] * sn, sk, srow, ws_e + (n0 // R) * ssn, ssk,
                             k0, nm, acc, BM, BN, KS, BK, R, C, G, A8, UE8M0, FOLD, QLOAD, EMULATE)
        if k0 + BK >= k_hi:  # block b complete
            _store_y(y_ptr, pairs, rmask, acc, wt, w_e, 0, first_split, n0, N, BN, False, W_IN)
            acc = tl.zeros([BM, BN], dtype=tl.float32)


@triton.jit(do_not_specialize=["P", "n_tiles"])
def grouped_gemm_fp8_kernel(
    a_ptr, s_at, as_ptr, s_ast, wts_ptr, counts_ptr, sorted_ptr,
    w_ptr, se, sn, sk, up, ws_ptr, sse, ssn, ssk, sup,
    h_ptr, s_hp, hs_ptr, s_hsp, y_ptr, P, E, N, K, n_tiles, k_split, alpha, limit,
    PROJ: tl.constexpr, K_TOP: tl.constexpr, BLOCK_E: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, GROUP_M: tl.constexpr,
    R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, A8: tl.constexpr, UE8M0: tl.constexpr, FOLD: tl.constexpr,
    ACT: tl.constexpr, W_IN: tl.constexpr, EMULATE: tl.constexpr, QLOAD: tl.constexpr = False,
    PDL: tl.constexpr = False, HPASS: tl.constexpr = False, NB: tl.constexpr = 1,
):
    """PROJ 0: A = x [T, D] rows of the tile's tokens (A8: xq e4m3 + scales as_ [T, D / G]; A8 with QLOAD: x,
    quantised per K step); B = gate and up rows n0 + [0, BN) of gate_up [E, 2F, D] (scales [E, 2F / R, D / C],
    up's sup scale rows after gate's); epilogue: activation → h [P, F] (A8: hq e4m3 [P, F] + hs [P, F / G];
    with QLOAD 16-bit h, quantised by the down GEMM's loads; with HPASS 16-bit h, quantised by its own pass).
    Each K step of BK columns is BK / KS dots (dot_k).
    PROJ 1: A = h rows of the tile's pairs; B = down rows n0 + [0, BN) of [E, D, F] over the F range of split
    program_id(1); epilogue: routing weight → y[split] [P, D]; NB column blocks a program (`_tile_down_nb`).
    PDL: each projection releases the launch after it, gate/up only once its wait has passed (so the routing is
    complete when the down GEMM starts: PROJ 1 reads counts and order in its tile's setup, then waits for h)."""
    if PDL:
        if PROJ == 0:
            _grid_wait()
        _grid_release()
    tile, n0 = _grouped_tile(tl.program_id(0), n_tiles, N, BN * NB, GROUP_M)
    e, row0, left = _find_tile(counts_ptr, E, tile, BM, 0, False, BLOCK_E)
    r = tl.arange(0, BM)
    rmask = r < left
    pairs = tl.load(sorted_ptr + row0 + r, mask=rmask, other=0)  # [BM]
    ec = tl.where(left > 0, e, 0).to(tl.int64)
    wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [BM]
    if PDL and PROJ == 1:
        _grid_wait()
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    if PROJ == 0:
        arows = pairs // K_TOP  # x by token
    else:
        arows = pairs  # h by pair
    arow = a_ptr + arows.to(tl.int64)[:, None] * s_at  # [BM, 1]
    asrow = as_ptr + arows.to(tl.int64) * s_ast  # [BM]
    bcol = w_ptr + ec * se + offs_n[None, :] * sn  # [1, BN]
    srow = ws_ptr + ec * sse + (offs_n // R) * ssn  # [BN] scale rows of the columns
    s0 = ws_ptr + ec * sse + (n0 // R) * ssn  # the first column's
    if PROJ == 0:
        k_end = tl.where(left > 0, K, 0)
        accg = tl.zeros([BM, BN], dtype=tl.float32)
        accu = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, k_end, BK):
            for j in tl.static_range(BK // KS):  # a step's dots, KS columns each (one scale block column)
                kj = k0 + j * KS
                a, sa = _load_a(arow, asrow, kj, rmask, BM, KS, G, A8, QLOAD, EMULATE)
                sg = _w_scale(srow, s0, (kj // C) * ssk, nm, BN, R, UE8M0)  # [] or [1, BN]
                su = _w_scale(srow, s0, sup + (kj // C) * ssk, nm, BN, R, UE8M0)
                if A8:
                    sg = sa * sg  # [BM, BN]
                    su = sa * su
                accg = _mma(a, bcol, sk, kj, nm, accg, sg, KS, A8, FOLD, EMULATE)
                accu = _mma(a, bcol + up, sk, kj, nm, accu, su, KS, A8, FOLD, EMULATE)
        if A8 and not QLOAD and not HPASS:  # h quantised here; with QLOAD the down GEMM quantises its 16-bit
            # rows, with HPASS a pass of its own
            _store_hq(h_ptr, s_hp, hs_ptr, s_hsp, pairs, rmask, accg, accu, wt, n0, N, alpha, limit, BM, BN, G,
                      ACT, W_IN, EMULATE)
        else:
            _store_h16(h_ptr, s_hp, pairs, rmask, accg, accu, wt, n0, N, alpha, limit, BN, ACT, W_IN, EMULATE)
    else:
        ks = tl.program_id(1)  # split of the F reduction: partial planes y [S, P, D]
        k_lo = ks * k_split
        k_hi = tl.where(left > 0, tl.minimum(k_lo + k_split, K), k_lo)
        if NB == 1:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                acc = _down_step(arow, asrow, rmask, bcol, sk, srow, s0, ssk, k0, nm, acc, BM, BN, KS, BK, R, C, G,
                                 A8, UE8M0, FOLD, QLOAD, EMULATE)
            _store_y(y_ptr + ks.to(tl.int64) * P * N, pairs, rmask, acc, wt, w_ptr, 0, (ks == 0).to(tl.float32),
                     n0, N, BN, False, W_IN)
        else:
            _tile_down_nb(arow, asrow, rmask, w_ptr + ec * se, sn, sk, ws_ptr + ec * sse, ssn, ssk, n0, N, k_lo,
                          k_hi, y_ptr + ks.to(tl.int64) * P * N, pairs, wt, (ks == 0).to(tl.float32), BM, BN, BK,
                          KS, NB, R, C, G, A8, UE8M0, FOLD, QLOAD, EMULATE, W_IN)


@triton.jit(do_not_specialize=["P", "n_tiles"])
def grouped_gemm_fp8_tma_kernel(
    a_desc, as_ptr, s_ast, b_desc, ws_ptr, sse, ssn, ssk, sup, wts_ptr, counts_ptr, sorted_ptr,
    h_ptr, hs_ptr, s_hsp, y_ptr, P, E, N, K, n_tiles, k_split, alpha, limit,
    PROJ: tl.constexpr, K_TOP: tl.constexpr, BLOCK_E: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, GROUP_M: tl.constexpr,
    R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, A8: tl.constexpr, UE8M0: tl.constexpr, FOLD: tl.constexpr,
    ACT: tl.constexpr, W_IN: tl.constexpr, EMULATE: tl.constexpr, QLOAD: tl.constexpr = False,
    PDL: tl.constexpr = False, HPASS: tl.constexpr = False, NB: tl.constexpr = 1,
):
    """The TMA operand path (Fp8GemmParams.tma). a_desc: the sorted rows, box [BM, KS]: xs [P, D] (PROJ 0; the
    token rows gathered in expert order, 16-bit, or e4m3 with A8 from the pre-pass, whose scales stay in token
    order at as_ [T, D / G]) or h [P, F] (PROJ 1, written by PROJ 0 in sorted order, as its scales hs);
    b_desc: gate_up as [E·2F, D] (gate rows e·2F + n, up rows e·2F + F + n) or down as [E·D, F] in e4m3, box
    [BN, KS] (a K step of BK columns loads BK / KS boxes of each). A tile's A is one box [row0, row0 + BM) (rows
    past its expert belong to the next one: computed and dropped); boxes past a tensor's edge read zeros. PDL and NB
    as grouped_gemm_fp8_kernel's."""
    if PDL:  # gate/up releases the down GEMM only once the routing is complete (grouped_gemm_fp8_kernel's doc)
        if PROJ == 0:
            _grid_wait()
        _grid_release()
    tile, n0 = _grouped_tile(tl.program_id(0), n_tiles, N, BN * NB, GROUP_M)
    e, row0, left = _find_tile(counts_ptr, E, tile, BM, 0, False, BLOCK_E)
    if left > 0:
        r = tl.arange(0, BM)
        rmask = r < left
        pairs = tl.load(sorted_ptr + row0 + r, mask=rmask, other=0)  # [BM]
        wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [BM]
        if PDL and PROJ == 1:
            _grid_wait()
        offs_n = n0 + tl.arange(0, BN)
        nm = offs_n < N
        srow = ws_ptr + e.to(tl.int64) * sse + (offs_n // R) * ssn  # [BN]
        s0 = ws_ptr + e.to(tl.int64) * sse + (n0 // R) * ssn
        if PROJ == 0:
            asrow = as_ptr + (pairs // K_TOP).to(tl.int64) * s_ast  # x's scales by token
        else:
            asrow = as_ptr + (row0 + r).to(tl.int64) * s_ast  # h's by sorted row
        if PROJ == 0:
            accg = tl.zeros([BM, BN], dtype=tl.float32)
            accu = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                for j in tl.static_range(BK // KS):  # a step's boxes, KS columns each
                    kj = k0 + j * KS
                    a = a_desc.load([row0, kj])  # [BM, KS]
                    if A8 and QLOAD:
                        a, sa = _quant_groups(a.to(tl.float32), BM, KS, KS, EMULATE)
                    elif A8:
                        sa = tl.load(asrow + kj // G, mask=rmask, other=0.0)[:, None]  # [BM, 1]
                    sg = _w_scale(srow, s0, (kj // C) * ssk, nm, BN, R, UE8M0)  # [] or [1, BN]
                    su = _w_scale(srow, s0, sup + (kj // C) * ssk, nm, BN, R, UE8M0)
                    if A8:
                        sg = sa * sg
                        su = sa * su
                    bg = b_desc.load([e * 2 * N + n0, kj])  # [BN, KS]
                    bu = b_desc.load([e * 2 * N + N + n0, kj])
                    accg = _dot(a, bg.T, accg, sg, A8, FOLD, EMULATE)
                    accu = _dot(a, bu.T, accu, su, A8, FOLD, EMULATE)
            if A8 and not QLOAD and not HPASS:  # h in sorted order: row row0 + r
                _store_hq(h_ptr, N, hs_ptr, s_hsp, row0 + r, rmask, accg, accu, wt, n0, N, alpha, limit, BM, BN,
                          G, ACT, W_IN, EMULATE)
            else:
                _store_h16(h_ptr, N, row0 + r, rmask, accg, accu, wt, n0, N, alpha, limit, BN, ACT, W_IN, EMULATE)
        else:
            ks = tl.program_id(1)  # split of the F reduction: partial planes y [S, P, D]
            k_lo = ks * k_split
            if NB == 1:
                acc = tl.zeros([BM, BN], dtype=tl.float32)
                for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BK):
                    acc = _down_step_tma(a_desc, b_desc, row0, e * N + n0, asrow, rmask, srow, s0, ssk, k0, nm, acc,
                                         BM, BN, KS, BK, R, C, G, A8, UE8M0, FOLD, QLOAD, EMULATE)
                _store_y(y_ptr + ks.to(tl.int64) * P * N, pairs, rmask, acc, wt, y_ptr, 0,
                         (ks == 0).to(tl.float32), n0, N, BN, False, W_IN)
            else:
                _tile_down_nb(0, asrow, rmask, 0, 0, 0, ws_ptr + e.to(tl.int64) * sse, ssn, ssk, n0, N, k_lo,
                              tl.minimum(k_lo + k_split, K), y_ptr + ks.to(tl.int64) * P * N, pairs, wt,
                              (ks == 0).to(tl.float32), BM, BN, BK, KS, NB, R, C, G, A8, UE8M0, FOLD, QLOAD,
                              EMULATE, W_IN, a_desc, b_desc, row0, e * N, True)
