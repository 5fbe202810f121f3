"""stream_gemv for FP8 block-quantised experts: e4m3 weights streamed once, dequantised in registers.

The structure of stream_gemv.py (one kernel, three projections, the same grids, routing and epilogues),
reading weights of scheme fp8_block (moetune.codegen.quant): gate_up [E, 2F, D] and down [E, D, F] in
float8_e4m3fn, one dequantisation multiplier per (RB, CB) block of each matrix, gate_up_scale
[E, 2F/RB, D/CB] and down_scale [E, D/RB, F/CB] (float32, or ue8m0 bytes read as uint8: 2^(b − 127)).
Activations stay in the model's dtype, products and sums in fp32.

Dequantisation. A program's BN output rows lie in one row block (BN divides RB), so along a reduction
chunk the scale depends on the column block only: the chunk [BK] is J = BK / CW column blocks of
CW = min(BK, CB) columns, and the J scales multiply the activation chunk [J, CW] (J·CW products), never
the weight tile [BN, J, CW]; the weights only go e4m3 → fp32 and into the FMA. On the tl.dot path
(ROWS ≥ 16; BK ≤ CB) the tile is widened to the activations' dtype (exact for e4m3) and the chunk's one
scale multiplies the product [ROWS, BN]; with f16_dot it is widened to float16 alone (one e4m3x2 → f16x2
conversion per two weights) and each chunk's activation rows are scaled by a power of two into float16's
range and back.

  PROJ 0 gate/up   grid (slot, F-block): slot s = s-th distinct selected expert; its rows one at a time
                   (ROWS = 1, FMA, each row streams the tile) or ROWS at once through tl.dot (one read of
                   the tile per pass); the gate and up halves have their own scales; SwiGLU fused;
                   h [P, F] in x.dtype.
  PROJ 1 down      grid (slot, D-block, K split): fp32 partial rows y [S, P, D] · routing weight, then
                   combine.py sums splits and the k experts of each token.
  PROJ 2 down      grid (token, D-block): the token's k experts in one [KP, BN, BK] tile per chunk (BK ≤ CB:
                   one scale per expert and chunk), out [T, D] written directly, no combine; with down_nb > 1
                   a program walks that many D-blocks in one flattened pipelined loop.
Work comes from routing.py's counts / sorted pairs, or with `fused_route` and P ≤ 64 from the ids
themselves (stream_gemv's `_fused_slot`): then the block is two launches. With `pdl` (token mode, sm_90) the
second is a programmatic dependent launch (_common's module doc): every gate/up program releases it as it
starts, so the down programs take the SMs the gate/up programs leave, ask L2 for their k experts' weight
lines (the ids are the block's input), and wait for h only then; the gap between the launches and the ramp
of the down's read overlap the gate/up kernel's last wave.

Sizes: D and F are multiples of the block's rows and columns (`refusal`), so the grids cover the output
exactly and no row mask is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import triton
import triton.language as tl

from ...ir import DTYPE_BYTES, MoEBlock, Schedule, UnsupportedSchedule
from ...passes.stats import uniform_distinct
from ...targets import Target
from ..contract import KernelKind, sources
from ..space import ParamSpace
from ..tensors import ExpertTensors
from ..tiles import make
from . import combine as _combine
from . import routing
from ._common import _grid_release, _grid_wait, _prefetch_l2, _store_h, _store_y
from ._fp8 import _ue8m0, block_scales
from .launch import launch, pdl_launch, programmatic
from .layout import act_args, call_args, cdiv, check_pow2, check_smem, dot_smem_bytes, flat_pairs, next_pow2
from .stream_gemv import FUSED_ROUTE_MAX_PAIRS, _slot_pairs, _slot_work, _token_pairs
from .tiles import tiles

SOURCES = ("stream_gemv_fp8.py", "tiles.py", "_fp8.py", "stream_gemv.py", "_common.py", "layout.py", "routing.py",
           "combine.py", "launch.py")


@dataclass(frozen=True)
class Fp8GemvParams:
    block_n: int = 16  # gate/up output rows (of F) per program; divides the block's rows
    block_k: int = 256  # reduction chunk along D: a multiple or a divisor of the block's columns
    rows: int = 1  # 1: FMA, one row per tile read; 16 / 32: that many rows per tl.dot pass (the token down: FMA)
    num_warps: int = 4
    num_stages: int = 4  # depth of the cp.async pipeline of every K loop
    down_block_n: int = 4  # down output rows (of D) per program (token mode: × next_pow2(k) streams)
    down_block_k: int = 128  # reduction chunk along F (token mode and the dot pass: ≤ the block's columns)
    down_warps: int = 4
    down_mode: Literal["token", "expert"] = "token"
    split_k: int = 1  # down, expert mode: F split in this many fp32 partials
    fused_route: bool = True  # P ≤ 64: each program groups the ids itself (no routing kernel)
    # token-mode down: D-blocks per program, walked in one flattened pipelined loop (as stream_gemv's)
    down_nb: int = 1
    # the tl.dot pass in float16: each chunk's activation rows scaled by a power of two into f16 (their max to
    # [0.5, 1)), so the tile needs e4m3 → f16 only (one conversion per two weights), not → bf16
    f16_dot: bool = False
    # token-mode down launched programmatically (sm_90, _common's module doc): it starts while the gate/up
    # kernel ends, asks L2 for its weight lines, then waits for h
    pdl: bool = False

    def __post_init__(self) -> None:
        check_pow2("Fp8GemvParams", block_n=self.block_n, block_k=self.block_k, rows=self.rows,
                   down_block_n=self.down_block_n, down_block_k=self.down_block_k,
                   num_warps=self.num_warps, down_warps=self.down_warps)
        if self.rows not in (1, 16, 32):
            raise UnsupportedSchedule(f"Fp8GemvParams.rows = {self.rows}: 1 (FMA) or 16 / 32 (tl.dot)")
        if self.down_mode not in ("token", "expert"):
            raise UnsupportedSchedule(f"Fp8GemvParams.down_mode = {self.down_mode!r}: 'token' or 'expert'")
        if self.down_nb not in (1, 2, 4, 8) or (self.down_nb > 1 and self.down_mode != "token"):
            raise UnsupportedSchedule(f"Fp8GemvParams.down_nb = {self.down_nb}: 1, 2, 4 or 8, and > 1 only with "
                                      "down_mode='token'")
        if self.split_k < 1 or (self.split_k > 1 and self.down_mode != "expert"):
            raise UnsupportedSchedule(f"Fp8GemvParams.split_k = {self.split_k}: ≥ 1, and > 1 only with "
                                      "down_mode='expert' (the token mode has no partials to combine)")
        if self.pdl and self.down_mode != "token":
            raise UnsupportedSchedule("Fp8GemvParams.pdl: only with down_mode='token' (the down kernel that follows "
                                      "the gate/up kernel directly)")
        if self.f16_dot and self.rows < 16:
            raise UnsupportedSchedule("Fp8GemvParams.f16_dot: only with the tl.dot pass (rows 16 or 32)")
        dots = [("block_n", self.block_n), ("block_k", self.block_k)]
        if self.down_mode == "expert":  # (the token-mode down is FMA at any rows)
            dots += [("down_block_n", self.down_block_n), ("down_block_k", self.down_block_k)]
        small = [f"{n} = {v}" for n, v in dots if v < 16]
        if self.rows >= 16 and small:
            raise UnsupportedSchedule(f"Fp8GemvParams rows={self.rows}: tl.dot tiles need ≥ 16, got {', '.join(small)}")
        regs = 2 * self.block_n * self.block_k // (32 * self.num_warps)
        if self.rows == 1 and regs > 128:
            raise UnsupportedSchedule(
                f"Fp8GemvParams block_n={self.block_n} block_k={self.block_k} num_warps={self.num_warps}: "
                f"{regs} fp32 accumulator registers per thread, limit 128; lower block_k or raise num_warps")


def _aligned(bk: int, cols: int) -> bool:
    """A reduction chunk of `bk` columns never straddles a scale block of `cols` columns unevenly."""
    return bk % cols == 0 or cols % bk == 0


def check(p: Fp8GemvParams, block: MoEBlock, target: Target) -> None:
    """What `block`'s scale blocks or `target` refuse: tiles that straddle a scale block, a down tile over the
    registers (the token mode holds one per expert of a token), the dot pass's shared memory."""
    r, c = block.weight_format.block if block.weight_format.quantized else (128, 128)
    what = f"Fp8GemvParams on {r}x{c} scale blocks"
    for name in ("block_n", "down_block_n"):
        if r % getattr(p, name):
            raise UnsupportedSchedule(f"{what}: {name} = {getattr(p, name)} must divide the block rows {r}; "
                                      f"lower {name}")
    if not _aligned(p.block_k, c) or (p.rows >= 16 and c % p.block_k):
        raise UnsupportedSchedule(f"{what}: block_k = {p.block_k} must divide the block columns {c} "
                                  f"(or, for rows = 1, be a multiple of them)")
    dot_down = p.rows >= 16 and p.down_mode == "expert"
    if c % p.down_block_k and (p.down_mode == "token" or dot_down or not _aligned(p.down_block_k, c)):
        raise UnsupportedSchedule(f"{what}: down_block_k = {p.down_block_k} must divide the block columns {c} "
                                  f"(a multiple of them only for the expert mode's FMA rows)")
    streams = next_pow2(block.k) if p.down_mode == "token" else 1
    regs = streams * p.down_block_n * p.down_block_k // (32 * p.down_warps)
    if not dot_down and regs > 128:
        raise UnsupportedSchedule(
            f"Fp8GemvParams down_block_n={p.down_block_n} down_block_k={p.down_block_k} down_warps={p.down_warps}"
            f" ({p.down_mode} mode, k = {block.k}): {regs} fp32 accumulator registers per thread, limit 128; lower "
            "down_block_n or down_block_k, or raise down_warps")
    if p.rows >= 16:
        check_smem(f"Fp8GemvParams rows={p.rows} block_n={p.block_n} block_k={p.block_k} "
                   f"num_stages={p.num_stages}",
                   dot_smem_bytes(p.rows, 0, p.block_k, p.num_stages, 0) + p.num_stages * 2 * p.block_k * p.block_n,
                   target, "lower block_k or num_stages")  # activation tiles, and the gate and up 1-byte tiles


