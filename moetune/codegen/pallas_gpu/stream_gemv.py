"""stream_gemv on NVIDIA GPUs: Pallas kernels lowered through Pallas' Triton backend, one program per
(token, expert) pair and output tile; weights streamed from HBM in [BN, BK] tiles, no padding rows.

Two launches:
  gate/up  grid (P, F/BN), P = T·k pairs: program (p, j) reads token t = p // k's row x [D] and expert
           e = ids[p]'s gate and up rows n0 = j·BN .. n0+BN in a pipelined K loop of BK-wide chunks
           (FMA and a row sum per chunk: a GEMV has no dot-sized operand), adds the biases, applies the
           routing weight when it goes on the input (w·(W x) = W (w·x)), fuses the activation:
           h [P, F] in x.dtype. A pair with an id outside [0, E) reads nothing and writes zeros.
  down     grid (T, D/BN_d): program (t, j) sums over the token's k pairs down[e] rows n0 .. n0+BN_d · h[p]
           (× routing weight when it goes on the output, put on h: w·(W h) = W (w·h)), + bias, and writes
           out[t, n0:n0+BN_d] in the output's dtype directly: no atomics and no combine pass, deterministic.
           The pairs go G at a time (down_pairs): one masked [G, BN_d, BK_d] load of G experts' tiles per
           chunk (G weight streams in flight), and one pipelined loop over the ⌈k/G⌉ groups' chunks of F (the
           group's ids selected in registers, no load in the loop's address path). A sentinel pair's lane, and
           a lane past k, is masked: it reads nothing and contributes nothing.
An expert shared by several pairs is re-read per pair: this is the decode kernel (about one row per active
expert); many rows per expert are the grouped GEMM's (grouped_gemm.py).

The same kernels read FP8 block-quantised weights with their scales (stream_gemv_fp8.py: the tile's row
sums times its block's multiplier), as uint32 words of four e4m3 values (_common.py's packed_e4m3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...targets import Target
from ..contract import KernelKind, sources
from ..pallas_tpu._common import bridged
from ..space import ParamSpace
from ..tiles import make
from ._common import (
    REG_ELEMS,
    activate,
    check_divides,
    check_pow2,
    compiler_params,
    expert_rows,
    expert_tiles,
    gate_up_bias,
    gate_up_scales,
    gate_up_slices,
    gate_up_tiles,
    interpret,
    packed_e4m3,
    packed_pairs_dot,
    packed_rows_dot,
    pair_down_scales,
    pair_expert,
    pow2_at_least,
    refusal,
    refuse,
    row_index,
    token_pairs,
    trailing_refs,
)
from .tiles import tiles

SOURCES = ("stream_gemv.py", "tiles.py", "_common.py")


@dataclass(frozen=True)
class GemvParams:
    block_n: int = 16  # gate/up output rows (of F) per program
    block_k: int = 256  # gate/up reduction chunk (of D)
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of both K loops
    down_block_n: int = 16  # down output rows (of D) per program
    down_block_k: int = 256  # down reduction chunk (of F)
    down_warps: int = 4
    down_pairs: int = 1  # down: the token's pairs whose tiles one chunk loads together (k in ⌈k/G⌉ groups)

    def __post_init__(self) -> None:
        check_pow2("GemvParams", block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps,
                   down_block_n=self.down_block_n, down_block_k=self.down_block_k, down_warps=self.down_warps,
                   down_pairs=self.down_pairs)
        check_registers("gate/up", 1, self.block_n, self.block_k, self.num_warps)
        check_registers("down", self.down_pairs, self.down_block_n, self.down_block_k, self.down_warps)
        if self.num_stages < 1:
            raise UnsupportedSchedule(f"GemvParams.num_stages = {self.num_stages}: need ≥ 1")


def check_registers(what: str, lanes: int, bn: int, bk: int, warps: int) -> None:
    """UnsupportedSchedule where a chunk's `lanes`·bn·bk weight elements exceed REG_ELEMS a thread."""
    if lanes * bn * bk > REG_ELEMS * 32 * warps:
        tile = f"{lanes}×{bn}×{bk}" if lanes > 1 else f"{bn}×{bk}"
        raise UnsupportedSchedule(
            f"GemvParams {what} tile {tile} over {warps} warps: {lanes * bn * bk // (32 * warps)} elements per "
            f"thread, limit {REG_ELEMS}; lower the tile or raise the warps")


