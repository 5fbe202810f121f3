"""What the Pallas GPU kernel files share: the interpret switch, the Triton compiler parameters, the blocks the
kernels refuse, weight-tile loads in both layouts and the activation inside a kernel.

    interpret()           what a pallas_call's `interpret=` gets: True (Pallas' interpreter on the host) where
                          MOETUNE_PALLAS_GPU_INTERPRET is set, else False (the Triton lowering)
    compiler_params(w, s) jax.experimental.pallas.triton.CompilerParams(num_warps=w, num_stages=s): the Triton
                          lowering's launch width and the software-pipelining depth of every K loop
    refusal(block)        the blocks no kernel of this backend runs (D or F not a multiple of 16), with the reason
    fp8_refusal           the fp8_block blocks the FP8 kernels do not run (layout, scales, blocks), with the reason
    gate_up_tiles         the [BN, BK] gate and up tiles (f32) of expert e at output n0, reduction k0
    gate_up_bias          their biases [BN]
    gate_up_scales        their fp8_block dequantisation multipliers (the tile lies in one block); down_scale
    down_tile             the [BN, BK] down tile of expert e at output n0, reduction k0
    token_pairs           some of a token's k pairs as vectors: (pair index, expert id, valid)
    expert_tiles          the [G, R, C] tiles of G experts in one masked load (nothing read for invalid lanes)
    expert_rows           the [G, C] bias rows of G experts, masked alike
    packed_pairs_dot      row sums [G, BN] of G experts' e4m3 tiles against their pairs' vectors
    pair_down_scales      the [G] fp8_block multipliers of G experts' down tiles
    packed_e4m3           float8_e4m3fn weights [..., n] viewed as uint32 words [..., n/4] (outside a kernel)
    packed_rows_dot       row sums [BN] of a [BN, BK] e4m3 tile read as [BN, BK/4] words, against a vector
    packed_tile_dot       the [BM, BN] product of a [BM, BK] tile with such a tile's transpose (four dots)
    row_index             the [len(rows), n] (row, column) index arrays of a gather or scatter of whole rows
    activate              h = act(gate, up) in f32, per the block's activation
    trailing_refs         (bias, scale, output) refs after a kernel's weight ref

The expert tensors are JaxExperts (moetune.codegen.pallas_tpu._common) in the layouts of ExpertTensors:
standard gate_up [E, 2F, D], down [E, D, F]; transposed gate_up [E, D, 2F], down [E, F, D]. Gate rows are
0..F-1 of the 2F axis and up rows F..2F-1, or (interleaved) the even and the odd ones. Tiles are read in
place, with dynamic slices (`pl.ds`) or index arrays (a gather of several experts' tiles, `expert_tiles`);
sizes are powers of two that divide the axis they tile (the parameter classes and builds check), so a load is
masked only to skip a pair that is not valid.

FP8 weights are read as uint32 words of four e4m3 values (`packed_e4m3`, a bitcast of the contiguous array:
no copy): Pallas' Triton lowering offsets an array of at most 2^32 bytes with 32-bit integers, which wrap
beyond 2^31 elements, and a word view holds at most 2^30 of them there (larger arrays get 64-bit offsets).
Byte j of word i is the value of column 4i+j (little-endian), so lane j of a [BN, BK/4] word tile meets the
vector's elements k0+j, k0+j+4, .. (a stride-4 load) and the row sum is the sum of the four lanes' sums.
"""

from __future__ import annotations

import os

from ...ir import MoEBlock, UnsupportedSchedule

INTERPRET_ENV = "MOETUNE_PALLAS_GPU_INTERPRET"
PACK = 4  # e4m3 values per uint32 word of a packed FP8 weight
MIN_TILE = 16  # the smallest dot operand side of the Triton lowering; D and F must be multiples of it
MIN_BK = PACK * MIN_TILE  # FP8 grouped GEMM: four dots of BK/4 ≥ 16 columns per K step
REG_ELEMS = 64  # GEMV: weight elements per thread of one chunk's tile ([BN, BK]; [G, BN, BK] in the down): more spills


def on_cuda() -> bool:
    import jax

    try:
        return any(d.platform == "gpu" for d in jax.devices("gpu"))
    except RuntimeError:  # no GPU backend in this jaxlib
        return False


def interpret_requested() -> bool:
    return os.environ.get(INTERPRET_ENV, "") not in ("", "0")


def interpret() -> bool:
    """`interpret=` for pallas_call, read when a function is traced: the interpreter when asked for (tests on
    any machine), else the Triton lowering (also what lowering for "cuda" on a machine without one checks)."""
    return interpret_requested()