def whole_blocks_refusal(block: MoEBlock, kind: str = "stream_gemv") -> str | None:
    """Why the Triton FP8 kernel of `kind` cannot take `block`: weights not fp8_block, or D or F not whole scale
    blocks (the kernels index weights without row masks)."""
    fmt = block.weight_format
    if not fmt.quantized:
        return f"triton {kind} (fp8) reads fp8_block weights, not {fmt}"
    r, c = fmt.block
    for name, v in (("D", block.D), ("F", block.F)):
        if v % r or v % c:
            return (f"triton {kind} (fp8): {name} = {v} is not a multiple of the {r}x{c} scale blocks "
                    "(a partial last block)")
    return None


refusal = whole_blocks_refusal


# the values of the scale blocks decide which are points of a block's space (`space`); these are the
# candidates for 128 x 128 blocks and hold every default of `default_params`
CHOICES = (
    ("block_n", (4, 8, 16, 32, 64, 128)),
    ("block_k", (64, 128, 256, 512, 1024)),
    ("rows", (1, 16, 32)),
    ("num_warps", (4, 8)),
    ("num_stages", (2, 3, 4, 5)),
    ("down_block_n", (2, 4, 8, 16, 32, 64)),
    ("down_block_k", (64, 128, 256, 512)),
    ("down_warps", (4, 8)),
    ("down_mode", ("token", "expert")),
    ("split_k", (1, 2, 4)),
    ("fused_route", (True, False)),
    ("down_nb", (1, 2, 4)),
    ("f16_dot", (False, True)),
    ("pdl", (False, True)),
)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    """CHOICES, with the tile sizes also scaled to the block's scale blocks when they are not 128 x 128 (a
    block of 32 columns: chunks of 16 and 32 too), less those that cannot align with them."""
    r, c = block.weight_format.block if block.weight_format.quantized else (128, 128)
    dims = {"block_n": (r, 2), "down_block_n": (r, 2), "block_k": (c, 16), "down_block_k": (c, 16)}

    def fits(name: str, v: int) -> bool:
        b = dims[name][0]
        return b % v == 0 if name.endswith("block_n") else _aligned(v, b)

    def values(name: str, vals: tuple) -> tuple:
        if name not in dims:
            return vals
        b, least = dims[name]
        scaled = {v * b // 128 for v in vals if v * b % 128 == 0 and v * b // 128 >= least}
        return tuple(v for v in sorted(set(vals) | scaled) if fits(name, v))

    choices = tuple((n, values(n, vals)) for n, vals in CHOICES)
    return ParamSpace(Fp8GemvParams, choices, check=partial(check, block=block, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> Fp8GemvParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    return make(Fp8GemvParams, tiles("stream_gemv@fp8_block", block, T, target, constraints))


@triton.jit
def _scale(s_ptrs, UE8M0: tl.constexpr):
    """Dequantisation multipliers at `s_ptrs` as fp32: float32 as stored, or ue8m0 bytes (`_fp8._ue8m0`)."""
    raw = tl.load(s_ptrs)
    if UE8M0:
        return _ue8m0(raw)
    return raw.to(tl.float32)


@triton.jit
def _row_gate_up8(x_ptr, s_xt, tok, w_e, sn, up, sc, ssk, sup, n0, K,
                  BN: tl.constexpr, J: tl.constexpr, CW: tl.constexpr, CB: tl.constexpr,
                  STAGES: tl.constexpr, UE8M0: tl.constexpr):
    """One row: (gate [BN], up [BN]) = dequant(W[n0:n0+BN]) · x[tok] in fp32; chunks of J column blocks
    of CW columns (tile [BN, J, CW]); `sc` points at this row block's gate scales, `sup` after it the up's."""
    offs_n = n0 + tl.arange(0, BN)
    jj = tl.arange(0, J)
    kk = jj[:, None] * CW + tl.arange(0, CW)[None, :]  # [J, CW]
    wrow = w_e + offs_n[:, None, None] * sn  # [BN, 1, 1]
    xrow = x_ptr + tok.to(tl.int64) * s_xt
    accg = tl.zeros([BN, J, CW], dtype=tl.float32)
    accu = tl.zeros([BN, J, CW], dtype=tl.float32)
    for k0 in tl.range(0, K, J * CW, num_stages=STAGES):
        offs_k = k0 + kk  # [J, CW]
        km = offs_k < K
        kb = tl.minimum((k0 + jj * CW) // CB, K // CB - 1)  # [J]
        sg = _scale(sc + kb * ssk, UE8M0)
        su = _scale(sc + sup + kb * ssk, UE8M0)
        xv = tl.load(xrow + offs_k, mask=km, other=0.0).to(tl.float32)  # [J, CW]
        wp = wrow + offs_k[None, :, :]  # [BN, J, CW]
        wg = tl.load(wp, mask=km[None, :, :], other=0.0, eviction_policy="evict_first")
        wu = tl.load(wp + up, mask=km[None, :, :], other=0.0, eviction_policy="evict_first")
        accg += wg.to(tl.float32) * (xv * sg[:, None])[None, :, :]
        accu += wu.to(tl.float32) * (xv * su[:, None])[None, :, :]
    return tl.sum(tl.sum(accg, axis=2), axis=1), tl.sum(tl.sum(accu, axis=2), axis=1)


@triton.jit
def _row_down8(h_row, w_e, sn, sc, ssk, n0, k_lo, k_hi, K,
               BN: tl.constexpr, J: tl.constexpr, CW: tl.constexpr, CB: tl.constexpr,
               STAGES: tl.constexpr, UE8M0: tl.constexpr):
    """One row: y [BN] = dequant(W[n0:n0+BN, k_lo:k_hi]) · h[k_lo:k_hi], fp32 (tile [BN, J, CW])."""
    offs_n = n0 + tl.arange(0, BN)
    jj = tl.arange(0, J)
    kk = jj[:, None] * CW + tl.arange(0, CW)[None, :]  # [J, CW]
    wrow = w_e + offs_n[:, None, None] * sn
    acc = tl.zeros([BN, J, CW], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, J * CW, num_stages=STAGES):
        offs_k = k0 + kk
        km = offs_k < k_hi
        kb = tl.minimum((k0 + jj * CW) // CB, K // CB - 1)  # [J]
        s = _scale(sc + kb * ssk, UE8M0)
        hv = tl.load(h_row + offs_k, mask=km, other=0.0).to(tl.float32)  # [J, CW]
        wv = tl.load(wrow + offs_k[None, :, :], mask=km[None, :, :], other=0.0, eviction_policy="evict_first")
        acc += wv.to(tl.float32) * (hv * s[:, None])[None, :, :]
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _f16_rows(a):
    """Activation rows a [R, BK] as float16 scaled by a power of two each (a row's max to [0.5, 1): exact in
    fp32, f16's rounding only), and the [R] powers of two that undo it."""
    af = a.to(tl.float32)
    eb = (tl.max(tl.abs(af), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF  # [R] biased exponent of the max
    eb = tl.minimum(eb, 252)  # (a max of 2^126 or more, inf and NaN: scaled by 2^-126)
    up = ((253 - eb) << 23).to(tl.float32, bitcast=True)  # 2^(126 - eb)
    down = ((eb + 1) << 23).to(tl.float32, bitcast=True)  # 2^(eb - 126)
    return (af * up[:, None]).to(tl.float16), down


@triton.jit
def _dot8(a, b, s, F16: tl.constexpr, UPCAST: tl.constexpr):
    """dequant chunk product a [R, BK] · (b [BK, N] e4m3 · s) in fp32: b widened to a's dtype (exact), or with
    F16 both in float16, a's rows scaled into its range and back (`_f16_rows`)."""
    if F16:
        a16, back = _f16_rows(a)
        if UPCAST:
            y = tl.dot(a16.to(tl.float32), b.to(tl.float32)) * s * back[:, None]
        else:
            y = tl.dot(a16, b.to(tl.float16)) * s * back[:, None]
    else:
        if UPCAST:
            a = a.to(tl.float32)
        y = tl.dot(a, b.to(a.dtype)) * s
    return y


@triton.jit
def _tile_gate_up8(x_ptr, s_xt, toks, rmask, w_e, sn, up, sc, ssk, sup, n0, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CB: tl.constexpr,
                   STAGES: tl.constexpr, UE8M0: tl.constexpr, UPCAST: tl.constexpr, F16: tl.constexpr):
    """BM rows through tl.dot: (gate, up) [BM, BN] fp32; the tile [BK, BN] widened to x's dtype (exact) or
    with F16 to float16, each chunk's product times its one scale (BK divides CB)."""
    offs_n = n0 + tl.arange(0, BN)
    arow = x_ptr + toks.to(tl.int64)[:, None] * s_xt  # [BM, 1]
    bcol = w_e + offs_n[None, :] * sn  # [1, BN]
    accg = tl.zeros([BM, BN], dtype=tl.float32)
    accu = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        a = tl.load(arow + offs_k[None, :], mask=rmask[:, None], other=0.0)  # [BM, BK]
        bp = bcol + offs_k[:, None]  # [BK, BN]
        bg = tl.load(bp, eviction_policy="evict_first")
        bu = tl.load(bp + up, eviction_policy="evict_first")
        sg = _scale(sc + (k0 // CB) * ssk, UE8M0)
        su = _scale(sc + sup + (k0 // CB) * ssk, UE8M0)
        accg += _dot8(a, bg, sg, F16, UPCAST)
        accu += _dot8(a, bu, su, F16, UPCAST)
    return accg, accu


@triton.jit
def _tile_down8(h_ptr, s_hp, pairs, rmask, w_e, sn, sc, ssk, n0, k_lo, k_hi,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CB: tl.constexpr,
                STAGES: tl.constexpr, UE8M0: tl.constexpr, UPCAST: tl.constexpr, F16: tl.constexpr):
    """BM rows through tl.dot: y [BM, BN] = h[pairs, k_lo:k_hi] · dequant(W[n0:n0+BN, k_lo:k_hi])ᵀ, fp32."""
    offs_n = n0 + tl.arange(0, BN)
    arow = h_ptr + pairs.to(tl.int64)[:, None] * s_hp
    bcol = w_e + offs_n[None, :] * sn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < k_hi
        a = tl.load(arow + offs_k[None, :], mask=rmask[:, None] & km[None, :], other=0.0)  # [BM, BK]
        b = tl.load(bcol + offs_k[:, None], mask=km[:, None], other=0.0, eviction_policy="evict_first")
        s = _scale(sc + (k0 // CB) * ssk, UE8M0)
        acc += _dot8(a, b, s, F16, UPCAST)
    return acc


@triton.jit
def _token_down8(h_ptr, s_hp, p, ok, ec, wt, w_ptr, se, sn, s_ptr, sse, ssn, ssk,
                 b_ptr, sbe, sbn, n0, K, KP: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, HAS_BIAS: tl.constexpr,
                 W_IN: tl.constexpr, STAGES: tl.constexpr, UE8M0: tl.constexpr):
    """out[t, n0:n0+BN] = Σ_j w_tj · dequant(down[e_tj]) · h[t·k + j] (token t's pairs: `_token_pairs`): the
    token's k experts in one [KP, BN, BK] tile per chunk; BK divides CB, so one scale per expert and chunk
    multiplies its h chunk."""
    offs_n = n0 + tl.arange(0, BN)
    wbase = w_ptr + ec[:, None, None] * se + offs_n[None, :, None] * sn  # [KP, BN, 1]
    sbase = s_ptr + ec * sse + (n0 // RB) * ssn  # [KP]
    hbase = h_ptr + p.to(tl.int64)[:, None] * s_hp  # [KP, 1]
    acc = tl.zeros([KP, BN, BK], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        s = _scale(sbase + (k0 // CB) * ssk, UE8M0)  # [KP]
        hv = tl.load(hbase + offs_k[None, :], mask=ok[:, None], other=0.0).to(tl.float32)  # [KP, BK]
        wv = tl.load(wbase + offs_k[None, None, :], mask=ok[:, None, None], other=0.0,
                     eviction_policy="evict_first")  # [KP, BN, BK]
        acc += wv.to(tl.float32) * (hv * s[:, None])[:, None, :]
    y = tl.sum(acc, axis=2)  # [KP, BN]
    if HAS_BIAS:
        b = tl.load(b_ptr + ec[:, None] * sbe + offs_n[None, :] * sbn, mask=ok[:, None], other=0.0)
        y += b.to(tl.float32)
    if not W_IN:
        y = y * wt[:, None]
    return tl.sum(y, axis=0)


@triton.jit
def _token_down8_nb(h_ptr, s_hp, p, ok, ec, wt, w_ptr, se, sn, s_ptr, sse, ssn, ssk,
                    b_ptr, sbe, sbn, n_first, N, K, y_row, KP: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, HAS_BIAS: tl.constexpr,
                    W_IN: tl.constexpr, STAGES: tl.constexpr, UE8M0: tl.constexpr):
    """_token_down8 over NB consecutive D-blocks [n_first + b·BN, +BN) in ONE pipelined loop over (b, chunk)
    flattened (stream_gemv's down_nb): the next block's first chunks load while the current one ends, the
    ids, weights and addresses are set up once. Each block's out[t, n0:n0+BN] is stored when it is complete."""
    wbase = w_ptr + ec[:, None, None] * se  # [KP, 1, 1]
    sbase = s_ptr + ec * sse  # [KP]
    hbase = h_ptr + p.to(tl.int64)[:, None] * s_hp  # [KP, 1]
    nk = K // BK
    nb = tl.minimum(NB, (N - n_first) // BN)  # blocks of this program inside [0, N)
    acc = tl.zeros([KP, BN, BK], dtype=tl.float32)
    for i in tl.range(0, nb * nk, num_stages=STAGES):
        b = i // nk
        k0 = (i - b * nk) * BK
        n0 = n_first + b * BN
        offs_n = n0 + tl.arange(0, BN)
        offs_k = k0 + tl.arange(0, BK)
        s = _scale(sbase + (n0 // RB) * ssn + (k0 // CB) * ssk, UE8M0)  # [KP]
        hv = tl.load(hbase + offs_k[None, :], mask=ok[:, None], other=0.0).to(tl.float32)  # [KP, BK]
        wv = tl.load(wbase + offs_n[None, :, None] * sn + offs_k[None, None, :], mask=ok[:, None, None], other=0.0,
                     eviction_policy="evict_first")  # [KP, BN, BK]
        acc += wv.to(tl.float32) * (hv * s[:, None])[:, None, :]
        if k0 + BK >= K:  # block b complete
            y = tl.sum(acc, axis=2)  # [KP, BN]
            if HAS_BIAS:
                bias = tl.load(b_ptr + ec[:, None] * sbe + offs_n[None, :] * sbn, mask=ok[:, None], other=0.0)
                y += bias.to(tl.float32)
            if not W_IN:
                y = y * wt[:, None]
            tl.store(y_row + offs_n, tl.sum(y, axis=0).to(y_row.dtype.element_ty))
            acc = tl.zeros([KP, BN, BK], dtype=tl.float32)


@triton.jit
def _prefetch_token_down(ok, ec, w_ptr, se, sn, n_first, N, K, BN: tl.constexpr, NB: tl.constexpr,
                         KL: tl.constexpr):
    """Ask L2 for the down weight lines a token's program reads: its k experts' (ec where ok) rows [n_first,
    n_first + BN·NB) (clamped to N), K columns in KL lines of 128 bytes (clamped to K); an unused lane asks for
    a used one's."""
    RN: tl.constexpr = BN * NB
    ec = tl.where(ok, ec, tl.max(ec, axis=0))
    rows = tl.minimum(n_first + tl.arange(0, RN), N - 1)
    cols = tl.minimum(tl.arange(0, KL) * 128, K - 1)
    _prefetch_l2(w_ptr + ec[:, None, None] * se + rows[None, :, None] * sn + cols[None, None, :])


@triton.jit(do_not_specialize=["P"])
def stream_gemv_fp8_kernel(
    x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr,
    w_ptr, se, sn, up, s_ptr, sse, ssn, ssk, sup, b_ptr, sbe, sbn, bup,
    h_ptr, s_hp, y_ptr, s_yt,
    P, E, N, K, k_split, alpha, limit,
    PROJ: tl.constexpr, K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BP: tl.constexpr,
    FUSED: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    RB: tl.constexpr, CB: tl.constexpr, UE8M0: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    STAGES: tl.constexpr, NB: tl.constexpr = 1, F16: tl.constexpr = False, PDL: tl.constexpr = False,
    KL: tl.constexpr = 1,
):
    n0 = tl.program_id(1) * BN
    offs_n = n0 + tl.arange(0, BN)
    if PDL and PROJ == 0:  # the down kernel may start now (it waits for h)
        _grid_release()
    if PROJ == 2:
        t = tl.program_id(0)
        pr, ok, ec, wt = _token_pairs(ids_ptr, wts_ptr, t, E, K_TOP, KP)
        if PDL:  # launched programmatically: the weights' lines while the gate/up kernel ends, then h
            _prefetch_token_down(ok, ec, w_ptr, se, sn, n0 * NB, N, K, BN, NB, KL)
            _grid_wait()
        if NB > 1:
            _token_down8_nb(h_ptr, s_hp, pr, ok, ec, wt, w_ptr, se, sn, s_ptr, sse, ssn, ssk, b_ptr, sbe, sbn,
                            n0 * NB, N, K, y_ptr + t.to(tl.int64) * s_yt, KP, BN, BK, NB, RB, CB, HAS_BIAS, W_IN,
                            STAGES, UE8M0)
        else:
            out = _token_down8(h_ptr, s_hp, pr, ok, ec, wt, w_ptr, se, sn, s_ptr, sse, ssn, ssk,
                               b_ptr, sbe, sbn, n0, K, KP, BN, BK, RB, CB, HAS_BIAS, W_IN, STAGES, UE8M0)
            tl.store(y_ptr + t.to(tl.int64) * s_yt + offs_n, out.to(y_ptr.dtype.element_ty))
    else:
        CW: tl.constexpr = BK if BK < CB else CB
        J: tl.constexpr = BK // CW
        slot = tl.program_id(0)
        ks = tl.program_id(2)
        ec, st, m, match, mrank = _slot_work(ids_ptr, counts_ptr, P, E, slot, FUSED, BP, BLOCK_E)
        w_e = w_ptr + ec * se
        b_e = b_ptr + ec * sbe
        sc = s_ptr + ec * sse + (n0 // RB) * ssn  # this row block's scales
        k_lo = ks * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        r = tl.arange(0, ROWS)
        for c in range(0, m, ROWS):
            rmask = c + r < m
            pairs = _slot_pairs(sorted_ptr, st, match, mrank, c, rmask, FUSED, ROWS, BP)
            wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [ROWS]
            if ROWS == 1:
                pair = tl.sum(pairs, axis=0)
                if PROJ == 0:
                    g1, u1 = _row_gate_up8(x_ptr, s_xt, pair // K_TOP, w_e, sn, up, sc, ssk, sup, n0, K,
                                           BN, J, CW, CB, STAGES, UE8M0)
                    g = g1[None, :]
                    u = u1[None, :]
                else:
                    acc = _row_down8(h_ptr + pair.to(tl.int64) * s_hp, w_e, sn, sc, ssk, n0, k_lo, k_hi, K,
                                     BN, J, CW, CB, STAGES, UE8M0)[None, :]
            else:
                if PROJ == 0:
                    g, u = _tile_gate_up8(x_ptr, s_xt, pairs // K_TOP, rmask, w_e, sn, up, sc, ssk, sup, n0, K,
                                          ROWS, BN, BK, CB, STAGES, UE8M0, UPCAST, F16)
                else:
                    acc = _tile_down8(h_ptr, s_hp, pairs, rmask, w_e, sn, sc, ssk, n0, k_lo, k_hi,
                                      ROWS, BN, BK, CB, STAGES, UE8M0, UPCAST, F16)
            if PROJ == 0:
                _store_h(h_ptr, s_hp, pairs, rmask, g, u, wt, b_e, sbn, bup, n0, N,
                         alpha, limit, BN, ACT, HAS_BIAS, W_IN)
            else:
                _store_y(y_ptr + ks.to(tl.int64) * P * N, pairs, rmask, acc, wt, b_e, sbn,
                         (ks == 0).to(tl.float32), n0, N, BN, HAS_BIAS, W_IN)


def fp8_call_args(block: MoEBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors,
                  memo: dict):
    """`call_args` of a call on fp8_block weights, the reduction dimension checked contiguous: (the args, the
    gate/up and down scales as the kernels read them, whether they are ue8m0)."""
    a = call_args(block, x, ids, weights, w, memo)
    if a.gs.sk != 1 or a.ds.sk != 1:
        raise UnsupportedSchedule(f"fp8 gate_up strides {w.gate_up.stride()}, down {w.down.stride()}: the "
                                  "reduction dimension (the last) must be contiguous")
    gsc, ue8 = block_scales(w.gate_up_scale)
    dsc, _ = block_scales(w.down_scale)
    return a, gsc, dsc, ue8


def build(block: MoEBlock, schedule: Schedule):
    """ExpertsFn of a stream_gemv schedule on fp8_block weights (params: Fp8GemvParams)."""
    why = refusal(block)
    if why:
        raise UnsupportedSchedule(why)
    p = schedule.params
    if p.f16_dot and block.weight_format.compute_dtype == "float32":
        raise UnsupportedSchedule("Fp8GemvParams.f16_dot rounds float32 activations to float16; keep f16_dot=False "
                                  "for a float32 block")
    E, k, D, F = block.E, block.k, block.D, block.F
    RB, CB = block.weight_format.block
    alpha, limit = act_args(block)
    memo: dict = {}  # call_args' per-weights host work
    pdl = programmatic(p.pdl)
    kl = next_pow2(cdiv(F, 128)) if pdl else 1  # the down's 128-byte lines a weight row, for its L2 requests

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a, gsc, dsc, ue8 = fp8_call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, gb, db, wts_f = a.T, a.P, a.gs, a.ds, a.gate_up_bias, a.down_bias, a.weights
        ids_f = flat_pairs(ids)  # [P]
        fused = p.fused_route and P <= FUSED_ROUTE_MAX_PAIRS
        if fused:
            counts, sorted_pairs = ids_f, ids_f
        else:
            counts, sorted_pairs = routing.route(ids, E)
        # BP only matters to the fused routing: one compiled kernel for every P otherwise
        meta = dict(a.meta, KP=next_pow2(k), BP=max(16, next_pow2(P)) if fused else 16, FUSED=fused, ROWS=p.rows,
                    RB=RB, CB=CB, UE8M0=ue8, F16=p.f16_dot, PDL=pdl)
        slots = min(P, E)
        h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
        launch(stream_gemv_fp8_kernel, (slots, F // p.block_n, 1),
            x, x.stride(0), ids_f, wts_f, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.up, gsc, gsc.stride(0), gsc.stride(1), gsc.stride(2),
            (F // RB) * gsc.stride(1), gb, gs.sbe, gs.sbn, gs.bup,
            h, h.stride(0), h, 0, P, E, F, D, D, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, num_warps=p.num_warps, num_stages=p.num_stages,
            STAGES=p.num_stages, **meta)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        down = (w.down, ds.se, ds.sn, 0, dsc, dsc.stride(0), dsc.stride(1), dsc.stride(2), 0,
                db, ds.sbe, ds.sbn, 0)
        if p.down_mode == "token":
            launch(stream_gemv_fp8_kernel, (T, cdiv(D // p.down_block_n, p.down_nb), 1),
                x, x.stride(0), ids_f, wts_f, counts, sorted_pairs, *down,
                h, h.stride(0), out, out.stride(0), P, E, D, F, F, alpha, limit,
                PROJ=2, BN=p.down_block_n, BK=p.down_block_k, NB=p.down_nb, num_warps=p.down_warps,
                num_stages=p.num_stages, STAGES=p.num_stages, KL=kl, **meta, **pdl_launch(pdl))
            return out
        k_split = cdiv(cdiv(F, p.split_k), p.down_block_k) * p.down_block_k
        S = cdiv(F, k_split)
        y = torch.empty(S, P, D, dtype=torch.float32, device=x.device)  # [S, P, D]
        launch(stream_gemv_fp8_kernel, (slots, D // p.down_block_n, S),
            x, x.stride(0), ids_f, wts_f, counts, sorted_pairs, *down,
            h, h.stride(0), y, 0, P, E, D, F, k_split, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, num_warps=p.down_warps,
            num_stages=p.num_stages, STAGES=p.num_stages, **meta)
        return _combine.combine(y, ids, out, E)

    return run


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): each distinct expert's 1-byte weights and their scales once, x and h traffic,
    y partials and combine."""
    params, distinct = schedule.params, uniform_distinct(block.E, block.k, tokens)
    ab = DTYPE_BYTES[block.weight_format.compute_dtype]
    P = tokens * block.k
    flops = 2.0 * 3 * P * block.D * block.F
    by = distinct * block.weight_bytes_per_expert + tokens * block.D * ab * 2 + 2 * P * block.F * ab
    if params.down_mode == "expert":
        by += _combine.cost(params.split_k, P, tokens, block.D, ab)[1] + params.split_k * P * block.D * 4
    if not (params.fused_route and P <= FUSED_ROUTE_MAX_PAIRS):
        by += routing.cost(P, block.E)[1]
    return flops, by


KIND = KernelKind("stream_gemv", Fp8GemvParams, space, default_params, build, cost,
                  sources(__file__, SOURCES), refusal=refusal, formats=("fp8_block",))