CHOICES = (
    ("block_n", (4, 8, 16, 32, 64)),
    ("block_k", (16, 32, 64, 128, 256, 512)),
    ("num_warps", (2, 4, 8)),
    ("num_stages", (1, 2, 3, 4)),
    ("down_block_n", (4, 8, 16, 32, 64)),
    ("down_block_k", (16, 32, 64, 128, 256, 512, 1024)),
    ("down_warps", (2, 4, 8)),
    ("down_pairs", (1, 2, 4, 8, 16)),
)


def check(p: GemvParams, block: MoEBlock) -> None:
    """The block must be one these kernels run, the tiles must divide the axes they walk (no masked loads), and
    a down group holds no more lanes than the k pairs rounded up to a power of two."""
    refuse(block)
    if p.down_pairs > pow2_at_least(block.k):
        raise UnsupportedSchedule(f"GemvParams.down_pairs = {p.down_pairs}: more than the k = {block.k} pairs of a "
                                  f"token rounded up to a power of two ({pow2_at_least(block.k)})")
    check_divides(f"pallas_gpu stream_gemv on D={block.D}, F={block.F}", block_n=(p.block_n, block.F),
                  block_k=(p.block_k, block.D), down_block_n=(p.down_block_n, block.D),
                  down_block_k=(p.down_block_k, block.F))


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(GemvParams, CHOICES, check=partial(check, block=block))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> GemvParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(GemvParams, tiles("stream_gemv", block, T, target, constraints))


