"""fused_gemv: the few-rows regime in one launch — gate/up, activation, routing weight, down and the k-sum.

For the bf16 / fp16 / fp32 weights and the FP8 block-quantised ones (scheme fp8_block, w8a16) alike: the weight
format is a constexpr (FP8) that switches the load-and-dequantise step of each loop (the scale of each chunk
multiplies the activation chunk, never the weight tile; stream_gemv_fp8's module doc), nothing else.

One grid of work items, handed out in order by a ticket counter (not by program id, so no item waits for an item
that has no program yet: an item is handed out only to a program that runs, and every gate/up ticket comes
before every down ticket):

  gate/up item   (slot, F-block of BF rows): slot s = the s-th distinct selected expert (from the ids
                 themselves, stream_gemv's `_fused_slot`, while P ≤ 64; else routing.py's grouping); each of
                 its rows streams the [BF, D] gate and up tiles (FMA, pipelined K loop), SwiGLU fused, the
                 routing weight on the input where the block says so; h [P, F] in x.dtype. Then one release
                 increment of the `done` counter.
  down item      (token, D-block of BD rows): asks L2 for its k experts' [BD, F] down lines (the ids are known;
                 h is not), waits until `done` counts every gate/up item, then out[t, D-block] = Σ_j w_tj ·
                 down[e_tj] · h[t·k + j] over the token's k experts in one [KP, BD, BK] tile per chunk, written
                 once in x.dtype (deterministic: no atomics on data).

The weight stream is split over every SM by the F-blocks of the gate/up items and the D-blocks of the down
items; the down items' L2 requests overlap the gate/up stream, so the one barrier between the two costs the last
items' latency, not a second ramp. With `pdl` (sm_90) the launch is a programmatic dependent one (_common's
module doc): the programs are resident while the kernel before (the router) ends, and wait for it before they
read anything.

The three counters (ticket, done, finished) live in a small int32 workspace of the built function per device,
zeroed once; the last down item to finish resets them, so a CUDA graph replays the kernel with no memset. One
built function must not run on two streams at once (the counters are its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

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
from . import routing
from ._common import _grid_release, _grid_wait, _prefetch_l2, _row_gate_up, _store_h
from ._fp8 import _scale_of
from .launch import launch, pdl_launch, programmatic
from .layout import act_args, call_args, cdiv, check_pow2, flat_pairs, interpreting, next_pow2
from .stream_gemv import FUSED_ROUTE_MAX_PAIRS, _slot_pairs, _slot_work, _token_pairs
from .stream_gemv_fp8 import _aligned, _row_gate_up8, fp8_call_args, whole_blocks_refusal
from .tiles import tiles

SOURCES = ("fused_gemv.py", "tiles.py", "stream_gemv.py", "stream_gemv_fp8.py", "_common.py", "_fp8.py", "layout.py",
           "routing.py", "combine.py", "launch.py")
MAX_PAIRS = FUSED_ROUTE_MAX_PAIRS  # the regime this kind is for: T·k ≤ this (the policy's rule reads it)
_GAP = 32  # int32 words between the counters: each in a 128-byte line of its own


@dataclass(frozen=True)
class FusedGemvParams:
    block_f: int = 8  # gate/up rows (of F) per item; FP8: divides the scale block's rows
    block_k: int = 256  # gate/up chunk along D; FP8: a multiple or a divisor of the block's columns
    block_d: int = 4  # down rows (of D) per item (× next_pow2(k) weight streams); FP8: divides the block's rows
    down_block_k: int = 128  # down chunk along F; FP8: divides the block's columns
    num_warps: int = 4
    num_stages: int = 4  # depth of the cp.async pipeline of both K loops
    prefetch: bool = False  # a down item asks L2 for its weight lines before it waits for h
    pdl: bool = False  # a programmatic dependent launch (sm_90)

    def __post_init__(self) -> None:
        check_pow2("FusedGemvParams", block_f=self.block_f, block_k=self.block_k, block_d=self.block_d,
                   down_block_k=self.down_block_k, num_warps=self.num_warps)
        if self.num_stages < 1:
            raise UnsupportedSchedule(f"FusedGemvParams.num_stages = {self.num_stages}: ≥ 1")
        regs = 2 * self.block_f * self.block_k // (32 * self.num_warps)
        if regs > 128:
            raise UnsupportedSchedule(
                f"FusedGemvParams block_f={self.block_f} block_k={self.block_k} num_warps={self.num_warps}: "
                f"{regs} fp32 gate/up accumulator registers per thread, limit 128; lower block_k or raise num_warps")


def _scale_block(block: MoEBlock) -> tuple[int, int] | None:
    return block.weight_format.block if block.weight_format.quantized else None


def check(p: FusedGemvParams, block: MoEBlock, target: Target) -> None:
    """What `block` refuses: a down tile over the registers (one stream per expert of a token), and on FP8
    weights tiles that straddle a scale block."""
    streams = next_pow2(block.k)
    regs = streams * p.block_d * p.down_block_k // (32 * p.num_warps)
    if regs > 128:
        raise UnsupportedSchedule(
            f"FusedGemvParams block_d={p.block_d} down_block_k={p.down_block_k} num_warps={p.num_warps} "
            f"(k = {block.k}): {regs} fp32 down accumulator registers per thread, limit 128; lower block_d or "
            "down_block_k, or raise num_warps")
    sb = _scale_block(block)
    if sb is None:
        return
    r, c = sb
    what = f"FusedGemvParams on {r}x{c} scale blocks"
    for name in ("block_f", "block_d"):
        if r % getattr(p, name):
            raise UnsupportedSchedule(f"{what}: {name} = {getattr(p, name)} must divide the block rows {r}")
    if not _aligned(p.block_k, c):
        raise UnsupportedSchedule(f"{what}: block_k = {p.block_k} must divide the block columns {c} or be a "
                                  "multiple of them")
    if c % p.down_block_k:
        raise UnsupportedSchedule(f"{what}: down_block_k = {p.down_block_k} must divide the block columns {c}")


def refusal(block: MoEBlock) -> str | None:
    """FP8 weights in whole scale blocks (stream_gemv_fp8's rule); any unquantised block is taken."""
    return whole_blocks_refusal(block, "fused_gemv") if block.weight_format.quantized else None


CHOICES = (
    ("block_f", (4, 8, 16, 32, 64)),
    ("block_k", (64, 128, 256, 512, 1024)),
    ("block_d", (2, 4, 8, 16, 32)),
    ("down_block_k", (32, 64, 128, 256)),
    ("num_warps", (2, 4, 8)),
    ("num_stages", (2, 3, 4, 5)),
    ("prefetch", (True, False)),
    ("pdl", (False, True)),
)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    """CHOICES; on FP8 weights with scale blocks other than 128 x 128 the tile sizes scaled to them too (as
    stream_gemv_fp8's space), less those that cannot align with them."""
    sb = _scale_block(block)
    if sb is None or sb == (128, 128):
        choices = CHOICES
    else:
        r, c = sb
        dims = {"block_f": r, "block_d": r, "block_k": c, "down_block_k": c}

        def values(name: str, vals: tuple) -> tuple:
            if name not in dims:
                return vals
            b = dims[name]
            scaled = {v * b // 128 for v in vals if v * b % 128 == 0 and v * b // 128 >= 2}
            fits = (lambda v: _aligned(v, b)) if name == "block_k" else (lambda v: b % v == 0)
            return tuple(v for v in sorted(set(vals) | scaled) if fits(v))

        choices = tuple((n, values(n, vals)) for n, vals in CHOICES)
    return ParamSpace(FusedGemvParams, choices, check=partial(check, block=block, target=target))


def default_params(block: MoEBlock, T: int, target: Target,
                   constraints: Mapping[str, Any] | None = None) -> FusedGemvParams:
    """The tile rule's pick at T tokens (`tiles.tiles`), with `constraints` over it."""
    key = "fused_gemv@fp8_block" if block.weight_format.quantized else "fused_gemv"
    return make(FusedGemvParams, tiles(key, block, T, target, constraints))


@triton.jit
def _nap(SPIN: tl.constexpr):
    """A short sleep between two polls of a counter (compiled only: PTX nanosleep)."""
    if SPIN:
        tl.inline_asm_elementwise("nanosleep.u32 64; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_down(ok, ec, w_ptr, se, sn, n0, N, K, BD: tl.constexpr, KP: tl.constexpr, KL: tl.constexpr,
                   LINE: tl.constexpr):
    """Ask L2 for the 128-byte lines (LINE elements each, KL of them a row, clamped to K) of rows [n0, n0 + BD)
    (clamped to N) of a token's experts' down weights (ec where ok; an unused lane asks for a used one's)."""
    ec = tl.where(ok, ec, tl.max(ec, axis=0))
    rows = tl.minimum(n0 + tl.arange(0, BD), N - 1)
    cols = tl.minimum(tl.arange(0, KL) * LINE, K - 1)
    _prefetch_l2(w_ptr + ec[:, None, None] * se + rows[None, :, None] * sn + cols[None, None, :])


@triton.jit
def _down_item(h_ptr, s_hp, p, ok, ec, wt, w_ptr, se, sn, sk, s_ptr, sse, ssn, ssk, b_ptr, sbe, sbn, n0, N, K,
               KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
               FP8: tl.constexpr, UE8M0: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr,
               STAGES: tl.constexpr):
    """out[t, n0:n0+BN] = Σ_j w_tj · dequant(down[e_tj]) · h[t·k + j] (token t's pairs: `_token_pairs`), fp32:
    the token's k experts in one [KP, BN, BK] tile per chunk. FP8: BN divides RB and BK divides CB, so one
    scale per expert and chunk multiplies its h chunk. h is read from L2 (.cg): other programs wrote it."""
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    wbase = w_ptr + ec[:, None, None] * se + offs_n[None, :, None] * sn  # [KP, BN, 1]
    hbase = h_ptr + p.to(tl.int64)[:, None] * s_hp  # [KP, 1]
    m3 = ok[:, None, None] & nm[None, :, None]
    acc = tl.zeros([KP, BN, BK], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        hv = tl.load(hbase + offs_k[None, :], mask=ok[:, None] & km[None, :], other=0.0,
                     cache_modifier=".cg").to(tl.float32)  # [KP, BK]
        if FP8:
            s = _scale_of(s_ptr + ec * sse + (n0 // RB) * ssn + (k0 // CB) * ssk, ok, UE8M0)  # [KP]
            hv = hv * s[:, None]
        wv = tl.load(wbase + offs_k[None, None, :] * sk, mask=m3 & km[None, None, :], other=0.0,
                     eviction_policy="evict_first")  # [KP, BN, BK]
        acc += wv.to(tl.float32) * hv[:, None, :]
    y = tl.sum(acc, axis=2)  # [KP, BN]
    if HAS_BIAS:
        b = tl.load(b_ptr + ec[:, None] * sbe + offs_n[None, :] * sbn, mask=ok[:, None] & nm[None, :], other=0.0)
        y += b.to(tl.float32)
    if not W_IN:
        y = y * wt[:, None]
    return tl.sum(y, axis=0)


@triton.jit
def _gate_up_item(x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr, w_ptr, se, sn, sk, up,
                  s_ptr, sse, ssn, ssk, sup, b_ptr, sbe, sbn, bup, h_ptr, s_hp, P, E, D, F, item, alpha, limit,
                  K_TOP: tl.constexpr, BLOCK_E: tl.constexpr, BP: tl.constexpr, FUSED: tl.constexpr,
                  BF: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, FP8: tl.constexpr,
                  UE8M0: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr,
                  STAGES: tl.constexpr):
    """Gate/up item `item` = (slot, F-block): h[pair, f0:f0+BF] of each of the slot's rows (module doc)."""
    nf = tl.cdiv(F, BF)
    slot = item // nf
    f0 = (item - slot * nf) * BF
    ec, st, m, match, mrank = _slot_work(ids_ptr, counts_ptr, P, E, slot, FUSED, BP, BLOCK_E)
    w_e = w_ptr + ec * se
    b_e = b_ptr + ec * sbe
    one = tl.full([1], 1, tl.int1)
    for c in range(0, m):
        pairs = _slot_pairs(sorted_ptr, st, match, mrank, c, one, FUSED, 1, BP)  # [1]
        wt = tl.load(wts_ptr + pairs).to(tl.float32)  # [1]
        tok = tl.sum(pairs, axis=0) // K_TOP
        if FP8:
            CW: tl.constexpr = BK if BK < CB else CB
            J: tl.constexpr = BK // CW
            sc = s_ptr + ec * sse + (f0 // RB) * ssn  # this row block's gate scales
            g, u = _row_gate_up8(x_ptr, s_xt, tok, w_e, sn, up, sc, ssk, sup, f0, D, BF, J, CW, CB, STAGES, UE8M0)
        else:
            g, u = _row_gate_up(x_ptr, s_xt, tok, w_e, sn, sk, up, f0, F, D, BF, BK, STAGES)
        _store_h(h_ptr, s_hp, pairs, one, g[None, :], u[None, :], wt, b_e, sbn, bup, f0, F, alpha, limit, BF, ACT,
                 HAS_BIAS, W_IN)


@triton.jit(do_not_specialize=["T", "P", "n_gate"])
def fused_gemv_kernel(
    x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr,
    gw_ptr, gse, gsn, gsk, gup, gs_ptr, gsse, gssn, gssk, gsup, gb_ptr, gsbe, gsbn, gbup,
    dw_ptr, dse, dsn, dsk, ds_ptr, dsse, dssn, dssk, db_ptr, dsbe, dsbn,
    h_ptr, s_hp, out_ptr, s_ot, sync_ptr,
    T, P, E, D, F, n_gate, alpha, limit,
    K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BP: tl.constexpr, FUSED: tl.constexpr,
    BF: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, DBK: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
    FP8: tl.constexpr, UE8M0: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr,
    UPCAST: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, KL: tl.constexpr,
    LINE: tl.constexpr, SPIN: tl.constexpr, GAP: tl.constexpr,
):
    if PDL:  # the kernel before may still run: nothing it writes (x, ids, the counters) is read before this
        _grid_wait()
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    if ticket < n_gate:
        _gate_up_item(x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr, gw_ptr, gse, gsn, gsk, gup,
                      gs_ptr, gsse, gssn, gssk, gsup, gb_ptr, gsbe, gsbn, gbup, h_ptr, s_hp, P, E, D, F, ticket,
                      alpha, limit, K_TOP, BLOCK_E, BP, FUSED, BF, BK, RB, CB, FP8, UE8M0, ACT, HAS_BIAS, W_IN,
                      STAGES)
        tl.debug_barrier()  # every thread's h stores before the one release below
        tl.atomic_add(sync_ptr + GAP, 1, sem="release")
    else:
        nd = tl.cdiv(D, BD)
        i = ticket - n_gate
        t = i // nd
        n0 = (i - t * nd) * BD
        p, ok, ec, wt = _token_pairs(ids_ptr, wts_ptr, t, E, K_TOP, KP)
        if PREFETCH:
            _prefetch_down(ok, ec, dw_ptr, dse, dsn, n0, D, F, BD, KP, KL, LINE)
        seen = tl.atomic_add(sync_ptr + GAP, 0, sem="acquire")
        while seen < n_gate:
            _nap(SPIN)
            seen = tl.atomic_add(sync_ptr + GAP, 0, sem="acquire")
        tl.debug_barrier()
        if PDL:  # the kernel after may start its launch now (it waits for this one before it reads)
            _grid_release()
        y = _down_item(h_ptr, s_hp, p, ok, ec, wt, dw_ptr, dse, dsn, dsk, ds_ptr, dsse, dssn, dssk,
                       db_ptr, dsbe, dsbn, n0, D, F, KP, BD, DBK, RB, CB, FP8, UE8M0, HAS_BIAS, W_IN, STAGES)
        offs = n0 + tl.arange(0, BD)
        tl.store(out_ptr + t.to(tl.int64) * s_ot + offs, y.to(out_ptr.dtype.element_ty), mask=offs < D)
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + 2 * GAP, 1, sem="acq_rel") == T * nd - 1:  # the last item: reset
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + GAP, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 2 * GAP, 0, sem="release")


def build(block: MoEBlock, schedule: Schedule):
    """ExpertsFn of a fused_gemv schedule (params: FusedGemvParams) on unquantised or fp8_block weights."""
    why = refusal(block)
    if why:
        raise UnsupportedSchedule(why)
    p = schedule.params
    E, k, D, F = block.E, block.k, block.D, block.F
    fp8 = block.weight_format.quantized
    RB, CB = block.weight_format.block if fp8 else (1, 1)
    alpha, limit = act_args(block)
    memo: dict = {}  # call_args' per-weights host work
    syncs: dict = {}  # the counters, per device
    pdl = programmatic(p.pdl)
    spin = not interpreting()

    def counters(device: torch.device) -> torch.Tensor:
        buf = syncs.get(device)
        if buf is None:
            buf = torch.zeros(3 * _GAP, dtype=torch.int32, device=device)
            if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
                syncs[device] = buf  # (one made while a graph is captured is the graph's; not kept)
        return buf

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        if fp8:
            a, gsc, dsc, ue8 = fp8_call_args(block, x, ids, weights, w, memo)
        else:
            a = call_args(block, x, ids, weights, w, memo)
            gsc, dsc, ue8 = w.gate_up, w.down, False  # (no scales: never read)
        T, P, gs, ds = a.T, a.P, a.gs, a.ds
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        if T == 0:
            return out
        ids_f = flat_pairs(ids)  # [P]
        fused = P <= MAX_PAIRS
        counts, sorted_pairs = (ids_f, ids_f) if fused else routing.route(ids, E)
        n_gate = min(P, E) * cdiv(F, p.block_f)
        n_down = T * cdiv(D, p.block_d)
        h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
        line = 128 // w.down.element_size()
        prefetch = p.prefetch and ds.sk == 1 and not interpreting()
        meta = dict(a.meta, KP=next_pow2(k), BP=max(16, next_pow2(P)) if fused else 16, FUSED=fused,
                    BF=p.block_f, BK=p.block_k, BD=p.block_d, DBK=p.down_block_k, RB=RB, CB=CB, FP8=fp8,
                    UE8M0=ue8, STAGES=p.num_stages, PDL=pdl, PREFETCH=prefetch,
                    KL=next_pow2(cdiv(F, line)) if prefetch else 1, LINE=line, SPIN=spin, GAP=_GAP)
        gss = (gsc.stride(0), gsc.stride(1), gsc.stride(2), (F // RB) * gsc.stride(1)) if fp8 else (0, 0, 0, 0)
        dss = (dsc.stride(0), dsc.stride(1), dsc.stride(2)) if fp8 else (0, 0, 0)
        launch(fused_gemv_kernel, (n_gate + n_down,),
            x, x.stride(0), ids_f, a.weights, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.sk, gs.up, gsc, *gss, a.gate_up_bias, gs.sbe, gs.sbn, gs.bup,
            w.down, ds.se, ds.sn, ds.sk, dsc, *dss, a.down_bias, ds.sbe, ds.sbn,
            h, h.stride(0), out, out.stride(0), counters(x.device),
            T, P, E, D, F, n_gate, alpha, limit,
            num_warps=p.num_warps, num_stages=p.num_stages, **meta, **pdl_launch(pdl))
        return out

    run.counters = syncs  # the workspace, per device (tests read it)
    return run


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): each distinct expert's weights (and block scales) once, x in, h out and back, the output;
    routing.py's grouping past MAX_PAIRS pairs."""
    distinct = uniform_distinct(block.E, block.k, tokens)
    ab = DTYPE_BYTES[block.weight_format.compute_dtype] if block.weight_format.quantized else (
        2 if block.weight_dtype != "float32" else 4)
    P = tokens * block.k
    flops = 2.0 * 3 * P * block.D * block.F
    by = distinct * block.weight_bytes_per_expert + 2 * tokens * block.D * ab + 2 * P * block.F * ab
    if P > MAX_PAIRS:
        by += routing.cost(P, block.E)[1]
    return flops, by


KIND = KernelKind("fused_gemv", FusedGemvParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, formats=("none", "fp8_block"))
