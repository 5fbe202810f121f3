"""grouped_gemm for FP8 block-quantised expert weights (scheme fp8_block): expert-sorted rows in BLOCK_M
tiles through tl.dot, the weights read as e4m3 bytes with their per-block scales.

The structure is grouped_gemm.py's pointer path: routing.py's `counts` and `sorted_pairs`, tile t of expert
e over sorted rows [t·BM, t·BM + BM) found by `_find_tile`, a static grid of `max_tiles` tiles × column
blocks in grouped order (`_grouped_tile`, GROUP_M tiles per column-block sweep), two projections of one
kernel (PROJ 0 gate/up + activation → h [P, F]; PROJ 1 down → rows y [S, P, D] with the routing weight),
then combine.py sums the S planes and the k rows of each token in fp32.

Block scales (moetune.codegen.quant): w[n, k] = q[n, k] · s_w[n // R, k // C] for a weight block (R, C) =
(rows, cols) of the [N, K] matrix (gate_up: N = 2F over K = D, the up half's scale rows F/R after the gate's;
down: N = D over K = F). Each dot of a K step takes KS = min(BK, C, G) columns inside one block column, so it
has one scale per column of the tile (one for the whole tile when its BN columns lie in one block row); a step
of BK > C columns is BK / KS such dots, their loads issued together, so that each weight row is read in runs
of BK bytes rather than C (`dot_k`):

    act_quant "none" (w8a16), fold_scale (default)
        acc = dot(a, bf16(q · s_w[n // R, k0 // C]), acc)     the e4m3 tile widened and scaled in registers,
                                                              rounded once to the activations' dtype; one
                                                              accumulator the tensor cores add into
    act_quant "none", fold_scale False
        acc += dot(a, bf16(q)) · s_w[n // R, k0 // C]          exact weights (e4m3 → bf16 is exact); each step's
                                                              fp32 product scaled, a second accumulator
    act_quant "fp8_1x<G>" (w8a8)
        acc += dot(q_a, q) · s_a[row, k0 // G] · s_w[n // R, k0 // C]    e4m3 × e4m3 on the FP8 tensor cores,
                                                              fp32 accumulation per step; BK divides G too

w8a8 activations follow `quant.quantize_rows` (per row, per G channels: s = amax / 448, q = x · (1 / s) rounded to
e4m3): x by a pre-pass (quant_rows.py, T rows: every pair of a token reads its token's row), h in the
gate/up epilogue, which holds whole G-column groups of each row (block_n a multiple of G): hq [P, F] e4m3 and
hs [P, F / G] fp32 in pair order; with h_pass, h stored by the gate/up GEMM in the activations' dtype and
quantised by the pre-pass's kernel over its P rows before the down GEMM (block_n free of G); or, with
quant_on_load, each 16-bit A tile (x, and h stored in the activations' dtype) quantised as it is loaded, per
row over each dot's G channels. Scales stored as ue8m0 are read as bytes and widened exactly (`_fp8._ue8m0`).

Operand paths, as grouped_gemm.py's: pointer (`grouped_gemm_fp8_kernel`: A gathered row by row, h and y in pair
order) and tma (`grouped_gemm_fp8_tma_kernel`, Fp8GemmParams.tma): the token rows first copied in expert order
(routing.gather: x in its 16-bit dtype, or the pre-pass's e4m3 rows), h written in that order, and every
operand one TMA box: A [row0, row0 + BM) of the sorted rows, B the e4m3 weights seen as [E·2F, D] / [E·D, F].
On both, a down program may walk several D-blocks in one loop (down_nb, `_tile_down_nb`).

With `pdl` (sm_90) the block's launches after the routing's first are a chain of programmatic dependent
launches (_common's module doc): every kernel releases the launch after it as it starts, but the gate/up GEMM,
which releases once its wait has passed; the x pre-pass reads only x, so it runs beside the routing and waits
for it at its end; the gather, the gate/up GEMM and the h pass wait first; a down program finds its tile (from the
routing, complete by then: gate/up released it after its wait) and waits for h only then, a combine program
reads its token's ids and waits for y. Each launch gap overlaps the end of the kernel before. The x pre-pass
writes before its wait, while the routing may still read its histograms: `hold` keeps the routing's scratch
alive until the combine is issued, so that no buffer of the chain takes a block the chain still reads.

Interpreted (TRITON_INTERPRET=1, EMULATE), where Triton's float → e4m3 and float → bf16 casts do not round to
nearest and its e4m3 → float cast widens the NaN bytes to ±480: e4m3 values are rounded in fp32 arithmetic
first (`_fp8._round_e4m3`, then cast exactly), the fold's bf16 rounding likewise (`_round_bf16`), and every dot
operand is widened to fp32 by `_widen_e4m3` (NaN kept) and multiplied in fp32: the exact products of the
values the GPU multiplies. On the GPU: the conversion instructions (round to nearest even, saturating to ±448)
and tensor-core dots on the 16-bit or e4m3 operands.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...passes.stats import uniform_distinct
from ...passes.targets import Target
from ..common import ExpertTensors, ParamSpace
from ..contract import KernelKind, sources
from ..quant import act_group
from ..tiles import make
from . import combine as _combine
from . import routing
from ._common import _act, _find_tile, _grid_release, _grid_wait, _store_y
from ._fp8 import _quant_groups, _round_bf16, _scale_of, _ue8m0, _widen_e4m3, block_scales
from .grouped_gemm import _desc, _grouped_tile, _nb_step, max_tiles
from .launch import launch, pdl_launch, programmatic
from .layout import act_args, call_args, cdiv, check_pow2, check_smem, interpreting
from .quant_rows import quant_rows
from .tiles import tiles

SCRATCH = 4096  # shared memory the compiled kernels take beyond their pipelines (reductions, layout changes)
SOURCES = ("grouped_gemm_fp8.py", "tiles.py", "_fp8.py", "quant_rows.py", "grouped_gemm.py", "_common.py", "layout.py",
           "routing.py", "combine.py", "launch.py")

@dataclass(frozen=True)
class Fp8GemmParams:
    block_m: int = 64
    block_n: int = 64  # gate/up: F columns per tile (two accumulators: gate and up)
    # K columns a pipelined step loads: a divisor of the weight block's columns (and of the activation group with
    # w8a8), or a multiple, its dots then one block column each (dot_k): a weight row read in longer runs
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int = 64  # down: D columns per tile
    down_block_k: int = 128
    down_warps: int = 4
    down_stages: int = 3
    split_k: int = 1  # down: F split in this many partial planes of y
    y_half: bool = False  # down: y rows in x's 16-bit dtype instead of fp32 (the sum over k stays fp32)
    act_quant: str = "none"  # "none": bf16 activations (w8a16); "fp8_1x128": e4m3 per 1×128 group (w8a8)
    # w8a16: the weight scales folded into the weight tile as it is widened (bf16(q · s), one accumulator the
    # tensor cores add into) instead of scaling each step's fp32 product (exact weights, a second accumulator)
    fold_scale: bool = True
    # w8a8: each A tile (x, and h in the activations' dtype) quantised as it is loaded, per row over each dot's
    # columns (block_k and down_block_k multiples of the group, each dot one group), instead of the x pre-pass
    # and h quantised in the gate/up epilogue: no pre-pass launch, no e4m3 copy of x, and block_n free of the group
    quant_on_load: bool = False
    # w8a8: h written by the gate/up GEMM in the activations' dtype and quantised by a pass of its own (the x
    # pre-pass's kernel over h's rows) before the down GEMM, instead of in the gate/up epilogue: block_n free of
    # the group, for one more launch and h's 16-bit round trip
    h_pass: bool = False
    # both operands of both GEMMs through TMA descriptors: the token rows first gathered in expert order
    # (routing.gather; w8a8 from the pre-pass: its e4m3 rows), h written in that order, the e4m3 weights as
    # [E·2F, D] / [E·D, F] boxes
    tma: bool = False
    # the block's kernels a chain of programmatic launches (sm_90, module doc): each starts while the one
    # before it ends, and waits for its output only where it reads it
    pdl: bool = False
    # a down program walks this many consecutive D-blocks in one pipelined loop (grouped_gemm.py's down_nb): at a
    # short reduction the next block's loads are issued while one block ends
    down_nb: int = 1

    def __post_init__(self) -> None:
        g = act_group(self.act_quant)
        check_pow2("Fp8GemmParams", block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                   down_block_n=self.down_block_n, down_block_k=self.down_block_k,
                   num_warps=self.num_warps, down_warps=self.down_warps, **({} if g is None else {"group": g}))
        least = 32 if g is not None else 16  # an FP8 tl.dot reduces at least 32 channels a step
        if not interpreting() and min(self.block_m, self.block_n, self.down_block_n) < 16:
            raise UnsupportedSchedule(f"Fp8GemmParams {self}: tl.dot needs every block ≥ 16")
        if not interpreting() and min(self.block_k, self.down_block_k) < least:
            raise UnsupportedSchedule(f"Fp8GemmParams block_k = {self.block_k} / down_block_k = "
                                      f"{self.down_block_k}: tl.dot on {self.act_quant} operands needs ≥ {least}")
        if g is None and self.quant_on_load:
            object.__setattr__(self, "quant_on_load", False)  # nothing to quantise: one spelling of each point
        if self.quant_on_load and (self.block_k % g or self.down_block_k % g):
            raise UnsupportedSchedule(f"Fp8GemmParams.quant_on_load: block_k = {self.block_k} and down_block_k = "
                                      f"{self.down_block_k} must each be a multiple of the activation group {g} "
                                      "(each dot quantises a whole group)")
        if (g is None or self.quant_on_load) and self.h_pass:
            object.__setattr__(self, "h_pass", False)  # no h quantised in the epilogue to move
        if g is not None and not self.quant_on_load and not self.h_pass and self.block_n % g:
            raise UnsupportedSchedule(f"Fp8GemmParams.block_n = {self.block_n} with act_quant {self.act_quant}: "
                                      f"the gate/up epilogue quantises h in whole groups of {g} columns; "
                                      f"raise block_n to a multiple of {g}, or quantise h in its own pass "
                                      "(h_pass)")
        if g is not None and not self.fold_scale:
            object.__setattr__(self, "fold_scale", True)  # w8a8 scales its products: one spelling of each point
        if self.split_k not in (1, 2, 4, 8):
            raise UnsupportedSchedule(f"Fp8GemmParams.split_k = {self.split_k}: 1, 2, 4 or 8")
        if self.group_m < 1:
            raise UnsupportedSchedule(f"Fp8GemmParams.group_m = {self.group_m}: must be ≥ 1")
        if self.down_nb not in (1, 2, 4, 8):
            raise UnsupportedSchedule(f"Fp8GemmParams.down_nb = {self.down_nb}: 1, 2, 4 or 8")


def refusal(block: MoEBlock) -> str | None:
    """Why these kernels cannot run `block` (None: they can): every matrix in whole scale blocks."""
    fmt = block.weight_format
    if fmt.scheme != "fp8_block":
        return f"grouped_gemm fp8 reads fp8_block weights, not {fmt}"
    r, c = fmt.block
    for name, n, what, b in (("F", block.F, "rows", r), ("D", block.D, "columns", c),
                             ("D", block.D, "rows", r), ("F", block.F, "columns", c)):
        if n % b:
            return (f"grouped_gemm fp8: {name} = {n} is not a multiple of the weight block's {what} ({b}); "
                    f"the kernels read whole {r}x{c} scale blocks")
    return None


def dot_k(block: MoEBlock, p: Fp8GemmParams, proj: int) -> int:
    """Columns of one dot of projection `proj`'s K step: the step itself, or, where it spans several weight
    block columns (or activation groups), one of them: each dot has its own scales."""
    c = block.weight_format.block[1]
    g = act_group(p.act_quant)
    return min(p.block_k if proj == 0 else p.down_block_k, c, g or c)


def _shape_refusal(block: MoEBlock, p: Fp8GemmParams) -> str | None:
    """What of `p` does not fit `block`'s scale blocks and activation group (None: all fits)."""
    why = refusal(block)
    if why:
        return why
    r, c = block.weight_format.block
    g = act_group(p.act_quant)
    for proj, name, bk, K in ((0, "block_k", p.block_k, block.D), (1, "down_block_k", p.down_block_k, block.F)):
        ks = dot_k(block, p, proj)
        if c % ks or bk % ks:
            return (f"Fp8GemmParams.{name} = {bk}: a K step must lie in one weight block column of {c} or cover "
                    f"whole ones; use a divisor or a multiple of {c}")
        if g is not None and g % ks:
            return (f"Fp8GemmParams.{name} = {bk}: a K step must lie in one activation group of {g} or cover "
                    f"whole ones; use a divisor or a multiple of {g}")
        if p.quant_on_load and ks != g:
            return (f"Fp8GemmParams.quant_on_load with act_quant {p.act_quant}: the weight block's {c} columns "
                    f"split an activation group of {g}; each dot quantises one whole group")
        if bk > ks and K % bk:
            return (f"Fp8GemmParams.{name} = {bk} spans {bk // ks} scale block columns: K = {K} is not a multiple "
                    f"of it; use {ks}")
    if g is not None:
        for name, n in (("D", block.D), ("F", block.F)):
            if n % g:
                return f"act_quant {p.act_quant}: {name} = {n} is not a multiple of the activation group {g}"
    return None


