"""The grouped GEMM's tile plan on the device, in Pallas kernels (Triton lowering): a counting sort of the pairs
by expert straight into the BM-row tiles the GEMM kernels walk, with each padded row's token, pair and routing
weight, so no sort, gather or small XLA kernel runs between the ids and the GEMM.

    ids [P], weights [P] ──▶ tile_expert [NTo]   each tile's expert (clamped into [0, E))
                             tile_rows [NTo]     its valid rows (0: a tile past the last expert's, skipped)
                             row_pair [Ro]       the pair of padded row r = tile·BM + m (0 on padding rows)
                             row_tok [Ro]        its token, pair // k (0 on padding rows)
                             row_weight [Ro]     its routing weight in f32 (0 on padding rows)

Expert e's rows are its pairs in pair order (stable), from row tile_begin[e]·BM, where tile_begin is the
exclusive prefix sum of the tiles per expert ⌈c_e/BM⌉; ids outside [0, E) are dropped. NTo ≥ NT tiles and
Ro ≥ NTo·BM rows: the tail past NT tiles is padding, and the last C rows are spare.

G programs share the P pairs, `per` each (chunks of C pairs: one-hot tiles [C, BE] with BE = E rounded up to a
power of two):
  G = 1    one launch: each program counts the rows per expert; the first places the pairs (one chunk).
  G > 1    a first launch writes each program's counts, hist [G, BE]; the second reads them all (the totals,
           and the sum over the programs before it: where its pairs start within each expert).
The plan's launch has GT ≥ G programs, each writing TPP tiles' entries; those past G place no pair.
Each program places its pairs (a scatter to their padded rows; a lane that is not a valid pair aims at a spare
row of its own, so no two lanes of a store share a row, as Pallas' interpreter writes masked lanes back) and
writes the entries of its share of the tiles, with zeros on their padding rows (a masked store that misses
every placed row): the two stores cover every row below NTo·BM once.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

from ._common import compiler_params, interpret, pow2_at_least

MAX_PROGRAMS = 64
ONE_HOT = 8192  # elements of a one-hot tile [C, BE] or of a tile-to-expert comparison [TC, BE]
HIST_TILE = 4096  # elements of one load of the programs' counts [GB, BE]


class Plan(NamedTuple):
    tile_expert: object
    tile_rows: object
    row_pair: object
    row_tok: object
    row_weight: object


class Layout(NamedTuple):
    BE: int  # experts rounded up to a power of two
    C: int  # pairs per chunk
    per: int  # pairs per program (a multiple of C)
    G: int  # programs that place pairs
    GT: int  # programs of the plan's launch (≥ G: those past G write tiles only)
    TC: int  # tiles per chunk
    TPP: int  # tiles per program (a multiple of TC)
    GB: int  # rows of hist per load (G > 1)


def num_tiles(P: int, E: int, bm: int) -> int:
    """Tiles that hold every routing of P pairs over E experts: Σ_e ⌈c_e/BM⌉ < P/BM + (active experts)."""
    return _cdiv(P, bm) + min(E, P)


def layout(P: int, E: int, bm: int) -> Layout:
    """One program while the pairs fit one chunk; above, a program per chunk up to MAX_PROGRAMS (a program's
    chunks run one after the other, so fewer per program is less time). The tiles are shared by at least as
    many programs as take a chunk of TC each, TC at most a one-hot tile's rows and at most a program's share
    rounded up to a power of two (16 at least)."""
    be = pow2_at_least(max(16, E))
    c = max(16, min(64, ONE_HOT // be))
    tc = max(16, min(128, ONE_HOT // be))
    g = min(MAX_PROGRAMS, _cdiv(P, c))
    per = _cdiv(_cdiv(P, g), c) * c
    g = _cdiv(P, per)
    nt = num_tiles(P, E, bm)
    gt = max(g, _cdiv(nt, tc))
    share = _cdiv(nt, gt)
    tc = min(tc, max(16, pow2_at_least(share)))
    tpp = _cdiv(share, tc) * tc
    return Layout(be, c, per, g, gt, tc, tpp, max(1, min(pow2_at_least(g), HIST_TILE // be)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _iota(n: int):
    import jax
    import jax.numpy as jnp

    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _chunk_ids(ids_ref, c0, hi, E: int, C: int):
    """(pairs [C], their experts, valid): pairs c0 .. c0+C-1; one at or past `hi`, or routed outside [0, E), is
    not valid and its expert is -1."""
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as plgpu

    p = c0 + _iota(C)
    inb = p < hi
    e = plgpu.load(ids_ref.at[jnp.minimum(p, ids_ref.shape[0] - 1)], mask=inb, other=-1)
    ok = inb & (e >= 0) & (e < E)
    return p, jnp.where(ok, e, -1), ok


def _counts(ids_ref, lo, hi, L: Layout, E: int):
    """Pairs per expert [BE] among pairs lo .. hi-1."""
    import jax
    import jax.numpy as jnp

    ei = _iota(L.BE)

    def chunk(c, cnt):
        _, e, _ = _chunk_ids(ids_ref, lo + c * L.C, hi, E, L.C)
        return cnt + jnp.sum((e[:, None] == ei[None, :]).astype(jnp.int32), axis=0)

    return jax.lax.fori_loop(0, L.per // L.C, chunk, jnp.zeros((L.BE,), jnp.int32))


def _hist_kernel(L: Layout, E: int, ids_ref, hist_ref):
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    g = pl.program_id(0)
    lo = g * L.per
    hist_ref[g, :] = _counts(ids_ref, lo, jnp.minimum(lo + L.per, ids_ref.shape[0]), L, E)


def _plan_kernel(L: Layout, E: int, k: int, bm: int, ids_ref, w_ref, *refs):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    *hist, te_ref, tr_ref, pair_ref, tok_ref, rw_ref = refs
    g = pl.program_id(0)
    P = ids_ref.shape[0]
    lo = g * L.per
    hi = jnp.minimum(lo + L.per, P)
    ei = _iota(L.BE)
    if hist:  # the counts of every program: the totals, and the sum over the programs before this one
        cnt = before = jnp.zeros((L.BE,), jnp.int32)
        for g0 in range(0, L.G, L.GB):
            r = g0 + _iota(L.GB)
            shape = (L.GB, L.BE)
            idx = jnp.broadcast_to(jnp.minimum(r, L.G - 1)[:, None], shape), jnp.broadcast_to(ei[None, :], shape)
            hv = plgpu.load(hist[0].at[idx], mask=jnp.broadcast_to((r < L.G)[:, None], shape), other=0)
            cnt = cnt + jnp.sum(hv, axis=0)
            before = before + jnp.sum(jnp.where((r < g)[:, None], hv, 0), axis=0)
    else:  # one program places the pairs (they fit one chunk); each counts them all
        cnt, before = _counts(ids_ref, 0, P, L, E), jnp.zeros((L.BE,), jnp.int32)
    tiles = (cnt + bm - 1) // bm  # [BE]
    tile_end = jax.lax.cumsum(tiles, axis=0)
    tile_begin = tile_end - tiles
    total = jnp.sum(tiles)
    spare = pair_ref.shape[0] - L.C + _iota(L.C)

    def place(c, run):  # run [BE]: the next padded row of each expert for this program's pairs
        p, e, ok = _chunk_ids(ids_ref, lo + c * L.C, hi, E, L.C)
        oh = (e[:, None] == ei[None, :]).astype(jnp.int32)  # [C, BE]
        within = jax.lax.cumsum(oh, axis=0) - oh
        dest = jnp.where(ok, jnp.sum(oh * (within + run[None, :]), axis=1), spare)
        wv = plgpu.load(w_ref.at[jnp.minimum(p, P - 1)], mask=ok, other=0).astype(jnp.float32)
        plgpu.store(pair_ref.at[dest], p, mask=ok)
        plgpu.store(tok_ref.at[dest], p // k, mask=ok)
        plgpu.store(rw_ref.at[dest], wv, mask=ok)
        return run + jnp.sum(oh, axis=0)

    jax.lax.fori_loop(0, L.per // L.C, place, tile_begin * bm + before)

    m = _iota(bm)

    def entries(c, carry):  # tiles i0 .. i0+TC-1: expert, valid rows, zeros on the padding rows
        i0 = pl.multiple_of(g * L.TPP + c * L.TC, L.TC)
        i = i0 + _iota(L.TC)
        te = jnp.sum((tile_end[None, :] <= i[:, None]).astype(jnp.int32), axis=1)  # [TC]
        sel = ei[None, :] == te[:, None]
        first = jnp.sum(jnp.where(sel, tile_begin[None, :], 0), axis=1)
        left = jnp.sum(jnp.where(sel, cnt[None, :], 0), axis=1) - (i - first) * bm
        rows = jnp.where(i < total, jnp.minimum(jnp.maximum(left, 0), bm), 0)
        te_ref[pl.ds(i0, L.TC)] = jnp.minimum(te, E - 1)
        tr_ref[pl.ds(i0, L.TC)] = rows
        pad = m[None, :] >= rows[:, None]  # [TC, BM]
        r = i[:, None] * bm + m[None, :]
        plgpu.store(pair_ref.at[r], jnp.zeros_like(r), mask=pad)
        plgpu.store(tok_ref.at[r], jnp.zeros_like(r), mask=pad)
        plgpu.store(rw_ref.at[r], jnp.zeros(r.shape, jnp.float32), mask=pad)
        return carry

    jax.lax.fori_loop(0, L.TPP // L.TC, entries, 0)


def plan(ids_f, weights_f, E: int, k: int, bm: int) -> Plan:
    """The plan of the module doc for flat ids [P] (int32) and routing weights [P]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    P = ids_f.shape[0]
    L = layout(P, E, bm)
    nto = L.GT * L.TPP
    ro = nto * bm + L.C
    interp, params = interpret(), compiler_params(4, 1)
    hist = []
    if L.G > 1:
        hist = [pl.pallas_call(
            partial(_hist_kernel, L, E), out_shape=jax.ShapeDtypeStruct((L.G, L.BE), jnp.int32), grid=(L.G,),
            compiler_params=params, interpret=interp, name="moetune_route_counts",
        )(ids_f)]
    sds = jax.ShapeDtypeStruct
    out = (sds((nto,), jnp.int32), sds((nto,), jnp.int32), sds((ro,), jnp.int32), sds((ro,), jnp.int32),
           sds((ro,), jnp.float32))
    return Plan(*pl.pallas_call(
        partial(_plan_kernel, L, E, k, bm), out_shape=out, grid=(L.GT,),
        compiler_params=params, interpret=interp, name="moetune_route_plan",
    )(ids_f, weights_f, *hist))
