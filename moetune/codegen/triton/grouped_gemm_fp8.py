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

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...passes.stats import uniform_distinct
from ...targets import Target
from ..contract import KernelKind, sources
from ..quant import act_group
from ..space import ParamSpace
from ..tensors import ExpertTensors
from ..tiles import make
from . import combine as _combine
from . import routing
from ._fp8 import block_scales
from .grouped_gemm import _desc, max_tiles
from .grouped_gemm_fp8_kernels import grouped_gemm_fp8_kernel, grouped_gemm_fp8_tma_kernel
from .launch import launch, pdl_launch, programmatic
from .layout import act_args, call_args, cdiv, check_pow2, check_smem, interpreting
from .quant_rows import quant_rows
from .tiles import tiles

SCRATCH = 4096  # shared memory the compiled kernels take beyond their pipelines (reductions, layout changes)
SOURCES = ("grouped_gemm_fp8.py", "grouped_gemm_fp8_kernels.py", "tiles.py", "_fp8.py", "quant_rows.py",
           "grouped_gemm.py", "_common.py", "layout.py", "routing.py", "combine.py", "launch.py")

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