def smem_bytes(p: Fp8GemmParams, proj: int) -> int:
    """Shared memory of one projection's pipelined loop: `stages` copies of the A tile (1-byte e4m3 with
    w8a8 from the pre-pass, 2-byte otherwise) and of the e4m3 B tiles (gate and up, or down), with 16-bit
    activations one more B tile each (the compiled loop stages one as it widens it), and the epilogue's
    scratch; a down loop over several column blocks (down_nb) stages its y tile as well."""
    bn, bk, st, nb = ((p.block_n, p.block_k, p.num_stages, 2) if proj == 0
                      else (p.down_block_n, p.down_block_k, p.down_stages, 1))
    y_tile = p.block_m * bn * 4 if proj == 1 and p.down_nb > 1 else 0  # the store inside the loop stages it
    if p.act_quant == "none":
        return st * (p.block_m * bk * 2 + nb * bk * bn) + nb * bk * bn + y_tile + SCRATCH
    if p.quant_on_load:  # 16-bit A tiles in flight, the quantised one staged for the tensor cores
        return st * (p.block_m * bk * 2 + nb * bk * bn) + p.block_m * bk + y_tile + SCRATCH
    return st * (p.block_m * bk + nb * bk * bn) + y_tile + SCRATCH


def check(p: Fp8GemmParams, block: MoEBlock, target: Target) -> None:
    """What `block` or `target` cannot run: the scale blocks (`_shape_refusal`), then each GEMM's pipeline
    over the shared memory of one block."""
    why = _shape_refusal(block, p)
    if why:
        raise UnsupportedSchedule(why)
    for proj, name, bn, bk, st in ((0, "gate/up", p.block_n, p.block_k, p.num_stages),
                                   (1, "down", p.down_block_n, p.down_block_k, p.down_stages)):
        check_smem(f"Fp8GemmParams {name} tile block_m={p.block_m} block_n={bn} block_k={bk} stages={st} "
                   f"act_quant={p.act_quant}", smem_bytes(p, proj), target, "lower block_k or the stages")


