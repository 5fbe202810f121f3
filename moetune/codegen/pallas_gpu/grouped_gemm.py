"""grouped_gemm on NVIDIA GPUs: expert-sorted rows in tiles of BM rows, Pallas kernels lowered through
Pallas' Triton backend with `pl.dot` (tensor cores) over [BM, BK] × [BK, BN] tiles.

In the jitted function, on the device (routing.py, one or two small launches):
  tiles           the pairs sorted by expert (stable; ids outside [0, E) dropped), each expert's rows split into
                  ⌈c_e/BM⌉ tiles of BM rows; NT = ⌈P/BM⌉ + min(E, P) tiles bound every routing (static grid);
                  tile i → (expert, valid rows), empty tiles skipped
  rows [NT·BM]    the token, pair and routing weight of padded row r (0 past the tile's valid rows)
Then two launches over grid (NT, N/BN):
  gate/up  acc_g, acc_u [BM, BN] = Σ_K x[row_tok] tile (the tile's rows gathered from x in place: no padded
           copy of x) · gate/up tile (f32 accumulators), + bias, routing weight on the input scales the
           accumulators (w·(W x) = W (w·x)), activation: h_pad [NT·BM, F] in x.dtype (rows past a tile's
           valid ones hold what token 0 gives; nothing reads them)
  down     acc [BM, BN] = Σ_F h_pad tile · down tile, + bias, × routing weight on the output; each valid row
           stored to its pair's row of y [P + BM, D] f32 (a masked scatter: the padded rows are never written;
           their masked lanes aim at BM spare rows past P, one each, so no two lanes of a store share a row,
           which Pallas' interpreter needs as it writes masked lanes back)
Combine (JAX): y[:P].reshape(T, k, D) summed over k, sentinel pairs' rows (never written) as zeros
(deterministic: a fixed order, no atomics).

The same kernels read FP8 block-quantised weights (grouped_gemm_fp8.py, w8a16): uint32 words of four e4m3
values (_common.py's packed_e4m3) widened in registers to the activations' dtype, four dots per K step, each
K step within one scale block column, its [BM, BN] partial times the tile's block multiplier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from math import gcd
from typing import Any

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...passes.stats import uniform_distinct
from ...targets import Target
from ..contract import KernelKind, sources
from ..pallas_tpu._common import bridged
from ..space import ParamSpace
from ..tiles import make
from . import routing
from ._common import (
    MIN_TILE,
    activate,
    check_divides,
    check_pow2,
    compiler_params,
    down_scale,
    down_tile,
    dtype_precision,
    gate_up_bias,
    gate_up_scales,
    gate_up_slices,
    gate_up_tiles,
    interpret,
    packed_e4m3,
    packed_tile_dot,
    refusal,
    refuse,
    row_index,
    trailing_refs,
)
from .tiles import tiles

SOURCES = ("grouped_gemm.py", "tiles.py", "routing.py", "_common.py")


@dataclass(frozen=True)
class GemmParams:
    block_m: int = 64  # rows per tile (padded per expert)
    block_n: int = 64  # output columns per program (F for gate/up, D for down)
    block_k: int = 64  # reduction chunk (D for gate/up, F for down)
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of both K loops

    def __post_init__(self) -> None:
        check_pow2("GemmParams", block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                   num_warps=self.num_warps)
        small = [f"{n} = {v}" for n, v in (("block_m", self.block_m), ("block_n", self.block_n),
                                          ("block_k", self.block_k)) if v < MIN_TILE]
        if small:
            raise UnsupportedSchedule(f"GemmParams: {', '.join(small)} below the dot's {MIN_TILE}")
        if self.num_stages < 1:
            raise UnsupportedSchedule(f"GemmParams.num_stages = {self.num_stages}: need ≥ 1")


CHOICES = (
    ("block_m", (16, 32, 64, 128)),
    ("block_n", (16, 32, 64, 128, 256)),
    ("block_k", (16, 32, 64, 128)),
    ("num_warps", (4, 8)),
    ("num_stages", (2, 3, 4)),
)


def smem_bytes(p: GemmParams, elem: int = 2) -> int:
    """Shared memory of the gate/up loop: `num_stages` copies of the x tile and the gate and up tiles."""
    return p.num_stages * (p.block_m * p.block_k + 2 * p.block_k * p.block_n) * elem


def check(p: GemmParams, block: MoEBlock, target: Target | None) -> None:
    """The tiles must divide D and F (both projections walk both); the gate/up pipeline must fit the shared
    memory of one block on `target` (None: the divisibility alone). Blocks these kernels refuse raise first."""
    refuse(block)
    check_divides(f"pallas_gpu grouped_gemm on D={block.D}, F={block.F} (gcd {gcd(block.D, block.F)})",
                  block_n=(p.block_n, gcd(block.D, block.F)), block_k=(p.block_k, gcd(block.D, block.F)))
    need, limit = smem_bytes(p), target.smem_per_block if target is not None else None
    if limit is not None and need > limit:
        raise UnsupportedSchedule(f"GemmParams {p.block_m}×{p.block_n}×{p.block_k}, {p.num_stages} stages: needs "
                                  f"{need // 1024} KiB shared memory, limit {limit // 1024} KiB on {target.name}; "
                                  "lower block_k or num_stages")


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(GemmParams, CHOICES, check=partial(check, block=block, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> GemmParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(GemmParams, tiles("grouped_gemm", block, T, target, constraints))


def _gate_up_kernel(block: MoEBlock, p: GemmParams, te_ref, rows_ref, rw_ref, tok_ref, x_ref, w_ref, *rest):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b_ref, s_ref, h_ref = trailing_refs(block, rest)
    BM, BN, BK, tr = p.block_m, p.block_n, p.block_k, block.layout.transposed
    i, j = pl.program_id(0), pl.program_id(1)
    r0, n0 = pl.multiple_of(i * BM, BM), pl.multiple_of(j * BN, BN)
    e = te_ref[i]
    prec = dtype_precision(x_ref.dtype)

    @pl.when(rows_ref[i] > 0)
    def _():
        tok = tok_ref[pl.ds(r0, BM)]  # [BM] the x row of each of the tile's rows

        def step(kk, acc):
            k0 = pl.multiple_of(kk * BK, BK)
            if s_ref is not None:  # packed e4m3 words; the K step lies in one scale block column of each half
                gs, us = gate_up_slices(block, n0, BN)
                sg, su = gate_up_scales(block, s_ref, e, n0, k0)
                return (acc[0] + packed_tile_dot(w_ref, e, gs, x_ref, tok, k0, BK) * sg,
                        acc[1] + packed_tile_dot(w_ref, e, us, x_ref, tok, k0, BK) * su)
            xv = x_ref[row_index(tok, k0, BK)]  # [BM, BK]
            g, u = gate_up_tiles(block, w_ref, e, n0, k0, BN, BK)
            g, u = g.astype(xv.dtype), u.astype(xv.dtype)
            return (acc[0] + plgpu.dot(xv, g, trans_b=not tr, precision=prec),
                    acc[1] + plgpu.dot(xv, u, trans_b=not tr, precision=prec))

        zero = jnp.zeros((BM, BN), jnp.float32)
        g, u = jax.lax.fori_loop(0, block.D // BK, step, (zero, zero))  # [BM, BN] each
        if block.weight_application == "input":
            wt = rw_ref[pl.ds(r0, BM)][:, None]
            g, u = g * wt, u * wt
        if b_ref is not None:
            bg, bu = gate_up_bias(block, b_ref, e, n0, BN)
            g, u = g + bg[None, :], u + bu[None, :]
        h_ref[pl.ds(r0, BM), pl.ds(n0, BN)] = activate(block, g, u).astype(h_ref.dtype)


def _down_kernel(block: MoEBlock, p: GemmParams, te_ref, rows_ref, rw_ref, pair_ref, h_ref, w_ref, *rest):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b_ref, s_ref, y_ref = trailing_refs(block, rest)
    BM, BN, BK, tr = p.block_m, p.block_n, p.block_k, block.layout.transposed
    i, j = pl.program_id(0), pl.program_id(1)
    r0, n0 = pl.multiple_of(i * BM, BM), pl.multiple_of(j * BN, BN)
    e = te_ref[i]
    prec = dtype_precision(h_ref.dtype)

    @pl.when(rows_ref[i] > 0)
    def _():
        def step(kk, acc):
            k0 = pl.multiple_of(kk * BK, BK)
            if s_ref is not None:  # packed e4m3 words, one scale block per [BN, BK] tile
                d = packed_tile_dot(w_ref, e, pl.ds(n0, BN), h_ref, pl.ds(r0, BM), k0, BK)
                return acc + d * down_scale(block, s_ref, e, n0, k0)
            hv = h_ref[pl.ds(r0, BM), pl.ds(k0, BK)]  # [BM, BK]
            wv = down_tile(w_ref, e, n0, k0, BN, BK, tr).astype(hv.dtype)
            return acc + plgpu.dot(hv, wv, trans_b=not tr, precision=prec)

        y = jax.lax.fori_loop(0, block.F // BK, step, jnp.zeros((BM, BN), jnp.float32))  # [BM, BN]
        if b_ref is not None:
            y = y + b_ref[e, pl.ds(n0, BN)].astype(jnp.float32)[None, :]
        if block.weight_application == "output":
            y = y * rw_ref[pl.ds(r0, BM)][:, None]
        m = jax.lax.broadcasted_iota(jnp.int32, (BM,), 0)
        valid = m < rows_ref[i]  # the tile's valid rows; the others aim at the spare rows P + m, each its own
        dest = jnp.where(valid, pair_ref[pl.ds(r0, BM)], y_ref.shape[0] - BM + m)
        plgpu.store(y_ref.at[row_index(dest, n0, BN)], y, mask=jnp.broadcast_to(valid[:, None], (BM, BN)))


def experts_f32(block: MoEBlock, p: GemmParams, x, ids, weights, w):
    """float32 [T, D] of the routed experts (the plan, the two launches and the combine of the module doc)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    T, P, BM = x.shape[0], x.shape[0] * block.k, p.block_m
    ids_f = ids.reshape(P).astype(jnp.int32)
    plan = routing.plan(ids_f, weights.reshape(P), block.E, block.k, BM)
    NT = routing.num_tiles(P, block.E, BM)  # the plan's tiles past NT hold no rows
    R = NT * BM
    gub = [t for t in (w.gate_up_bias, w.gate_up_scale) if t is not None]  # as `trailing_refs` unpacks them
    dnb = [t for t in (w.down_bias, w.down_scale) if t is not None]
    gate_up, down = w.gate_up, w.down
    if block.weight_format.quantized:  # uint32 words of four e4m3 values (module doc of _common.py)
        gate_up, down = packed_e4m3(gate_up), packed_e4m3(down)
    interp = interpret()
    params = compiler_params(p.num_warps, p.num_stages)
    h_pad = pl.pallas_call(
        partial(_gate_up_kernel, block, p),
        out_shape=jax.ShapeDtypeStruct((R, block.F), x.dtype), grid=(NT, block.F // p.block_n),
        compiler_params=params, interpret=interp, name="moetune_gemm_gate_up",
    )(plan.tile_expert, plan.tile_rows, plan.row_weight, plan.row_tok, x, gate_up, *gub)  # [R, F]
    y = pl.pallas_call(
        partial(_down_kernel, block, p),
        out_shape=jax.ShapeDtypeStruct((P + BM, block.D), jnp.float32), grid=(NT, block.D // p.block_n),
        compiler_params=params, interpret=interp, name="moetune_gemm_down",
    )(plan.tile_expert, plan.tile_rows, plan.row_weight, plan.row_pair, h_pad, down, *dnb)  # [P + BM, D]
    valid = (ids_f >= 0) & (ids_f < block.E)
    y = jnp.where(valid[:, None], y[:P], 0.0)  # a sentinel pair's row was never written
    return y.reshape(T, block.k, block.D).sum(axis=1)


def build_jax(block: MoEBlock, schedule: Schedule):
    """JaxExpertsFn of a grouped_gemm schedule (params: GemmParams)."""
    p = schedule.params
    check(p, block, None)

    def fn(x, ids, weights, w):
        return experts_f32(block, p, x, ids, weights, w).astype(x.dtype)

    return fn


def build(block: MoEBlock, schedule: Schedule):
    return bridged(block, build_jax(block, schedule))


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): the padded tiles' products; each tile reads its expert's weights (an expert of several
    tiles is re-read per tile) and its x rows, writes and reads the padded h, and the f32 y rows of the pairs."""
    p = schedule.params
    P = tokens * block.k
    wb = 4 if block.weight_dtype == "float32" else 2
    distinct = uniform_distinct(block.E, block.k, tokens)
    tiles = -(-P // p.block_m) + distinct  # about Σ_e ⌈c_e/BM⌉
    rows = tiles * p.block_m
    flops = 2.0 * 3 * rows * block.D * block.F
    by = (tiles * block.weight_bytes_per_expert + rows * (block.D * wb + 2 * block.F * wb) + P * 2 * block.D * 4
          + tokens * block.D * wb)
    return flops, float(by)


KIND = KernelKind("grouped_gemm", GemmParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, build_jax=build_jax)