def compiler_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def refusal(block: MoEBlock) -> str | None:
    bad = [f"{n} = {v}" for n, v in (("D", block.D), ("F", block.F)) if v % MIN_TILE]
    if bad:
        return f"pallas_gpu kernels tile D and F by powers of two ≥ {MIN_TILE}; {', '.join(bad)} is not a multiple"
    return None


def fp8_refusal(block: MoEBlock, what: str) -> str | None:
    """`refusal(block)`, then what the fp8_block kernels need: the standard gate | up layout (the scales follow
    it), float32 scales, blocks of powers of two (r ≥ 4, c ≥ 16) and D, F in whole blocks (both are rows of one
    matrix and columns of the other). `what` names the kernel in the reason."""
    why = refusal(block)
    if why:
        return why
    fmt, lay = block.weight_format, block.layout
    if lay.transposed or lay.interleaved:
        return f"{what} reads the standard gate | up layout of the block scales, not {lay}"
    if fmt.scale_dtype != "float32":
        return f"{what} reads float32 block scales, not {fmt.scale_dtype}"
    r, c = fmt.block
    if r < 4 or c < 16 or r & (r - 1) or c & (c - 1):
        return f"{what} tiles within blocks of powers of two (r ≥ 4, c ≥ 16), not {fmt.block}"
    bad = [f"{n} = {v}" for n, v in (("D", block.D), ("F", block.F)) if v % r or v % c]
    if bad:
        return (f"{what} needs D and F in whole {r}×{c} scale blocks (both are rows of one matrix and columns of "
                f"the other); {', '.join(bad)} is not")
    return None


def refuse(block: MoEBlock) -> None:
    """UnsupportedSchedule with `refusal(block)`'s reason, if there is one."""
    why = refusal(block)
    if why:
        raise UnsupportedSchedule(why)


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two ≤ cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def check_divides(what: str, **sizes: tuple[int, int]) -> None:
    """UnsupportedSchedule unless every tile (tile, axis length) divides its axis."""
    bad = [f"{n} = {t} does not divide {a}" for n, (t, a) in sizes.items() if a % t]
    if bad:
        raise UnsupportedSchedule(f"{what}: {'; '.join(bad)}")


def check_pow2(what: str, **values: int) -> None:
    bad = [f"{n} = {v}" for n, v in values.items() if v < 1 or v & (v - 1)]
    if bad:
        raise UnsupportedSchedule(f"{what}: {', '.join(bad)} not a power of two")


def gate_up_slices(block: MoEBlock, n0, BN: int):
    """(gate, up) slices of the 2F axis for output columns n0 .. n0+BN of F: the two halves, or (interleaved)
    the even and the odd rows, read with stride 2."""
    from jax.experimental import pallas as pl

    if block.layout.interleaved:
        return pl.ds(2 * n0, BN, 2), pl.ds(2 * n0 + 1, BN, 2)
    return pl.ds(n0, BN), pl.ds(block.F + n0, BN)


def gate_up_tiles(block: MoEBlock, w_ref, e, n0, k0, BN: int, BK: int):
    """(gate, up) tiles in f32: [BN, BK] (standard) or [BK, BN] (transposed: reduce over axis 0)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    gs, us = gate_up_slices(block, n0, BN)
    ks = pl.ds(k0, BK)
    if block.layout.transposed:  # [E, D, 2F]
        g, u = w_ref[e, ks, gs], w_ref[e, ks, us]
    else:  # [E, 2F, D]
        g, u = w_ref[e, gs, ks], w_ref[e, us, ks]
    return g.astype(jnp.float32), u.astype(jnp.float32)


def gate_up_bias(block: MoEBlock, b_ref, e, n0, BN: int):
    """(gate, up) biases [BN] in f32 of expert e's output columns n0 .. n0+BN."""
    import jax.numpy as jnp

    gs, us = gate_up_slices(block, n0, BN)
    return b_ref[e, gs].astype(jnp.float32), b_ref[e, us].astype(jnp.float32)


def down_tile(w_ref, e, n0, k0, BN: int, BK: int, transposed: bool):
    """The down tile [BN, BK] (standard, [E, D, F]) or [BK, BN] (transposed, [E, F, D]), in its dtype."""
    from jax.experimental import pallas as pl

    if transposed:
        return w_ref[e, pl.ds(k0, BK), pl.ds(n0, BN)]
    return w_ref[e, pl.ds(n0, BN), pl.ds(k0, BK)]


