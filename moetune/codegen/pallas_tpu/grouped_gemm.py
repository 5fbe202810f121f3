"""grouped_gemm: expert-sorted rows through a grouped matmul on the MXU (Pallas TPU, megablox-style grid).

Inside the jitted function, with P = T·k (token, expert) pairs:

    route        key = id where 0 ≤ id < E else E (a trailing dummy group, never visited);
                 order = argsort(key, stable) [P]; counts = bincount(key, length=E + 1)[:E] [E];
                 group g = expert g holds sorted rows [starts[g], ends[g])
    rows         xs = x[order // k] [Pp, D], ws = weights[order] [Pp, 1] f32 (Pp = P rounded up to tile_m;
                 pad rows zero)
    metadata     tile i of the grid → (expert group[i], row tile m[i]): every row tile a non-empty group
                 overlaps, groups in expert order (so the output tiles are revisited consecutively);
                 zero-row experts get no tile. The metadata arrays are sized by the bound
                 Pp/tile_m + min(E, P) − 1; the grid's tile axis is the traced count of real tiles (a
                 dynamic grid), so no step is spent on tiles that do not exist.
    gate/up      grid (F/tile_n, tiles, D/tile_k): acc_g, acc_u [tile_m, tile_n] f32 += xs tile · gate /
                 up tiles of expert group[i] (read in place in the model's layout; interleaved layouts:
                 one [2·tile_n] tile, its even / odd columns taken apart in the epilogue by exact 0/1
                 matmuls); epilogue: routing weight (weight on the input: gate(w·x) = w·gate(x)), bias,
                 activation; rows of the tile outside [starts[g], ends[g]) keep what another group's
                 tile wrote there (masked store). h [Pp, F] in x's dtype.
    down         grid (D/down_tile_n, tiles, F/down_tile_k): y [Pp, D] f32 = h tile · down tile (+ bias,
                 × routing weight when it applies on the output), the same masked store.
    combine      unsort + sum in f32: y[rank] [T, k, D] summed over k where the id is valid (rows never
                 written — pad rows, sentinels — are masked by `where`, never multiplied), cast to x's
                 dtype. No scatter: one gather and a reduction, deterministic.

TPU tiling: tile_m a multiple of 16 (bf16 rows pack two per sublane; f32 takes the same tiles), every
other tile a multiple of 128 dividing its dimension, so a block needs D and F multiples of 128.
Block-quantised weights (fp8_block, moetune.codegen.quant; standard layout, float32 scales, blocks in
multiples of 128 dividing D and F): w8a16. The e4m3 tiles stream from HBM at one byte per weight, each
expert's scales sit in SMEM, and each K step runs one matmul per (r, c) scale block of the tile on the
e4m3 values cast to x's dtype (exact), scaled in f32 (x·(q·s)ᵀ = s·(x·qᵀ)); no dequantised copy is made.
Those matmuls are unrolled, so a tile holds at most FP8_BLOCKS_PER_TILE scale blocks.
"""

from __future__ import annotations

from typing import NamedTuple

from ...ir import MoEBlock, Schedule
from ..contract import KernelKind, sources
from ._common import JaxExperts, bridged, interpret
from .reference import gated
from .tiles import (
    GemmParams,
    Tiles,
    check_block,
    check_divides,
    cost,
    default_params,
    down_tiles,
    down_vmem,
    gate_up_tiles,
    gate_up_vmem,
    refusal,
    space,
)

SOURCES = ("grouped_gemm.py", "tiles.py", "_common.py", "reference.py")
FORMATS = ("none", "fp8_block")

# ---- routing and tile metadata (traced) ----------------------------------------------------------------

class Routed(NamedTuple):
    order: object  # [P] int32: pair indices sorted by expert, sentinels last
    key: object  # [P] int32: each pair's expert, E for a sentinel
    counts: object  # [E] int32: rows per expert
    starts: object  # [E] int32: first sorted row of each expert
    ends: object  # [E] int32: one past its last


