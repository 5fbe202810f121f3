"""stream_gemv on TPU: each selected expert's weight tiles copied HBM → VMEM once, one row per pair.

The decode regime: about one row per selected expert, so the time is the selected experts' bytes over
HBM bandwidth and the kernel's job is to keep a weight copy in flight at every grid step.

Work. The P = T·k (token, expert) pairs are sorted by expert id (stable) outside the kernel and their
per-pair scalars are scalar-prefetched into SMEM:

    eid  [P] int32   the expert whose tiles the pair's step reads (its DMA index)
    tok  [P] int32   the pair's token
    s_in [P] f32     what x is multiplied by before gate/up: the routing weight (weight on the input) or 1
    s_out[P] f32     what the pair's down row is multiplied by: the routing weight (weight on the output)
                     or 1 (weight on the input); 0 for a sentinel

Ids outside [0, E) (expert-parallel sentinels) sort last, read the tiles of the last valid pair's expert
(no extra copy; expert 0 when there is none) and have s_out = 0: they add nothing. A pair is never padded.

Grid (c, j, p): c the TensorCore split of F (`split`, a "parallel" axis), j the F-block of width BF
(block_f) within the split, p the sorted pair (innermost). The weight BlockSpecs index expert eid[p]'s
F-block j: consecutive pairs of one expert keep the block index, which the TPU pipeline does not copy
again, so every selected expert's weights cross HBM once per call; the next tiles are copied while the
current pair computes (stream="pipeline": the BlockSpec pipeline's double buffers, its only depth in
Mosaic). stream="dma" copies them itself (weights left in HBM, memory_space=pl.ANY): a load is one run
of one expert's pairs at one F-block, and `buffers` (2–4) VMEM slots hold the current load and the
next ones, started `buffers` − 1 loads ahead however long the runs (`_dma_tiles`).

One step, for pair p of token t (f32 accumulation, weights in their dtype on the MXU):

    xs     [1, D]    = x[t] · s_in                                   (x block of x [T, 1, D], index tok[p])
    gate   [1, BF]   = xs · gate[e, F-block j]ᵀ (+ bias)             (standard [E, 2F, D]: tiles [BF, D];
    up     [1, BF]   = xs · up[e, F-block j]ᵀ   (+ bias)              transposed [E, D, 2F]: tiles [D, BF];
                                                                      interleaved: one [2BF, D] / [D, 2BF]
                                                                      tile, split by 0/1 matrix products)
    h      [1, BF]   = act(gate, up)                                 (swiglu or clamped_swiglu), x's dtype
    y      [1, D]    = h · down[e, :, F-block j]ᵀ                    ([D, BF] or transposed [BF, D] tiles)
    out[c, t] += s_out · y   (+ s_out · down bias at j = 0)

The k-sum: out [split, T, D] f32 is one output block per split, resident in VMEM for the whole grid
(its index map is constant over j and p; zeroed at the split's first step), and every pair adds its
row into its token's row; the wrapper sums the splits and casts to x's dtype. Tokens beyond `block_t`
go in further calls of `block_t` tokens (one kernel scanned over them, lax.map) and one of the rest;
each call re-reads its experts' weights: this kernel is the decode one.

FP8 (stream_gemv_fp8.py, scheme fp8_block, float32 scales per 128×128 block; such weights are stored
standard, in halves, without biases: the IR's rule; targets without FP8 units, tpu-v5e, are refused by
the space's check, since their FP8 blocks are better served dequantised once): a tile of e4m3 values q
[out, in] and its scales S [out/128, in/128] (rearranged outside the kernel so each tile's scales are a
block of their own) are applied without widening the tile by its scales: with G the 128-groups of the
tile's outputs and C those of its inputs,

    X [G, in]  = a ⊙ expand(S)         (row g: the activation times group g's scale on each input)
    Y [G, out] = X · widen(q)ᵀ           (q widened to x's dtype, exact for e4m3)
    y [1, out] = Σ_g Y[g] · [o ∈ g]      (each output takes the row of its own group)

G·2 flop per weight byte (G ≤ D/128 = 56 for the largest preset) stays under every TPU's ridge, so the
kernel stays bandwidth-bound.

TPU tiling: BF is a multiple of 128 dividing F / split; D is a multiple of 128 and every block holds the
whole of D (a full dimension); x and bias blocks end in [1, D] / [1, BF] (full / 128-multiple dims).

VMEM (`footprint`): buffers × (the three weight tiles + their scales) + 2 × (x row, bias rows) + 2 × the
f32 output block [block_t, D] + FP8's widened tiles and group products; a space point must fit 3/4 of
the target's VMEM per core and the kernel asks Mosaic for its footprint plus 4 MiB (16 MiB at least).

Default (`default_params`), per core with bandwidth B = target.bandwidth / cores and o = target.grid_step_s of
overhead per grid step: a call at P pairs and n distinct experts takes about

    t(BF) = (F / (BF·split)) · P · o  +  n · 3·F·D·b / (split·B)  +  3·BF·D·b / B
            (steps' overhead)           (weight stream)               (the first tile's unhidden copy)

with b the weight bytes per element and T the tokens of one call (≤ block_t), so the default BF
minimises t over the BF whose footprint fits, with the widest split (≤ cores) that F/BF allows;
stream="pipeline" with its 2 buffers; block_t = 8 (the decode buckets' tokens; the output block stays
small). The own-DMA stream and deeper buffering are the search's to try.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

from ...ir import DTYPE_BYTES, MoEBlock, Schedule, UnsupportedSchedule
from ...passes.stats import uniform_distinct
from ...targets import Target
from ..contract import KernelKind, sources
from ..space import ParamSpace
from ._common import JaxExperts, bridged, interpret
from .reference import gated

SOURCES = ("stream_gemv.py", "_common.py", "reference.py")

LANE = 128
VMEM_FRACTION = 0.75  # of the target's VMEM per core a space point may use (Mosaic's scoped default is lower)
VMEM_SLACK = 4 * 2**20  # asked of Mosaic beyond the footprint, for its internal scratch
MiB = 2**20


@dataclass(frozen=True)
class PallasGemvParams:
    block_f: int = 256  # F columns (of gate, up and down) per grid step; a multiple of 128
    stream: Literal["pipeline", "dma"] = "pipeline"  # weight tiles by BlockSpec pipeline, or by own DMAs
    buffers: int = 2  # weight tiles in flight per operand; above 2 with stream="dma" only
    split: int = 1  # F split over this many TensorCores (a "parallel" grid axis), partial outputs summed
    block_t: int = 8  # most tokens per call (the resident f32 output block); more tokens: more calls

    def __post_init__(self) -> None:
        if self.block_f < LANE or self.block_f % LANE:
            raise UnsupportedSchedule(f"PallasGemvParams.block_f = {self.block_f}: a positive multiple of {LANE}")
        if self.stream not in ("pipeline", "dma"):
            raise UnsupportedSchedule(f"PallasGemvParams.stream = {self.stream!r}: 'pipeline' or 'dma'")
        if self.buffers not in (2, 3, 4) or (self.buffers > 2 and self.stream != "dma"):
            raise UnsupportedSchedule(f"PallasGemvParams.buffers = {self.buffers}: 2, 3 or 4, and above 2 only "
                                      "with stream='dma' (Mosaic's BlockSpec pipeline double-buffers)")
        if self.split not in (1, 2):
            raise UnsupportedSchedule(f"PallasGemvParams.split = {self.split}: 1 or 2")
        if self.block_t < 1:
            raise UnsupportedSchedule(f"PallasGemvParams.block_t = {self.block_t}: ≥ 1")


# ---------------------------------------------------------------------------------------------- the block


def refusal(block: MoEBlock) -> str | None:
    bad = [f"{n} = {v} is not a multiple of {LANE}" for n, v in (("D", block.D), ("F", block.F)) if v % LANE]
    if bad:
        return f"pallas_tpu stream_gemv tiles D and F by {LANE} lanes: {'; '.join(bad)}"
    return None


def fp8_refusal(block: MoEBlock) -> str | None:
    fmt = block.weight_format
    if fmt.scheme != "fp8_block":
        return f"pallas_tpu stream_gemv (fp8) reads fp8_block weights, not {fmt}"
    if fmt.block != (LANE, LANE):
        return f"pallas_tpu stream_gemv (fp8) reads {LANE}x{LANE} scale blocks, not {fmt.block[0]}x{fmt.block[1]}"
    if fmt.scale_dtype != "float32":
        return f"pallas_tpu stream_gemv (fp8) reads float32 scales, not {fmt.scale_dtype}"
    return refusal(block) or fmt.partial_blocks(block.D, block.F)


def _check_block(block: MoEBlock, fp8: bool) -> None:
    why = fp8_refusal(block) if fp8 else refusal(block)
    if why:
        raise UnsupportedSchedule(why)


# ---------------------------------------------------------------------------------------------- VMEM


def _tile_bytes(rows: int, cols: int, nbytes: float) -> int:
    """VMEM bytes of a [rows, cols] array: rows padded to the dtype's sublane tile (8 · 4/bytes), cols to 128."""
    sub = int(8 * 4 // max(1, nbytes))
    return -(-rows // sub) * sub * -(-cols // LANE) * LANE * int(nbytes)


def footprint(block: MoEBlock, p: PallasGemvParams, x_bytes: int | None = None) -> int:
    """VMEM bytes one core's kernel holds (module doc)."""
    D, BF = block.D, p.block_f
    fp8 = block.weight_format.quantized
    wb = DTYPE_BYTES[block.weight_dtype]
    xb = x_bytes if x_bytes is not None else DTYPE_BYTES[block.weight_format.compute_dtype]
    tiles = 3 * _tile_bytes(BF, D, wb)  # gate, up, down tiles ([BF, D] or [D, BF]: the same bytes)
    if fp8:
        tiles += 2 * _tile_bytes(BF // LANE, D // LANE, 4) + _tile_bytes(D // LANE, BF // LANE, 4)
    fixed = 2 * _tile_bytes(1, D, xb)  # x rows
    if block.layout.has_bias:
        fixed += 2 * (2 * _tile_bytes(1, BF, xb) + _tile_bytes(1, D, xb))
    out = 2 * _tile_bytes(p.block_t, D, 4)
    temps = 0
    if fp8:  # widened tiles and the group products of the largest matrix
        temps = 3 * _tile_bytes(BF, D, xb) + 2 * _tile_bytes(D // LANE, max(D, BF), 4)
    return p.buffers * tiles + fixed + out + temps


def vmem_limit(block: MoEBlock, p: PallasGemvParams) -> int:
    return max(16 * MiB, -(-(footprint(block, p) + VMEM_SLACK) // MiB) * MiB)


def check(p: PallasGemvParams, block: MoEBlock, target: Target) -> None:
    """What `target` cannot run: FP8 without FP8 units, an F-block or split that does not divide F, a split
    over more cores than it has, a footprint over 3/4 of its VMEM."""
    if block.weight_format.quantized and target.fp8_flops is None:
        raise UnsupportedSchedule(f"pallas_tpu stream_gemv (fp8): {target.name} has no FP8 units; its FP8 "
                                  "blocks run through the unquantised kernels on dequantised weights")
    if block.F % (p.block_f * p.split):
        raise UnsupportedSchedule(f"PallasGemvParams block_f={p.block_f} split={p.split}: F = {block.F} is not "
                                  "a multiple of block_f · split")
    if p.split > target.cores:
        raise UnsupportedSchedule(f"PallasGemvParams split={p.split}: {target.name} has {target.cores} "
                                  "TensorCore(s) per chip")
    need, limit = footprint(block, p), int(VMEM_FRACTION * target.vmem_bytes)
    if need > limit:
        raise UnsupportedSchedule(f"PallasGemvParams {p}: {need / MiB:.1f} MiB of VMEM, over {limit / MiB:.0f} MiB "
                                  f"(3/4 of {target.name}'s per core); lower block_f or block_t")


CHOICES = (
    ("block_f", (128, 256, 384, 512, 768, 1024, 1536, 2048)),
    ("stream", ("pipeline", "dma")),
    ("buffers", (2, 3, 4)),
    ("split", (1, 2)),
    ("block_t", (8, 16, 32)),
)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(PallasGemvParams, CHOICES, check=partial(check, block=block, target=target))


def _fits(block: MoEBlock, p: PallasGemvParams, target: Target) -> bool:
    try:
        check(p, block, target)
    except UnsupportedSchedule:
        return False
    return True


def default_params(block: MoEBlock, T: int, target: Target) -> PallasGemvParams:
    """The BF of least modelled time among those that fit (module doc); split over the cores."""
    if block.weight_format.quantized and target.fp8_flops is None:
        check(PallasGemvParams(), block, target)  # raises the reason
    bw = target.bandwidth / target.cores
    wb = DTYPE_BYTES[block.weight_dtype]
    T = min(max(1, T), PallasGemvParams.block_t)  # the tokens of one call
    P, n = T * block.k, uniform_distinct(block.E, block.k, T)
    best = None
    for bf in dict(CHOICES)["block_f"]:
        for split in (min(2, target.cores), 1):
            p = PallasGemvParams(block_f=bf, split=split)
            if not _fits(block, p, target):
                continue
            t = ((block.F // (bf * split)) * P * target.grid_step_s + n * 3 * block.F * block.D * wb / (split * bw)
                 + 3 * bf * block.D * wb / bw)
            if best is None or t < best[0]:
                best = (t, p)
            break  # the widest split that fits this BF
    if best is None:
        raise UnsupportedSchedule(f"pallas_tpu stream_gemv: no block_f fits {target.name}'s VMEM for "
                                  f"D = {block.D}, F = {block.F}")
    return best[1]


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): each call's distinct experts once (scales too), x per step, the f32 partial outputs."""
    p = schedule.params
    T = max(1, tokens)
    xb = DTYPE_BYTES[block.weight_format.compute_dtype]
    calls, last = divmod(T, p.block_t)
    chunks = [p.block_t] * calls + ([last] if last else [])
    flops = 2.0 * 3 * T * block.k * block.D * block.F
    steps = block.F // p.block_f
    by = 0.0
    for t in chunks:
        by += uniform_distinct(block.E, block.k, t) * block.weight_bytes_per_expert
        by += steps * t * block.k * block.D * xb + p.split * t * block.D * 4 + t * block.D * xb
    return flops, by + T * block.k * 16  # the pairs' four 4-byte scalars


# ---------------------------------------------------------------------------------------------- the kernel


def _dot(a, w, contract: int):
    """a [m, C] · w (contract 0: w [C, O]; 1: w [O, C]) → [m, O] float32."""
    import jax
    import jax.numpy as jnp

    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, w, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=prec)


def _groups(n_groups: int, n: int, dim: int):
    """f32 0/1 [n_groups, n] (dim 0) or [n, n_groups] (dim 1): element i in group i // 128."""
    import jax
    import jax.numpy as jnp

    shape = (n_groups, n) if dim == 0 else (n, n_groups)
    g = jax.lax.broadcasted_iota(jnp.int32, shape, dim)
    i = jax.lax.broadcasted_iota(jnp.int32, shape, 1 - dim)
    return (jax.lax.div(i, LANE) == g).astype(jnp.float32)  # lax.div: no floor-division correction


def _select(n: int, offset: int):
    """f32 0/1 [2n, n]: column i picks element 2i + offset (the interleaved gate (0) or up (1) halves)."""
    import jax
    import jax.numpy as jnp

    r = jax.lax.broadcasted_iota(jnp.int32, (2 * n, n), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (2 * n, n), 1)
    return (r == 2 * c + offset).astype(jnp.float32)


def _project(a, w_ref, s_ref, contract: int, cdt):
    """a [1, C] through one weight tile (contract: its input axis) → [1, O] float32; FP8 tiles with their
    group scales s [G, C/128] (module doc)."""
    import jax.numpy as jnp

    w = w_ref[0]  # [O, C] or [C, O]
    if s_ref is None:
        return _dot(a.astype(w.dtype), w, contract)
    s = s_ref[0, 0]  # [G, C/128]
    C, O = w.shape[contract], w.shape[1 - contract]
    xs = a.astype(jnp.float32) * _dot(s, _groups(C // LANE, C, 0), 0)  # [G, C]
    y = _dot(xs.astype(cdt), w.astype(cdt), contract)  # [G, O]
    return jnp.sum(y * _groups(s.shape[0], O, 0), axis=0, keepdims=True)


EID, TOK, S_IN, S_OUT, RUN, RUN_E, RUNS = range(7)  # the scalar-prefetch operands (RUN..: stream="dma")


def _streams(block: MoEBlock, p: PallasGemvParams, w: JaxExperts):
    """The weight streams, in the kernel's order: (array, block shape, (e, j) → block index) of the gate/up
    tile(s), the down tile and, for FP8, their scales (arranged per tile, _scale_tiles); j the global F-block."""
    D, F, BF = block.D, block.F, p.block_f
    nF = F // BF
    lay = block.layout
    rows_offs = [(2 * BF, 0)] if lay.interleaved else [(BF, 0), (BF, nF)]  # stored gate_up rows per tile, offset
    out = []
    for rows, off in rows_offs:
        if lay.transposed:
            out.append((w.gate_up, (1, D, rows), lambda e, j, off=off: (e, 0, off + j)))
        else:
            out.append((w.gate_up, (1, rows, D), lambda e, j, off=off: (e, off + j, 0)))
    if lay.transposed:
        out.append((w.down, (1, BF, D), lambda e, j: (e, j, 0)))
    else:
        out.append((w.down, (1, D, BF), lambda e, j: (e, 0, j)))
    if block.weight_format.quantized:
        gs, ds = _scale_tiles(block, p, w)
        for (rows, off), a in zip(rows_offs, gs, strict=True):
            out.append((a, (1, 1, rows // LANE, D // LANE), lambda e, j, off=off: (e, off + j, 0, 0)))
        out.append((ds, (1, 1, D // LANE, BF // LANE), lambda e, j: (e, j, 0, 0)))
    return out


def _biases(block: MoEBlock, p: PallasGemvParams, w: JaxExperts):
    """(array, block shape, (e, j) → block index) of the gate/up bias tile(s) and the down bias row."""
    E, D, F, BF = block.E, block.D, block.F, p.block_f
    gb = w.gate_up_bias.reshape(E, 1, 2 * F)
    if block.layout.interleaved:
        out = [(gb, (1, 1, 2 * BF), lambda e, j: (e, 0, j))]
    else:
        out = [(gb, (1, 1, BF), lambda e, j: (e, 0, j)), (gb, (1, 1, BF), lambda e, j, nF=F // BF: (e, 0, nF + j))]
    return out + [(w.down_bias.reshape(E, 1, D), (1, 1, D), lambda e, j: (e, 0, 0))]


def _window(shape, index):
    """The slices of a block of `shape` at block `index` (a DMA's source)."""
    from jax.experimental import pallas as pl

    return tuple(pl.ds(i * b, b) for i, b in zip(index, shape, strict=True))


def _dma_tiles(p: PallasGemvParams, nFs: int, scal, hbm, bufs, sem):
    """stream="dma": the VMEM views of this step's weight tiles, copied `buffers` − 1 loads ahead.

    A load is one (run of one expert's pairs, F-block): load l = jj · runs + run[p] of this core reads expert
    run_e[l mod runs]'s F-block c·nFs + l div runs into slot l mod buffers. The core's first step starts
    loads 0 .. buffers − 2; the first step of load l waits for it and starts load l + buffers − 1 into the
    slot load l − 1 has left."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    c, jj, q = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    run, run_e, runs = scal[RUN], scal[RUN_E], scal[RUNS][0]
    total = nFs * runs
    nb = p.buffers

    def copies(l):  # lax.div / rem: l ≥ 0, no floor-division correction (which Mosaic lowers per chip)
        slot, e, j = jax.lax.rem(l, nb), run_e[jax.lax.rem(l, runs)], c * nFs + jax.lax.div(l, runs)
        return [pltpu.make_async_copy(src.at[_window(shape, index(e, j))], buf.at[pl.ds(slot, 1)], sem.at[i, slot])
                for i, ((src, shape, index), buf) in enumerate(zip(hbm, bufs, strict=True))]

    def start(l):
        @pl.when(l < total)
        def _():
            for cp in copies(l):
                cp.start()

    @pl.when((jj == 0) & (q == 0))
    def _():
        for i in range(nb - 1):
            start(i)

    load = jj * runs + run[q]

    @pl.when((q == 0) | (run[q] != run[jnp.maximum(q - 1, 0)]))
    def _():
        for cp in copies(load):
            cp.wait()
        start(load + nb - 1)

    return [buf.at[pl.ds(jax.lax.rem(load, nb), 1)] for buf in bufs]


def _kernel(block: MoEBlock, p: PallasGemvParams, nFs: int, streams, *refs):
    # streams: (block shape, (e, j) → block index) of each weight stream
    """One grid step (c, j, p) (module doc). refs: the scalars, x, the weight streams (blocks, or HBM for
    stream="dma"), [biases], out, [the DMA buffers and semaphores]."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    lay, fp8, dma = block.layout, block.weight_format.quantized, p.stream == "dma"
    refs = list(refs)
    scal = [refs.pop(0) for _ in range(RUNS + 1 if dma else S_OUT + 1)]
    x_ref = refs.pop(0)
    tiles = [refs.pop(0) for _ in streams]
    biases = [refs.pop(0) for _ in range(2 if lay.interleaved else 3)] if lay.has_bias else None
    out_ref = refs.pop(0)
    if dma:
        hbm = [(ref, shape, index) for ref, (shape, index) in zip(tiles, streams, strict=True)]
        tiles = _dma_tiles(p, nFs, scal, hbm, refs[:-1], refs[-1])
    n_gu = 1 if lay.interleaved else 2
    gu_refs, dn_ref = tiles[:n_gu], tiles[n_gu]
    gu_s, dn_s = (tiles[n_gu + 1:2 * n_gu + 1], tiles[2 * n_gu + 1]) if fp8 else ([None] * n_gu, None)

    jj, q = pl.program_id(1), pl.program_id(2)
    j = pl.program_id(0) * nFs + jj
    s_out = scal[S_OUT][q]

    @pl.when((jj == 0) & (q == 0))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    cdt = x_ref.dtype
    x = x_ref[0]  # [1, D]
    if block.weight_application == "input":
        x = (x.astype(jnp.float32) * scal[S_IN][q]).astype(cdt)
    gu_contract = 0 if lay.transposed else 1
    parts = [_project(x, r, s, gu_contract, cdt) for r, s in zip(gu_refs, gu_s, strict=True)]
    if lay.has_bias:
        parts = [g + b[0].astype(jnp.float32) for g, b in zip(parts, biases[:-1], strict=True)]
    if lay.interleaved:  # [1, 2BF] interleaved → gate, up [1, BF]
        bf = parts[0].shape[1] // 2
        parts = [_dot(parts[0], _select(bf, o), 0) for o in (0, 1)]
    h = gated(block, *parts).astype(cdt)  # [1, BF]
    y = _project(h, dn_ref, dn_s, 0 if lay.transposed else 1, cdt) * s_out  # [1, D]
    t = scal[TOK][q]
    out_ref[0, pl.ds(t, 1), :] += y

    if lay.has_bias:
        @pl.when(j == 0)
        def _():
            out_ref[0, pl.ds(t, 1), :] += biases[-1][0].astype(jnp.float32) * s_out


def _scale_tiles(block: MoEBlock, p: PallasGemvParams, w: JaxExperts):
    """The FP8 scales as the kernel's blocks read them (fp8_block weights are stored standard, halves, no
    bias: the IR's rule): gate_up [E, 2F/BF, BF/128, D/128] (a reshape), down [E, F/BF, D/128, BF/128]."""
    import jax.numpy as jnp

    E, D, F, BF = block.E, block.D, block.F, p.block_f
    gs = w.gate_up_scale.astype(jnp.float32).reshape(E, 2 * F // BF, BF // LANE, D // LANE)
    ds = jnp.swapaxes(w.down_scale.astype(jnp.float32).reshape(E, D // LANE, F // BF, BF // LANE), 1, 2)
    return [gs, gs], ds


def pair_scalars(block: MoEBlock, ids, weights):
    """(eid, tok, s_in, s_out) [P] of the pairs sorted by expert, sentinels last (module doc)."""
    import jax.numpy as jnp

    E, k = block.E, block.k
    flat = ids.reshape(-1).astype(jnp.int32)  # [P]
    valid = (flat >= 0) & (flat < E)
    key = jnp.where(valid, flat, E)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    skey = key[order]
    ok = skey < E
    last = jnp.maximum(jnp.max(jnp.where(valid, flat, 0)), 0)  # the last valid pair's expert after sorting
    eid = jnp.where(ok, skey, last).astype(jnp.int32)
    wt = jnp.where(ok, weights.reshape(-1).astype(jnp.float32)[order], 0.0)
    if block.weight_application == "input":
        s_in, s_out = wt, ok.astype(jnp.float32)
    else:
        s_in, s_out = jnp.ones_like(wt), wt
    return eid, (order // k).astype(jnp.int32), s_in, s_out


def runs_of(eid):
    """(run [P], run_e [P], runs [1]) int32 of sorted expert ids: each pair's run of one expert, each run's
    expert (the first `runs` entries) and their count (stream="dma"'s loads)."""
    import jax.numpy as jnp

    first = jnp.concatenate([jnp.ones((1,), bool), eid[1:] != eid[:-1]])
    run = (jnp.cumsum(first) - 1).astype(jnp.int32)
    run_e = jnp.zeros_like(eid).at[run].set(eid)
    return run, run_e, (run[-1:] + 1).astype(jnp.int32)


def pallas_gemv(block: MoEBlock, p: PallasGemvParams, eid, tok, s_in, s_out, x, w: JaxExperts, *,
                interpret_mode=None):
    """The pallas_call: f32 [split, T, D] partial outputs of T ≤ block_t tokens x [T, D] from the pairs'
    scalars (pair_scalars); eid must lie in [0, E) (the TPU reads what the index maps say)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    T, D = x.shape
    P = eid.shape[0]
    nFs = block.F // (p.block_f * p.split)
    dma = p.stream == "dma"
    streams = _streams(block, p, w)
    biases = _biases(block, p, w) if block.layout.has_bias else []

    def at(index):  # a BlockSpec index map of (e, j) → block, e the pair's expert
        return lambda c, jj, q, *s: index(s[EID][q], c * nFs + jj)

    x_spec = pl.BlockSpec((1, 1, D), lambda c, jj, q, *s: (s[TOK][q], 0, 0))
    if dma:
        w_specs = [pl.BlockSpec(memory_space=pl.ANY) for _ in streams]
        scratch = [pltpu.VMEM((p.buffers, *shape[1:]), a.dtype) for a, shape, _ in streams]  # [buffers, tile]
        scratch.append(pltpu.SemaphoreType.DMA((len(streams), p.buffers)))
    else:
        w_specs = [pl.BlockSpec(shape, at(index)) for _, shape, index in streams]
        scratch = []
    scalars = [eid, tok, s_in, s_out, *(runs_of(eid) if dma else ())]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(p.split, nFs, P),
        in_specs=[x_spec, *w_specs, *(pl.BlockSpec(shape, at(index)) for _, shape, index in biases)],
        out_specs=pl.BlockSpec((1, T, D), lambda c, jj, q, *s: (c, 0, 0)),
        scratch_shapes=scratch,
    )
    call = pl.pallas_call(
        partial(_kernel, block, p, nFs, [(shape, index) for _, shape, index in streams]),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((p.split, T, D), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit(block, p)),
        interpret=interpret() if interpret_mode is None else interpret_mode,
    )
    return call(*scalars, x.reshape(T, 1, D), *(a for a, _, _ in streams), *(a for a, _, _ in biases))


def build_jax(block: MoEBlock, schedule: Schedule, *, interpret_mode=None):
    """JaxExpertsFn of a stream_gemv schedule (params: PallasGemvParams); `interpret_mode` overrides the
    pallas_call's interpret= (False: the TPU kernel, e.g. to lower it for TPU on another machine)."""
    p = schedule.params
    fp8 = block.weight_format.quantized
    _check_block(block, fp8)
    if block.F % (p.block_f * p.split):
        raise UnsupportedSchedule(f"pallas_tpu stream_gemv: F = {block.F} is not a multiple of block_f · split "
                                  f"= {p.block_f * p.split}")

    def call(x, ids, weights, w):  # ≤ block_t tokens → [T, D] float32
        return pallas_gemv(block, p, *pair_scalars(block, ids, weights), x, w,
                           interpret_mode=interpret_mode).sum(axis=0)

    def fn(x, ids, weights, w: JaxExperts):
        import jax
        import jax.numpy as jnp

        T, D = x.shape
        n, rest = divmod(T, p.block_t)
        outs = []
        if n:  # whole calls of block_t tokens, one traced kernel scanned over them
            m = n * p.block_t
            chunks = (x[:m].reshape(n, p.block_t, D), ids[:m].reshape(n, p.block_t, -1),
                      weights[:m].reshape(n, p.block_t, -1))
            outs.append(jax.lax.map(lambda c: call(*c, w), chunks).reshape(m, D))
        if rest:
            outs.append(call(x[T - rest:], ids[T - rest:], weights[T - rest:], w))
        if not outs:
            return jnp.zeros_like(x)
        return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)).astype(x.dtype)

    return fn


def build(block: MoEBlock, schedule: Schedule):
    """ExpertsFn of a stream_gemv schedule: build_jax's function behind the torch bridge."""
    return bridged(block, build_jax(block, schedule))


KIND = KernelKind("stream_gemv", PallasGemvParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, formats=("none",), build_jax=build_jax)