def packed_e4m3(w):
    """[..., n] float8_e4m3fn → [..., n/4] uint32 (n a multiple of 4): byte j of word i holds value 4i+j."""
    import jax.numpy as jnp
    from jax import lax

    return lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // PACK, PACK), jnp.uint32)


def unpack_e4m3(words, dtype=None) -> list:
    """The four lanes (in `dtype`, f32 by default; the shape of `words`) of uint32 words of e4m3 values: lane j
    is byte j. Every e4m3 value is exact in f32, bf16 and f16."""
    import jax.numpy as jnp
    from jax import lax

    return [lax.bitcast_convert_type(((words >> (8 * j)) & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)
            .astype(dtype or jnp.float32) for j in range(PACK)]


def packed_rows_dot(w_ref, e, rows, v_ref, v_row, k0, BK: int):
    """Σ_k W[n, k0+k] · v[v_row, k0+k] [BN] (f32) of expert e's e4m3 rows `rows` (a slice of BN rows) of a packed
    weight w_ref [E, R, C/4] (words), over columns k0 .. k0+BK (k0 a multiple of BK, BK of 4·2^i)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    bw = BK // PACK
    words = w_ref[e, rows, pl.ds(pl.multiple_of(k0 // PACK, bw), bw)]  # [BN, BK/4]
    acc = None
    for j, lane in enumerate(unpack_e4m3(words)):
        v = v_ref[v_row, pl.ds(k0 + j, bw, PACK)].astype(jnp.float32)  # [BK/4]: elements k0+j, k0+j+4, ..
        d = jnp.sum(lane * v[None, :], axis=1)
        acc = d if acc is None else acc + d
    return acc


def row_index(rows, c0, n: int, stride: int = 1):
    """(row, column) int32 index arrays [len(rows), n] of the columns c0, c0 + stride, .. of each row in `rows`
    [BM] (any rows: a gather or a scatter): indexing a ref with both reads or writes [BM, n]. Arrays on both
    axes, not an array and a slice: Pallas' interpreter takes a ref indexed by arrays only, or by slices only."""
    import jax
    import jax.numpy as jnp

    shape = (rows.shape[0], n)
    cols = c0 + stride * jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
    return jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(cols, shape)


def packed_tile_dot(w_ref, e, rows, v_ref, v_rows, k0, BK: int):
    """v[v_rows, k0:k0+BK] · W[rows, k0:k0+BK]ᵀ [BM, BN] (f32, tensor-core dots) of expert e's e4m3 rows `rows`
    (BN of them) of a packed weight w_ref [E, R, C/4] (words): four dots of BK/4 columns, lane j against the
    stride-4 columns k0+j, k0+j+4, .. of v (v's dtype, its precision; BK/4 ≥ 16, the dot's side). `v_rows` is a
    slice of v's rows, or an int32 array [BM] of them (a gather)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    bw = BK // PACK
    words = w_ref[e, rows, pl.ds(pl.multiple_of(k0 // PACK, bw), bw)]  # [BN, BK/4]
    acc = None
    for j, lane in enumerate(unpack_e4m3(words, v_ref.dtype)):
        v = (v_ref[v_rows, pl.ds(k0 + j, bw, PACK)] if isinstance(v_rows, pl.Slice)
             else v_ref[row_index(v_rows, k0 + j, bw, PACK)])  # [BM, BK/4]
        d = plgpu.dot(v, lane, trans_b=True, precision=dtype_precision(v_ref.dtype))
        acc = d if acc is None else acc + d
    return acc


def gate_up_scales(block: MoEBlock, s_ref, e, n0, k0):
    """(gate, up) dequantisation multipliers of expert e's tile at output row n0, reduction k0 (fp8_block,
    standard halves layout: the tile lies in one (r, c) block of each half; the up half's blocks start at
    row block ⌈F/r⌉, moetune.codegen.quant.gate_up_scale_shape)."""
    r, c = block.weight_format.block
    nb, kb = n0 // r, k0 // c
    return s_ref[e, nb, kb], s_ref[e, -(-block.F // r) + nb, kb]


def down_scale(block: MoEBlock, s_ref, e, n0, k0):
    """The dequantisation multiplier of expert e's down tile at output row n0, reduction k0 (fp8_block)."""
    r, c = block.weight_format.block
    return s_ref[e, n0 // r, k0 // c]


def token_pairs(ids_ref, t, k: int, E: int, first: int, lanes: int):
    """Token t's pairs first .. first+lanes-1 (of its k) as [lanes] vectors: (pair index, expert id clamped into
    [0, E), valid). A lane past k repeats the last pair's index and is not valid."""
    import jax
    import jax.numpy as jnp

    jk = first + jax.lax.broadcasted_iota(jnp.int32, (lanes,), 0)
    pairs = t * k + jnp.minimum(jk, k - 1)
    e = ids_ref[pairs]
    ok = (jk < k) & (e >= 0) & (e < E)
    return pairs, jnp.where(ok, e, 0), ok


def expert_tiles(w_ref, e, ok, r0, R: int, c0, C: int):
    """[G, R, C] of w_ref[e[i], r0:r0+R, c0:c0+C] per lane i of the experts `e` [G] (a 3-d weight ref), in
    its dtype: a masked load, so a lane that is not `ok` reads nothing and holds zeros. Streamed weights are
    read once: the loads ask the cache to evict them first."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as plgpu

    shape = (e.shape[0], R, C)
    idx = (jnp.broadcast_to(e[:, None, None], shape), r0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1),
           c0 + jax.lax.broadcasted_iota(jnp.int32, shape, 2))
    return plgpu.load(w_ref.at[idx], mask=jnp.broadcast_to(ok[:, None, None], shape), other=0,
                      eviction_policy="evict_first")


def expert_rows(b_ref, e, ok, c0, C: int):
    """[G, C] of b_ref[e[i], c0:c0+C] (a 2-d ref, a bias), zeros where a lane is not `ok` (a masked load)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as plgpu

    shape = (e.shape[0], C)
    idx = jnp.broadcast_to(e[:, None], shape), c0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return plgpu.load(b_ref.at[idx], mask=jnp.broadcast_to(ok[:, None], shape), other=0)


def packed_pairs_dot(w_ref, e, ok, n0, BN: int, v_ref, v_rows, k0, BK: int):
    """Σ_k W_e[n0+n, k0+k] · v[v_rows[i], k0+k] [G, BN] (f32) per lane i of the experts `e` [G], from a packed
    e4m3 weight w_ref [E, R, C/4] (words) over columns k0 .. k0+BK: the [G, BN, BK/4] words of every lane in
    one masked load (a lane that is not `ok` reads nothing), each of the four byte lanes against the stride-4
    columns of its v row."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    bw = BK // PACK
    words = expert_tiles(w_ref, e, ok, n0, BN, pl.multiple_of(k0 // PACK, bw), bw)  # [G, BN, BK/4]
    acc = None
    for j, lane in enumerate(unpack_e4m3(words)):
        v = v_ref[row_index(v_rows, k0 + j, bw, PACK)].astype(jnp.float32)  # [G, BK/4]
        d = jnp.sum(lane * v[:, None, :], axis=2)
        acc = d if acc is None else acc + d
    return acc


def pair_down_scales(block: MoEBlock, s_ref, e, n0, k0):
    """[G] dequantisation multipliers of the experts `e`' down tiles at output row n0, reduction k0
    (fp8_block: each tile lies in one block)."""
    import jax.numpy as jnp

    r, c = block.weight_format.block
    return s_ref[e, jnp.full_like(e, n0 // r), jnp.full_like(e, k0 // c)]


def pow2_at_least(n: int) -> int:
    """The smallest power of two ≥ n."""
    return 1 << max(0, n - 1).bit_length()


def activate(block: MoEBlock, gate, up):
    """h = act(gate, up), f32 in and out (swiglu: silu(gate)·up; clamped_swiglu: the IR's clamps)."""
    import jax.numpy as jnp

    act = block.activation
    if act.kind == "swiglu":
        return gate / (1.0 + jnp.exp(-gate)) * up
    gate = jnp.minimum(gate, act.limit)
    up = jnp.minimum(jnp.maximum(up, -act.limit), act.limit)
    return (up + 1.0) * gate / (1.0 + jnp.exp(-gate * act.alpha))


def trailing_refs(block: MoEBlock, rest):
    """(bias ref or None, scale ref or None, output ref) of a kernel's refs after the weight: the biases where the
    layout has them, the block scales where the format is quantised, then the output."""
    *ins, out = rest
    b_ref = ins.pop(0) if block.layout.has_bias else None
    s_ref = ins.pop(0) if block.weight_format.quantized else None
    return b_ref, s_ref, out


def pair_expert(ids_ref, p, E: int):
    """(expert id clamped into [0, E), valid) of pair p."""
    import jax.numpy as jnp

    e = ids_ref[p]
    valid = (e >= 0) & (e < E)
    return jnp.where(valid, e, 0), valid


def dtype_precision(dtype):
    """The dot precision for tiles of `dtype`: float32 without TF32 rounding, else the default."""
    import jax.numpy as jnp
    from jax import lax

    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