def route(block: MoEBlock, ids) -> Routed:
    import jax.numpy as jnp

    flat = ids.reshape(-1).astype(jnp.int32)  # [P]
    key = jnp.where((flat >= 0) & (flat < block.E), flat, block.E)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=block.E + 1)[: block.E].astype(jnp.int32)
    ends = jnp.cumsum(counts).astype(jnp.int32)
    return Routed(order, key, counts, ends - counts, ends)


def sorted_rows(x, weights, order, k: int, rows: int):
    """(xs [rows, D] in x's dtype, ws [rows, 1] f32): the token rows and routing weights in sorted order,
    zero past the P pairs."""
    import jax.numpy as jnp

    pad = rows - order.shape[0]
    xs = jnp.pad(x[order // k], ((0, pad), (0, 0)))
    ws = jnp.pad(weights.reshape(-1)[order].astype(jnp.float32)[:, None], ((0, pad), (0, 0)))
    return xs, ws


def tile_metadata(r: Routed, active, tm: int, rows: int):
    """(group [NT], m [NT], total [1]) int32: the expert and row tile of each grid tile, and how many are
    real (the grid's extent). Tiles of each active non-empty expert, experts in order; NT = rows/tm +
    min(E, P) − 1 bounds them (entries past `total` are never read)."""
    import jax.numpy as jnp

    E = r.counts.shape[0]
    n_m = rows // tm
    NT = n_m + min(E, r.order.shape[0]) - 1
    first_m = r.starts // tm
    nt = jnp.where(active & (r.counts > 0), (r.ends + tm - 1) // tm - first_m, 0)  # [E] tiles per expert
    total = nt.sum().astype(jnp.int32)
    group = jnp.repeat(jnp.arange(E, dtype=jnp.int32), nt, total_repeat_length=NT)
    t = jnp.arange(NT, dtype=jnp.int32)
    m = (first_m[group] + t - (jnp.cumsum(nt) - nt)[group]).astype(jnp.int32)
    return group, m, total[None]


# ---- the kernels ---------------------------------------------------------------------------------------

def _dot(a, b, b_transposed: bool):
    """a [m, k] · b, b [n, k] (`b_transposed`) or [k, n], in f32 (f32 operands at full precision)."""
    import jax
    import jax.numpy as jnp

    ct = jnp.promote_types(a.dtype, b.dtype)
    dims = (((1,), (1,)), ((), ())) if b_transposed else (((1,), (0,)), ((), ()))
    prec = jax.lax.Precision.HIGHEST if ct == jnp.float32 else None
    return jax.lax.dot_general(a.astype(ct), b.astype(ct), dims, precision=prec,
                               preferred_element_type=jnp.float32)


def _columns(v, parity: int):
    """The even (parity 0) or odd columns of v [m, 2n] f32, by an exact 0/1 matmul."""
    import jax
    import jax.numpy as jnp

    two_n = v.shape[1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (two_n, two_n // 2), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (two_n, two_n // 2), 1)
    return _dot(v, (rows == 2 * cols + parity).astype(jnp.float32), False)


def _accumulate(acc, x_ref, w_ref, s_ref, w_transposed: bool, quant, row0, col0) -> None:
    """acc += x tile · w tile. Unquantised: one matmul. Block-quantised (quant = (r, c, scale columns)):
    per scale block, the e4m3 values cast to x's dtype (exact: e4m3 ⊂ bf16), one [tm, c]·[c, r] matmul in
    f32, times that block's scale from SMEM (x·(q·s)ᵀ = s·(x·qᵀ): w8a16 without a dequantised copy).
    row0 / col0: the tile's first scale row and column."""
    if quant is None:
        acc[...] += _dot(x_ref[...], w_ref[...], w_transposed)
        return
    r, c, n_cols = quant
    width, depth = w_ref.shape  # standard layout only: [tile_n, tile_k]
    for kb in range(depth // c):
        xa = x_ref[:, kb * c:(kb + 1) * c]
        for b in range(width // r):
            q = w_ref[b * r:(b + 1) * r, kb * c:(kb + 1) * c].astype(xa.dtype)
            s = s_ref[0, (row0 + b) * n_cols + col0 + kb]
            acc[:, b * r:(b + 1) * r] += s * _dot(xa, q, True)


def _scale_spec(scales, E: int):
    """The scales of one expert [E, rows, cols] → a flat SMEM block per expert, and the array it reads."""
    import jax.experimental.pallas as pl
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    flat = scales.astype(jnp.float32).reshape(E, 1, -1)  # [E, 1, rows·cols]: full last two block dims
    spec = pl.BlockSpec((None, 1, flat.shape[2]), lambda n, i, kk, g, mt, *_: (g[i], 0, 0),
                        memory_space=pltpu.SMEM)
    return spec, flat


def _store_rows(out_ref, val, group, m, starts, ends, tm: int) -> None:
    """Write val [tm, tn] f32 into the rows of out_ref's tile that belong to expert `group`."""
    import jax
    import jax.numpy as jnp

    row = jax.lax.broadcasted_iota(jnp.int32, val.shape, 0) + m * tm
    mine = (row >= starts[group]) & (row < ends[group])
    out_ref[...] = jnp.where(mine, val, out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def _vmem_limit(footprint: int) -> int:
    """vmem_limit_bytes of a pass: its footprint and a quarter more for Mosaic's own scratch, at least the
    smallest default scoped limit (16 MiB); within a core's VMEM for any point of a space (≤ 3/4 of it)."""
    return max(footprint + footprint // 4, 16 * 2**20)


def _call(kernel, grid, in_specs, out_spec, out_shape, scratch, footprint: int, interp):
    import jax.experimental.pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=grid, in_specs=in_specs, out_specs=out_spec, scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=_vmem_limit(footprint)),
        interpret=interp,
    )


def _quant(block: MoEBlock, scales):
    """(r, c, scale columns per expert) of block-quantised weights, None for unquantised ones."""
    fmt = block.weight_format
    return (*fmt.block, scales.shape[-1]) if fmt.quantized else None


def gate_up_pass(block: MoEBlock, t: Tiles, xs, ws, w: JaxExperts, r: Routed, meta, interp):
    """h [rows, F] in xs's dtype: act(gate, up) of the sorted rows, for the tiles of `meta` (module doc)."""
    import jax
    import jax.experimental.pallas as pl
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    lay, E, F = block.layout, block.E, block.F
    rows, D = xs.shape
    nf, nk = F // t.n, D // t.k
    w_in = block.weight_application == "input"
    group, m, total = meta

    specs = [pl.BlockSpec((t.m, t.k), lambda n, i, kk, g, mt, *_: (mt[i], kk))]
    args = [xs]
    if w_in:
        specs.append(pl.BlockSpec((t.m, 1), lambda n, i, kk, g, mt, *_: (mt[i], 0)))
        args.append(ws)
    # gate/up column blocks: interleaved → one [2·tile_n] block n; else gate block n and up block nf + n
    halves = ((2 * t.n, 0),) if lay.interleaved else ((t.n, 0), (t.n, nf))
    for width, off in halves:
        if lay.transposed:  # [E, D, 2F]
            specs.append(pl.BlockSpec((None, t.k, width), lambda n, i, kk, g, mt, *_, o=off: (g[i], kk, o + n)))
        else:  # [E, 2F, D]
            specs.append(pl.BlockSpec((None, width, t.k), lambda n, i, kk, g, mt, *_, o=off: (g[i], o + n, kk)))
        args.append(w.gate_up)
    if lay.has_bias:
        bias = w.gate_up_bias.reshape(E, 1, 2 * F)
        for width, off in halves:
            specs.append(pl.BlockSpec((None, 1, width), lambda n, i, kk, g, mt, *_, o=off: (g[i], 0, o + n)))
            args.append(bias)
    quant = _quant(block, w.gate_up_scale)
    if quant is not None:
        spec, flat = _scale_spec(w.gate_up_scale, E)
        specs.append(spec)
        args.append(flat)
    out_spec = pl.BlockSpec((t.m, t.n), lambda n, i, kk, g, mt, *_: (mt[i], n))
    scratch = [pltpu.VMEM((t.m, width), jnp.float32) for width, _ in halves]
    nw = len(halves)

    def kernel(g_ref, m_ref, st_ref, en_ref, _total, *refs):
        x_ref, rest = refs[0], list(refs[1:])
        ws_ref = rest.pop(0) if w_in else None
        w_refs, rest = rest[:nw], rest[nw:]
        b_refs, rest = (rest[:nw], rest[nw:]) if lay.has_bias else ((), rest)
        s_ref = rest.pop(0) if quant is not None else None
        out_ref, accs = rest[0], rest[1:]
        n, i, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)

        @pl.when(kk == 0)
        def _zero():
            for acc in accs:
                acc[...] = jnp.zeros_like(acc)

        for (width, off), w_ref, acc in zip(halves, w_refs, accs, strict=True):
            row0 = (off + n) * (width // quant[0]) if quant else 0
            _accumulate(acc, x_ref, w_ref, s_ref, not lay.transposed, quant, row0,
                        kk * (t.k // quant[1]) if quant else 0)

        @pl.when(kk == nk - 1)
        def _epilogue():
            vals = [acc[...] for acc in accs]
            if w_in:
                vals = [v * ws_ref[...] for v in vals]
            if lay.has_bias:
                vals = [v + b[...].astype(jnp.float32) for v, b in zip(vals, b_refs, strict=True)]
            gate, up = (_columns(vals[0], 0), _columns(vals[0], 1)) if lay.interleaved else vals
            _store_rows(out_ref, gated(block, gate, up), g_ref[i], m_ref[i], st_ref, en_ref, t.m)

    xb, wb = xs.dtype.itemsize, jnp.dtype(w.gate_up.dtype).itemsize
    call = _call(kernel, (nf, total[0], nk), specs, out_spec, jax.ShapeDtypeStruct((rows, F), xs.dtype),
                 scratch, gate_up_vmem(block, t, xb, wb), interp)
    return call(group, m, r.starts, r.ends, total, *args)


def down_pass(block: MoEBlock, t: Tiles, h, ws, w: JaxExperts, r: Routed, meta, interp):
    """y [rows, D] f32: h rows · the down matrix of their expert (+ bias, × the routing weight on the output)."""
    import jax
    import jax.experimental.pallas as pl
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    lay, E, D = block.layout, block.E, block.D
    rows, F = h.shape
    nd, nk = D // t.n, F // t.k
    w_out = block.weight_application == "output"
    group, m, total = meta

    specs = [pl.BlockSpec((t.m, t.k), lambda n, i, kk, g, mt, *_: (mt[i], kk))]
    args = [h]
    if w_out:
        specs.append(pl.BlockSpec((t.m, 1), lambda n, i, kk, g, mt, *_: (mt[i], 0)))
        args.append(ws)
    if lay.transposed:  # [E, F, D]
        specs.append(pl.BlockSpec((None, t.k, t.n), lambda n, i, kk, g, mt, *_: (g[i], kk, n)))
    else:  # [E, D, F]
        specs.append(pl.BlockSpec((None, t.n, t.k), lambda n, i, kk, g, mt, *_: (g[i], n, kk)))
    args.append(w.down)
    if lay.has_bias:
        specs.append(pl.BlockSpec((None, 1, t.n), lambda n, i, kk, g, mt, *_: (g[i], 0, n)))
        args.append(w.down_bias.reshape(E, 1, D))
    quant = _quant(block, w.down_scale)
    if quant is not None:
        spec, flat = _scale_spec(w.down_scale, E)
        specs.append(spec)
        args.append(flat)
    out_spec = pl.BlockSpec((t.m, t.n), lambda n, i, kk, g, mt, *_: (mt[i], n))

    def kernel(g_ref, m_ref, st_ref, en_ref, _total, *refs):
        h_ref, rest = refs[0], list(refs[1:])
        ws_ref = rest.pop(0) if w_out else None
        w_ref = rest.pop(0)
        b_ref = rest.pop(0) if lay.has_bias else None
        s_ref = rest.pop(0) if quant is not None else None
        out_ref, acc = rest
        n, i, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)

        @pl.when(kk == 0)
        def _zero():
            acc[...] = jnp.zeros_like(acc)

        _accumulate(acc, h_ref, w_ref, s_ref, not lay.transposed, quant,
                    n * (t.n // quant[0]) if quant else 0, kk * (t.k // quant[1]) if quant else 0)

        @pl.when(kk == nk - 1)
        def _epilogue():
            v = acc[...]
            if lay.has_bias:
                v = v + b_ref[...].astype(jnp.float32)
            if w_out:
                v = v * ws_ref[...]
            _store_rows(out_ref, v, g_ref[i], m_ref[i], st_ref, en_ref, t.m)

    xb, wb = h.dtype.itemsize, jnp.dtype(w.down.dtype).itemsize
    call = _call(kernel, (nd, total[0], nk), specs, out_spec, jax.ShapeDtypeStruct((rows, D), jnp.float32),
                 [pltpu.VMEM((t.m, t.n), jnp.float32)], down_vmem(block, t, xb, wb), interp)
    return call(group, m, r.starts, r.ends, total, *args)


def unsorted(y, order):
    """y [rows, D] in sorted order → [P, D] in pair order."""
    import jax.numpy as jnp

    P = order.shape[0]
    rank = jnp.zeros(P, jnp.int32).at[order].set(jnp.arange(P, dtype=jnp.int32))  # sorted row of each pair
    return y[rank]


def combine(y_pairs, ids, block: MoEBlock, dtype):
    """[T, D] in `dtype`: the f32 sum over k of each token's valid pair rows y_pairs [P, D]."""
    import jax.numpy as jnp

    T, k = ids.shape
    valid = (ids >= 0) & (ids < block.E)  # [T, k]
    return jnp.where(valid[..., None], y_pairs.reshape(T, k, -1), 0.0).sum(axis=1).astype(dtype)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def experts_fn(block: MoEBlock, p: GemmParams, interp):
    """The JaxExpertsFn of GemmParams `p`, its pallas_calls given `interp` as interpret=."""
    import jax.numpy as jnp

    check_block(block)
    gu_t, dn_t = gate_up_tiles(p), down_tiles(p)
    check_divides(block, gu_t, dn_t)

    def fn(x, ids, weights, w: JaxExperts):
        T, k = ids.shape
        if T == 0:
            return jnp.zeros_like(x)
        r = route(block, ids)
        rows = round_up(T * k, p.tile_m)
        xs, ws = sorted_rows(x, weights, r.order, k, rows)
        meta = tile_metadata(r, jnp.ones(block.E, bool), p.tile_m, rows)
        h = gate_up_pass(block, gu_t, xs, ws, w, r, meta, interp)
        y = down_pass(block, dn_t, h, ws, w, r, meta, interp)
        return combine(unsorted(y, r.order), ids, block, x.dtype)

    return fn


def build_jax(block: MoEBlock, schedule: Schedule):
    return experts_fn(block, schedule.params, interpret())


def build(block: MoEBlock, schedule: Schedule):
    return bridged(block, build_jax(block, schedule))


KIND = KernelKind("grouped_gemm", GemmParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, formats=FORMATS, build_jax=build_jax)