def _gate_up_kernel(block: MoEBlock, p: GemvParams, ids_ref, wts_ref, x_ref, w_ref, *rest):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    b_ref, s_ref, h_ref = trailing_refs(block, rest)
    BN, BK, tr = p.block_n, p.block_k, block.layout.transposed
    pair, j = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * BN, BN)
    e, valid = pair_expert(ids_ref, pair, block.E)
    t = pair // block.k

    @pl.when(valid)
    def _():
        def step(i, acc):
            k0 = pl.multiple_of(i * BK, BK)
            if s_ref is not None:  # packed e4m3 words; the tile lies in one scale block of each half
                gs, us = gate_up_slices(block, n0, BN)
                sg, su = gate_up_scales(block, s_ref, e, n0, k0)
                dg = packed_rows_dot(w_ref, e, gs, x_ref, t, k0, BK) * sg
                du = packed_rows_dot(w_ref, e, us, x_ref, t, k0, BK) * su
                return acc[0] + dg, acc[1] + du
            xv = x_ref[t, pl.ds(k0, BK)].astype(jnp.float32)  # [BK]
            g, u = gate_up_tiles(block, w_ref, e, n0, k0, BN, BK)
            if tr:  # [BK, BN]
                dg, du = jnp.sum(g * xv[:, None], axis=0), jnp.sum(u * xv[:, None], axis=0)
            else:
                dg, du = jnp.sum(g * xv[None, :], axis=1), jnp.sum(u * xv[None, :], axis=1)
            return acc[0] + dg, acc[1] + du

        zero = jnp.zeros((BN,), jnp.float32)
        g, u = jax.lax.fori_loop(0, block.D // BK, step, (zero, zero))
        if block.weight_application == "input":
            wt = wts_ref[pair].astype(jnp.float32)
            g, u = g * wt, u * wt
        if b_ref is not None:
            bg, bu = gate_up_bias(block, b_ref, e, n0, BN)
            g, u = g + bg, u + bu
        h_ref[pair, pl.ds(n0, BN)] = activate(block, g, u).astype(h_ref.dtype)

    @pl.when(jnp.logical_not(valid))
    def _():
        h_ref[pair, pl.ds(n0, BN)] = jnp.zeros((BN,), h_ref.dtype)


def _down_kernel(block: MoEBlock, p: GemvParams, ids_ref, wts_ref, h_ref, w_ref, *rest):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    b_ref, s_ref, o_ref = trailing_refs(block, rest)
    BN, BK, G, tr = p.down_block_n, p.down_block_k, p.down_pairs, block.layout.transposed
    t, j = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * BN, BN)
    NK = block.F // BK
    groups = [token_pairs(ids_ref, t, block.k, block.E, g * G, G) for g in range(-(-block.k // G))]
    out_w = block.weight_application == "output"
    wts = [jnp.where(ok, wts_ref[pairs].astype(jnp.float32), 0.0) if out_w else None for pairs, _, ok in groups]

    def group(g):  # (pairs, experts, valid, routing weights) [G] of group g (traced): selected, not loaded
        sel = (*groups[0], wts[0])
        for gg in range(1, len(groups)):
            sel = tuple(None if old is None else jnp.where(g == gg, new, old)
                        for new, old in zip((*groups[gg], wts[gg]), sel, strict=True))
        return sel

    def step(i, acc):  # acc [G, BN]; iteration i: group i // NK, chunk i % NK (i ≥ 0: truncating division)
        nk = jnp.int32(NK)
        pairs, e, ok, wt = group(jax.lax.div(i, nk))
        k0 = pl.multiple_of(jax.lax.rem(i, nk) * BK, BK)
        if s_ref is not None:  # packed e4m3 words, one scale block per tile
            d = packed_pairs_dot(w_ref, e, ok, n0, BN, h_ref, pairs, k0, BK)
            d = d * pair_down_scales(block, s_ref, e, n0, k0)[:, None]
            return acc + (d * wt[:, None] if out_w else d)
        hv = h_ref[row_index(pairs, k0, BK)].astype(jnp.float32)  # [G, BK]
        if out_w:  # w·(W h) = W (w·h)
            hv = hv * wt[:, None]
        if tr:  # [G, BK, BN]
            wv = expert_tiles(w_ref, e, ok, k0, BK, n0, BN).astype(jnp.float32)
            return acc + jnp.sum(wv * hv[:, :, None], axis=1)
        wv = expert_tiles(w_ref, e, ok, n0, BN, k0, BK).astype(jnp.float32)  # [G, BN, BK]
        return acc + jnp.sum(wv * hv[:, None, :], axis=2)

    y = jax.lax.fori_loop(0, len(groups) * NK, step, jnp.zeros((G, BN), jnp.float32))
    if b_ref is not None:
        for (_, e, ok), wt in zip(groups, wts, strict=True):
            b = expert_rows(b_ref, e, ok, n0, BN).astype(jnp.float32)
            y = y + (b * wt[:, None] if out_w else b)
    o_ref[t, pl.ds(n0, BN)] = jnp.sum(y, axis=0).astype(o_ref.dtype)


def experts(block: MoEBlock, p: GemvParams, x, ids, weights, w, out_dtype):
    """[T, D] in `out_dtype` of the routed experts (the two launches of the module doc)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    T, P = x.shape[0], x.shape[0] * block.k
    ids_f = ids.reshape(P).astype(jnp.int32)  # [P]
    wts_f = weights.reshape(P)  # [P]
    gu_extra = [t for t in (w.gate_up_bias, w.gate_up_scale) if t is not None]  # as `trailing_refs` unpacks them
    dn_extra = [t for t in (w.down_bias, w.down_scale) if t is not None]
    gate_up, down = w.gate_up, w.down
    if block.weight_format.quantized:  # uint32 words of four e4m3 values (module doc of _common.py)
        gate_up, down = packed_e4m3(gate_up), packed_e4m3(down)
    interp = interpret()
    h = pl.pallas_call(
        partial(_gate_up_kernel, block, p),
        out_shape=jax.ShapeDtypeStruct((P, block.F), x.dtype), grid=(P, block.F // p.block_n),
        compiler_params=compiler_params(p.num_warps, p.num_stages), interpret=interp,
        name="moetune_gemv_gate_up",
    )(ids_f, wts_f, x, gate_up, *gu_extra)  # [P, F]
    return pl.pallas_call(
        partial(_down_kernel, block, p),
        out_shape=jax.ShapeDtypeStruct((T, block.D), out_dtype), grid=(T, block.D // p.down_block_n),
        compiler_params=compiler_params(p.down_warps, p.num_stages), interpret=interp,
        name="moetune_gemv_down",
    )(ids_f, wts_f, h, down, *dn_extra)  # [T, D]


def build_jax(block: MoEBlock, schedule: Schedule):
    """JaxExpertsFn of a stream_gemv schedule (params: GemvParams)."""
    p = schedule.params
    check(p, block)

    def fn(x, ids, weights, w):
        return experts(block, p, x, ids, weights, w, x.dtype)

    return fn


def build(block: MoEBlock, schedule: Schedule):
    return bridged(block, build_jax(block, schedule))


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): every pair reads its expert's weights (a shared expert once per pair), its x row, h out
    and back, and the f32 output."""
    P = tokens * block.k
    wb = 4 if block.weight_dtype == "float32" else 2
    flops = 2.0 * 3 * P * block.D * block.F
    by = P * block.weight_bytes_per_expert + P * block.D * wb + 2 * P * block.F * wb + tokens * block.D * 4
    return flops, float(by)


KIND = KernelKind("stream_gemv", GemvParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, build_jax=build_jax)