CHOICES = (
    ("block_m", (16, 32, 64, 128)),
    ("block_n", (64, 128, 256)),
    ("block_k", (64, 128, 256)),
    ("group_m", (1, 8, 32)),
    ("num_warps", (4, 8)),
    ("num_stages", (2, 3, 4)),
    ("down_block_n", (64, 128, 256)),
    ("down_block_k", (64, 128, 256)),
    ("down_warps", (4, 8)),
    ("down_stages", (2, 3, 4)),
    ("split_k", (1, 2, 4)),
    ("y_half", (False, True)),
    ("down_nb", (1, 2, 4)),
    ("fold_scale", (True, False)),
    ("h_pass", (False, True)),
    ("quant_on_load", (False, True)),
    ("tma", (False, True)),
    ("pdl", (False, True)),
)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    """The tiles above; act_quant "none" or per-row groups of the weight block's columns (w8a8)."""
    c = block.weight_format.block[1] if block.weight_format.block else 128
    return ParamSpace(Fp8GemmParams, CHOICES + (("act_quant", ("none", f"fp8_1x{c}")),),
                      check=partial(check, block=block, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> Fp8GemmParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(Fp8GemmParams, tiles("grouped_gemm@fp8_block", block, T, target, constraints))


# --------------------------------------------------------------------------------------------- kernels


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


# ------------------------------------------------------------------------------------------------ host


def build(block: MoEBlock, schedule: Schedule):
    """ExpertsFn of a grouped_gemm schedule on fp8_block weights (params: Fp8GemmParams)."""
    p = schedule.params
    why = _shape_refusal(block, p)
    if why:
        raise UnsupportedSchedule(why)
    E, D, F = block.E, block.D, block.F
    R = block.weight_format.block[0]
    G = act_group(p.act_quant)
    a8 = G is not None
    alpha, limit = act_args(block)
    memo: dict = {}  # call_args' per-weights host work
    ks0, ks1 = dot_k(block, p, 0), dot_k(block, p, 1)  # each GEMM's dot columns
    nb = {"NB": p.down_nb} if p.down_nb > 1 else {}  # the down launch's column blocks a program
    n_down = cdiv(cdiv(D, p.down_block_n), p.down_nb)  # its programs a row tile
    if p.tma:
        return _build_tma(block, p, alpha, limit, ks0, ks1, nb, n_down)

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a = call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, wts_f = a.T, a.P, a.gs, a.ds, a.weights
        gsc, dsc = block_scales(w.gate_up_scale)[0], block_scales(w.down_scale)[0]
        meta = _meta(block, p, a)
        chain = "PDL" in meta
        hold: list = []  # the routing's scratch, alive until the last launch (module doc)
        counts, sorted_pairs = routing.route(ids, E, pdl=chain, hold=hold)
        nt = max_tiles(P, E, p.block_m)
        if a8 and not p.quant_on_load:
            xa, xs = quant_rows(x, G, pdl=chain)  # [T, D] e4m3, [T, D / G]
            if p.h_pass:  # 16-bit h, quantised by its own pass below
                h, hs = torch.empty(P, F, dtype=x.dtype, device=x.device), xs  # [P, F]
            else:
                h = torch.empty(P, F, dtype=torch.float8_e4m3fn, device=x.device)  # [P, F]
                hs = torch.empty(P, F // G, dtype=torch.float32, device=x.device)  # [P, F / G]
        else:
            xa, xs = x, wts_f
            h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
            hs = wts_f
        launch(grouped_gemm_fp8_kernel, (nt * cdiv(F, p.block_n),),
            xa, xa.stride(0), xs, xs.stride(0), wts_f, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.sk, gs.up, gsc, gsc.stride(0), gsc.stride(1), gsc.stride(2),
            (F // R) * gsc.stride(1),
            h, h.stride(0), hs, hs.stride(0), h, P, E, F, D, nt, D, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, KS=ks0, num_warps=p.num_warps, num_stages=p.num_stages,
            **meta, **pdl_launch(chain))
        if p.h_pass:
            hold.append(h)
            h, hs = quant_rows(h, G, pdl=chain, after=True)  # [P, F] e4m3, [P, F / G]
        k_split = cdiv(cdiv(F, p.split_k), p.down_block_k) * p.down_block_k
        S = cdiv(F, k_split)
        y = torch.empty(S, P, D, dtype=x.dtype if p.y_half else torch.float32, device=x.device)  # [S, P, D]
        launch(grouped_gemm_fp8_kernel, (nt * n_down, S),
            h, h.stride(0), hs, hs.stride(0), wts_f, counts, sorted_pairs,
            w.down, ds.se, ds.sn, ds.sk, 0, dsc, dsc.stride(0), dsc.stride(1), dsc.stride(2), 0,
            h, h.stride(0), hs, hs.stride(0), y, P, E, D, F, nt, k_split, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, KS=ks1, num_warps=p.down_warps,
            num_stages=p.down_stages, **nb, **meta, **pdl_launch(chain))
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        return _combine.combine(y, ids, out, E, pdl=chain)

    return run


def _meta(block: MoEBlock, p: Fp8GemmParams, a) -> dict:
    """The constexprs both kernels of a schedule share (a: the call's CallArgs)."""
    R, C = block.weight_format.block
    G = act_group(p.act_quant)
    meta = dict(K_TOP=block.k, BLOCK_E=a.meta["BLOCK_E"], ACT=a.meta["ACT"], W_IN=a.meta["W_IN"],
                BM=p.block_m, GROUP_M=p.group_m, R=R, C=C, G=G or C, A8=G is not None,
                UE8M0=block.weight_format.scale_dtype == "ue8m0", FOLD=p.fold_scale and G is None,
                EMULATE=interpreting())
    if p.quant_on_load:  # (QLOAD left at its default otherwise)
        meta["QLOAD"] = True
    if p.h_pass:
        meta["HPASS"] = True
    if programmatic(p.pdl):
        meta["PDL"] = True
    return meta



def _build_tma(block: MoEBlock, p: Fp8GemmParams, alpha: float, limit: float, ks0: int, ks1: int, nb: dict,
               n_down: int):
    E, D, F = block.E, block.D, block.F
    R = block.weight_format.block[0]
    G = act_group(p.act_quant)
    prepass = G is not None and not p.quant_on_load
    weight_descs: dict = {}  # the last weights' two descriptors (host objects), by pointer, shape and strides
    memo: dict = {}

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a = call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, wts_f = a.T, a.P, a.gs, a.ds, a.weights
        gu, dn = w.gate_up, w.down
        key = (gu.data_ptr(), dn.data_ptr(), gu.shape, dn.shape, gu.stride(), dn.stride())
        if key not in weight_descs:
            if gs.se != 2 * F * gs.sn or ds.se != D * ds.sn or gs.up != F * gs.sn:
                raise UnsupportedSchedule(f"grouped_gemm fp8 tma: expert weights gate_up {tuple(gu.stride())} / "
                                          f"down {tuple(dn.stride())} are not one [E·rows, cols] matrix each")
            weight_descs.clear()
            weight_descs[key] = (_desc(gu, [E * 2 * F, D], [gs.sn, 1], [p.block_n, ks0]),
                                 _desc(dn, [E * D, F], [ds.sn, 1], [p.down_block_n, ks1]))
        gu_desc, dn_desc = weight_descs[key]
        gsc, dsc = block_scales(w.gate_up_scale)[0], block_scales(w.down_scale)[0]
        meta = _meta(block, p, a)
        chain = "PDL" in meta
        hold: list = []  # the routing's scratch, alive until the last launch (module doc)
        counts, sorted_pairs = routing.route(ids, E, pdl=chain, hold=hold)
        nt = max_tiles(P, E, p.block_m)
        rows = max(P, 1)
        if prepass:
            xq, xsc = quant_rows(x, G, pdl=chain)  # [T, D] e4m3, [T, D / G] (token order)
            xs = routing.gather(xq, counts, sorted_pairs, block.k, xq.dtype, pdl=chain)  # [P, D] sorted e4m3
            if p.h_pass:  # 16-bit h, quantised by its own pass below
                h, hs = torch.empty(rows, F, dtype=x.dtype, device=x.device), xsc  # [P, F] sorted
            else:
                h = torch.empty(rows, F, dtype=torch.float8_e4m3fn, device=x.device)  # [P, F] sorted
                hs = torch.empty(rows, F // G, dtype=torch.float32, device=x.device)  # [P, F / G] sorted
        else:
            xs = routing.gather(x, counts, sorted_pairs, block.k, x.dtype, pdl=chain)  # [P, D] sorted 16-bit
            xsc = hs = wts_f
            h = torch.empty(rows, F, dtype=x.dtype, device=x.device)  # [P, F] sorted
        grouped_gemm_fp8_tma_kernel[(nt * cdiv(F, p.block_n),)](  # descriptors: new objects each call
            _desc(xs, [rows, D], [D, 1], [p.block_m, ks0]), xsc, xsc.stride(0), gu_desc,
            gsc, gsc.stride(0), gsc.stride(1), gsc.stride(2), (F // R) * gsc.stride(1), wts_f, counts, sorted_pairs,
            h, hs, hs.stride(0), h, P, E, F, D, nt, D, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, KS=ks0, num_warps=p.num_warps, num_stages=p.num_stages,
            **meta, **pdl_launch(chain))
        if p.h_pass:
            hold.append(h)
            h, hs = quant_rows(h, G, pdl=chain, after=True)  # [P, F] e4m3, [P, F / G] sorted
        k_split = cdiv(cdiv(F, p.split_k), p.down_block_k) * p.down_block_k
        S = cdiv(F, k_split)
        y = torch.empty(S, P, D, dtype=x.dtype if p.y_half else torch.float32, device=x.device)  # [S, P, D]
        grouped_gemm_fp8_tma_kernel[(nt * n_down, S)](
            _desc(h, [rows, F], [F, 1], [p.block_m, ks1]), hs, hs.stride(0), dn_desc,
            dsc, dsc.stride(0), dsc.stride(1), dsc.stride(2), 0, wts_f, counts, sorted_pairs,
            h, hs, hs.stride(0), y, P, E, D, F, nt, k_split, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, KS=ks1, num_warps=p.down_warps,
            num_stages=p.down_stages, **nb, **meta, **pdl_launch(chain))
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        return _combine.combine(y, ids, out, E, pdl=chain)

    return run


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): e4m3 weights and their scales of each distinct expert once (L2 serves the other
    tiles), x, h (bf16, or e4m3 + scales with w8a8, and the quantised x), y, the combine and the routing."""
    params, distinct = schedule.params, uniform_distinct(block.E, block.k, tokens)
    ab = 2  # the activations' dtype (bf16 / fp16)
    yb = ab if params.y_half else 4
    P = tokens * block.k
    tiles = P / params.block_m + distinct
    flops = 2.0 * 3 * tiles * params.block_m * block.D * block.F  # padded rows included
    g = act_group(params.act_quant)
    if g is None or params.quant_on_load:
        act = tokens * block.D * ab + 2 * P * block.F * ab
        sorted_copy = 2 * P * block.D * ab  # tma: xs written, read
    else:  # x read, xq written (1 B + scales) and read by every pair, hq written and read
        act = (tokens * block.D * (ab + 1 + 4 / g) + P * block.D * (1 + 4 / g)
               + 2 * P * block.F * (1 + 4 / g))
        sorted_copy = 2 * P * block.D
    act += sorted_copy if params.tma else 0
    act += 2 * P * block.F * ab if params.h_pass else 0  # h_pass: the 16-bit h written and read by its pass
    by = (distinct * block.weight_bytes_per_expert + act
          + _combine.cost(params.split_k, P, tokens, block.D, ab, yb)[1] + params.split_k * P * block.D * yb
          + routing.cost(P, block.E)[1])
    return flops, by


KIND = KernelKind("grouped_gemm", Fp8GemmParams, space, default_params, build, cost,
                  sources(__file__, SOURCES), refusal=refusal, formats=("fp8_block",))
