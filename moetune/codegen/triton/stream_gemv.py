"""stream_gemv: every selected expert's weights streamed from HBM once; no padding rows to a tile.

One kernel, three projections (PROJ):
  0 gate/up   grid (slot, F-block): slot s = s-th distinct selected expert; its rows are served from one
              read of each [BN, BK] weight tile (ROWS = 1: FMA per row; ROWS ≥ 16: rows in passes of
              ROWS through tl.dot, one weight read per pass); SwiGLU fused; h [P, F] in x.dtype.
  1 down      grid (slot, D-block, K split): fp32 partial rows y [S, P, D] · routing weight, then
              combine.py sums splits and the k experts of each token (deterministic).
  2 down      grid (token, D-block): loops over the token's k experts and writes out [T, D] directly,
              one launch, no combine; an expert shared by several tokens is re-read per token.
Work comes from `counts`/`sorted_pairs` (routing.py) or, with `fused_route` and P ≤ 64, from the ids
themselves (`_fused_slot`): then the whole block is two launches (gate/up, down token).
All (token, expert) pairs of a projection run in one launch; the grid is static (min(P, E) slots).

`one_launch` (stream_gemv_one_kernel): gate/up (PROJ 0) and the token-mode down (PROJ 2) in ONE launch,
the down programs after the gate/up ones in block order; they wait on a device counter (release/acquire)
instead of a kernel boundary, so the down weight stream starts in gate/up's tail and pays no launch ramp;
`down_prefetch` columns of each down program's rows are loaded before the wait. With fused_route the
whole block is one launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ..common import ExpertTensors, ParamSpace
from . import combine as _combine
from . import routing
from ._common import (
    FUSED_ROUTE_MAX_PAIRS,
    H200_SMEM_LIMIT,
    _find_slot,
    _fused_pairs,
    _fused_slot,
    _row_down,
    _row_gate_up,
    _rows_down,
    _rows_gate_up,
    _store_h,
    _store_y,
    _tile_down,
    _tile_gate_up,
    _token_down,
    _token_experts,
    act_args,
    call_args,
    cdiv,
    check_pow2,
    dot_smem_bytes,
    is_pow2,
    next_pow2,
)
from .launch import launch


@dataclass(frozen=True)
class GemvParams:
    block_n: int = 8  # gate/up output rows (of F) per program
    block_k: int = 256  # reduction chunk along D
    rows: int = 1  # rows of one expert per weight read: 1..8 FMA (3-D for > 1), ≥ 16 a tl.dot pass
    num_warps: int = 4
    num_stages: int = 4  # depth of the cp.async pipeline of every K loop
    down_block_n: int = 4  # down output rows (of D) per program (token mode: × next_pow2(k) streams)
    down_block_k: int = 128  # reduction chunk along F
    down_warps: int = 4
    down_mode: Literal["token", "expert"] = "token"
    split_k: int = 1  # down, expert mode: F split in this many fp32 partials
    fused_route: bool = True  # P ≤ 64: each program groups the ids itself (no routing kernel)
    one_launch: bool = False  # token-mode down in gate/up's launch, after its programs (num_warps for both)
    down_prefetch: int = 0  # one_launch: columns of F each down program loads before it waits (0 or pow2)

    def __post_init__(self) -> None:
        check_pow2("GemvParams", block_n=self.block_n, block_k=self.block_k, rows=self.rows,
                   down_block_n=self.down_block_n, down_block_k=self.down_block_k,
                   num_warps=self.num_warps, down_warps=self.down_warps)
        if self.down_mode not in ("token", "expert"):
            raise UnsupportedSchedule(f"GemvParams.down_mode = {self.down_mode!r}: 'token' or 'expert'")
        if self.split_k < 1 or (self.split_k > 1 and self.down_mode != "expert"):
            raise UnsupportedSchedule(f"GemvParams.split_k = {self.split_k}: ≥ 1, and > 1 only with "
                                      "down_mode='expert' (the token mode has no partials to combine)")
        if self.one_launch and self.down_mode != "token":
            raise UnsupportedSchedule("GemvParams.one_launch needs down_mode='token' (the expert mode's "
                                      "partials need the combine, a launch of its own)")
        if self.down_prefetch and not (self.one_launch and is_pow2(self.down_prefetch)
                                       and self.down_prefetch >= self.down_block_k):
            raise UnsupportedSchedule(f"GemvParams.down_prefetch = {self.down_prefetch}: 0, or with one_launch a "
                                      f"power of two ≥ down_block_k ({self.down_block_k})")
        if self.rows >= 16:
            smem = dot_smem_bytes(self.rows, self.block_n, self.block_k, self.num_stages, 2)
            if smem > H200_SMEM_LIMIT:
                raise UnsupportedSchedule(
                    f"GemvParams rows={self.rows} block_n={self.block_n} block_k={self.block_k} "
                    f"num_stages={self.num_stages}: needs {smem // 1024} KiB shared memory, limit "
                    f"{H200_SMEM_LIMIT // 1024} KiB; lower block_k or num_stages")
        regs = min(self.rows, 8) * self.block_n * self.block_k * 2 // (32 * self.num_warps)
        if self.rows < 16 and regs > 128:
            raise UnsupportedSchedule(
                f"GemvParams block_n={self.block_n} block_k={self.block_k} num_warps={self.num_warps}: "
                f"{regs} fp32 accumulator registers per thread, limit 128; lower block_k or raise num_warps")


# holds every default of TritonBackend.default (tests/codegen/test_triton_spaces.py): 64-wide tiles for the
# 16-row dot pass, down_block_n 2 for the token-mode down at k > 8
SPACE = ParamSpace(GemvParams, (
    ("block_n", (4, 8, 16, 32, 64)),
    ("block_k", (128, 256, 512, 1024)),
    ("rows", (1, 2, 4, 16)),
    ("num_warps", (4, 8)),
    ("num_stages", (2, 3, 4)),
    ("down_block_n", (2, 4, 8, 16, 32, 64)),
    ("down_block_k", (128, 256, 512)),
    ("down_warps", (4, 8)),
    ("down_mode", ("token", "expert")),
    ("split_k", (1, 2, 4)),
    ("fused_route", (True, False)),
    ("one_launch", (False, True)),
    ("down_prefetch", (0, 256, 512, 1024)),
))


@triton.jit
def _slot_rows(x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr,
               w_ptr, se, sn, sk, up, b_ptr, sbe, sbn, bup, h_ptr, s_hp, y_ptr,
               P, E, N, K, k_split, alpha, limit, slot, ks, n0,
               PROJ: tl.constexpr, K_TOP: tl.constexpr, BLOCK_E: tl.constexpr, BP: tl.constexpr,
               FUSED: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
               STAGES: tl.constexpr):
    """One program's work in expert mode: the rows of the slot-th selected expert, output block n0, K
    split ks; PROJ 0 writes h (SwiGLU fused), PROJ 1 the fp32 partial rows y[ks]."""
    if FUSED:
        e, m, match, mrank = _fused_slot(ids_ptr, P, E, slot, BP)
        st = 0
    else:
        e, st, m = _find_slot(counts_ptr, E, slot, 0, False, BLOCK_E)
    ec = tl.where(m > 0, e, 0).to(tl.int64)
    w_e = w_ptr + ec * se
    b_e = b_ptr + ec * sbe
    k_lo = ks * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    r = tl.arange(0, ROWS)
    for c in range(0, m, ROWS):
        rmask = c + r < m
        if FUSED:
            pairs = _fused_pairs(match, mrank, c, ROWS, BP)
        else:
            pairs = tl.load(sorted_ptr + st + c + r, mask=rmask, other=0)
        wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [ROWS]
        if ROWS == 1:
            pair = tl.sum(pairs, axis=0)
            if PROJ == 0:
                g1, u1 = _row_gate_up(x_ptr, s_xt, pair // K_TOP, w_e, sn, sk, up, n0, N, K,
                                      BN, BK, STAGES)
                g = g1[None, :]
                u = u1[None, :]
            else:
                acc = _row_down(h_ptr + pair.to(tl.int64) * s_hp, w_e, sn, sk, n0, N, k_lo, k_hi,
                                BN, BK, STAGES)[None, :]
        elif ROWS < 16:
            if PROJ == 0:
                g, u = _rows_gate_up(x_ptr, s_xt, pairs // K_TOP, rmask, w_e, sn, sk, up, n0, N, K,
                                     ROWS, BN, BK, STAGES)
            else:
                acc = _rows_down(h_ptr, s_hp, pairs, rmask, w_e, sn, sk, n0, N, k_lo, k_hi,
                                 ROWS, BN, BK, STAGES)
        else:
            if PROJ == 0:
                g, u = _tile_gate_up(x_ptr, s_xt, pairs // K_TOP, rmask, w_e, sn, sk, up, n0, N, K, K,
                                     ROWS, BN, BK, UPCAST, False)
            else:
                acc = _tile_down(h_ptr, s_hp, pairs, rmask, w_e, sn, sk, n0, N, k_lo, k_hi,
                                 ROWS, BN, BK, UPCAST)
        if PROJ == 0:
            _store_h(h_ptr, s_hp, pairs, rmask, g, u, wt, b_e, sbn, bup, n0, N,
                     alpha, limit, BN, ACT, HAS_BIAS, W_IN)
        else:
            _store_y(y_ptr + ks.to(tl.int64) * P * N, pairs, rmask, acc, wt, b_e, sbn,
                     (ks == 0).to(tl.float32), n0, N, BN, HAS_BIAS, W_IN)



@triton.jit(do_not_specialize=["P"])
def stream_gemv_kernel(
    x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr,
    w_ptr, se, sn, sk, up, b_ptr, sbe, sbn, bup,
    h_ptr, s_hp, y_ptr, s_yt,
    P, E, N, K, k_split, alpha, limit,
    PROJ: tl.constexpr, K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BP: tl.constexpr,
    FUSED: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    STAGES: tl.constexpr,
):
    n0 = tl.program_id(1) * BN
    offs_n = n0 + tl.arange(0, BN)
    nm = offs_n < N
    if PROJ == 2:
        t = tl.program_id(0)
        pk, ok, ec, wt = _token_experts(ids_ptr, wts_ptr, t, E, K_TOP, KP)
        out = _token_down(h_ptr, s_hp, pk, ok, ec, wt, w_ptr, se, sn, sk, b_ptr, sbe, sbn, n0, N, K, 0,
                          tl.zeros([KP, BN, BK], dtype=tl.float32), KP, BN, BK, HAS_BIAS, W_IN, STAGES)
        tl.store(y_ptr + t.to(tl.int64) * s_yt + offs_n, out.to(y_ptr.dtype.element_ty), mask=nm)
    else:
        _slot_rows(x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr, w_ptr, se, sn, sk, up, b_ptr, sbe, sbn,
                   bup, h_ptr, s_hp, y_ptr, P, E, N, K, k_split, alpha, limit, tl.program_id(0),
                   tl.program_id(2), n0, PROJ, K_TOP, BLOCK_E, BP, FUSED, ROWS, BN, BK, ACT, HAS_BIAS, W_IN,
                   UPCAST, STAGES)



@triton.jit(do_not_specialize=["P", "T"])
def stream_gemv_one_kernel(
    x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr,
    w_ptr, se, sn, sk, up, b_ptr, sbe, sbn, bup,
    dw_ptr, dse, dsn, dsk, db_ptr, dsbe, dsbn,
    h_ptr, s_hp, out_ptr, s_ot, sync_ptr,
    P, T, E, D, F, slots, n_gu, alpha, limit,
    K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BP: tl.constexpr,
    FUSED: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DBN: tl.constexpr, DBK: tl.constexpr, PRE: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Both projections in one launch (GemvParams.one_launch). Programs [0, n_gu) are gate/up's
    (slot, F-block) programs; each adds 1 to sync[0] with release semantics after its h stores. The
    programs after them are the token-mode down's (token, D-block): each loads its first PRE columns of
    its k experts' down rows (no dependency on h), waits until sync[0] = n_gu (acquire), then reads h.
    Blocks start in index order, so every gate/up program is resident or done before a down program can
    wait: no deadlock. The last down program (ticket sync[1]) zeroes both counters for the next call."""
    pid = tl.program_id(0)
    if pid < n_gu:
        _slot_rows(x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr, w_ptr, se, sn, sk, up, b_ptr, sbe, sbn,
                   bup, h_ptr, s_hp, h_ptr, P, E, F, D, D, alpha, limit, pid % slots, 0, (pid // slots) * BN,
                   0, K_TOP, BLOCK_E, BP, FUSED, ROWS, BN, BK, ACT, HAS_BIAS, W_IN, UPCAST, STAGES)
        # a scalar atomic runs on one thread: the barrier puts every thread's h stores before its release
        tl.debug_barrier()
        tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    else:
        q = pid - n_gu
        t = q % T
        n0 = (q // T) * DBN
        offs_n = n0 + tl.arange(0, DBN)
        nm = offs_n < D
        pk, ok, ec, wt = _token_experts(ids_ptr, wts_ptr, t, E, K_TOP, KP)
        acc = tl.zeros([KP, DBN, DBK], dtype=tl.float32)
        if PRE > 0:  # the first PRE columns of the k experts' rows, in flight while gate/up finishes
            offs_k = tl.arange(0, PRE)
            km = offs_k < F
            wpre = tl.load(dw_ptr + ec[:, None, None] * dse + offs_n[None, :, None] * dsn
                           + offs_k[None, None, :] * dsk,
                           mask=ok[:, None, None] & nm[None, :, None] & km[None, None, :], other=0.0)
        while tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < n_gu:
            pass
        if PRE > 0:
            hv = tl.load(h_ptr + pk.to(tl.int64)[:, None] * s_hp + offs_k[None, :],
                         mask=ok[:, None] & km[None, :], other=0.0)  # [KP, PRE]
            prod = wpre.to(tl.float32) * hv.to(tl.float32)[:, None, :]  # [KP, DBN, PRE]
            acc += tl.sum(tl.reshape(prod, [KP, DBN, PRE // DBK, DBK]), axis=2)
        out = _token_down(h_ptr, s_hp, pk, ok, ec, wt, dw_ptr, dse, dsn, dsk, db_ptr, dsbe, dsbn, n0, D, F, PRE,
                          acc, KP, DBN, DBK, HAS_BIAS, W_IN, STAGES)
        tl.store(out_ptr + t.to(tl.int64) * s_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=nm)
        n_down = tl.num_programs(0) - n_gu
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == n_down - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")

def prefetch_regs(k: int, p: GemvParams) -> int:
    """Registers per thread that hold a one-launch down program's prefetched [KP, down_block_n,
    down_prefetch] 16-bit weights while it waits."""
    return next_pow2(k) * p.down_block_n * p.down_prefetch * 2 // (128 * p.num_warps)


def build(block: MoEBlock, schedule: Schedule):
    """ExpertsFn of a stream_gemv schedule (params: GemvParams or None for the defaults)."""
    p = schedule.params if schedule.params is not None else GemvParams()
    if not isinstance(p, GemvParams):
        raise UnsupportedSchedule(f"stream_gemv takes GemvParams, got {type(p).__name__}")
    E, k, D, F = block.E, block.k, block.D, block.F
    alpha, limit = act_args(block)
    if p.one_launch and prefetch_regs(k, p) > 64:
        raise UnsupportedSchedule(
            f"GemvParams down_prefetch={p.down_prefetch} down_block_n={p.down_block_n} at k={k}: "
            f"{prefetch_regs(k, p)} registers per thread hold the prefetched rows, limit 64; lower either or "
            "raise num_warps")

    memo: dict = {}  # call_args' per-weights host work
    syncs: dict = {}  # one_launch: the two int32 counters per device, zero between calls (_sync)

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a = call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, gb, db, wts_f = a.T, a.P, a.gs, a.ds, a.gate_up_bias, a.down_bias, a.weights
        ids_f = ids.reshape(-1)  # [P]
        fused = p.fused_route and P <= FUSED_ROUTE_MAX_PAIRS
        if fused:
            counts, sorted_pairs = ids_f, ids_f
        else:
            counts, sorted_pairs = routing.route(ids, E)
        meta = dict(a.meta, KP=next_pow2(k), BP=max(16, next_pow2(P)), FUSED=fused, ROWS=p.rows)
        slots = min(P, E)
        h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        if p.one_launch:
            n_gu = slots * cdiv(F, p.block_n)
            launch(stream_gemv_one_kernel, (n_gu + T * cdiv(D, p.down_block_n),),
                x, x.stride(0), ids_f, wts_f, counts, sorted_pairs,
                w.gate_up, gs.se, gs.sn, gs.sk, gs.up, gb, gs.sbe, gs.sbn, gs.bup,
                w.down, ds.se, ds.sn, ds.sk, db, ds.sbe, ds.sbn,
                h, h.stride(0), out, out.stride(0), _sync(syncs, x.device), P, T, E, D, F, slots, n_gu,
                alpha, limit, BN=p.block_n, BK=p.block_k, DBN=p.down_block_n, DBK=p.down_block_k,
                PRE=p.down_prefetch, num_warps=p.num_warps, num_stages=p.num_stages, STAGES=p.num_stages,
                **meta)
            return out
        launch(stream_gemv_kernel, (slots, cdiv(F, p.block_n), 1),
            x, x.stride(0), ids_f, wts_f, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.sk, gs.up, gb, gs.sbe, gs.sbn, gs.bup,
            h, h.stride(0), h, 0, P, E, F, D, D, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, num_warps=p.num_warps, num_stages=p.num_stages,
            STAGES=p.num_stages, **meta)
        if p.down_mode == "token":
            launch(stream_gemv_kernel, (T, cdiv(D, p.down_block_n), 1),
                x, x.stride(0), ids_f, wts_f, counts, sorted_pairs,
                w.down, ds.se, ds.sn, ds.sk, 0, db, ds.sbe, ds.sbn, 0,
                h, h.stride(0), out, out.stride(0), P, E, D, F, F, alpha, limit,
                PROJ=2, BN=p.down_block_n, BK=p.down_block_k, num_warps=p.down_warps,
                num_stages=p.num_stages, STAGES=p.num_stages, **meta)
            return out
        k_split = cdiv(cdiv(F, p.split_k), p.down_block_k) * p.down_block_k
        S = cdiv(F, k_split)
        y = torch.empty(S, P, D, dtype=torch.float32, device=x.device)  # [S, P, D]
        launch(stream_gemv_kernel, (slots, cdiv(D, p.down_block_n), S),
            x, x.stride(0), ids_f, wts_f, counts, sorted_pairs,
            w.down, ds.se, ds.sn, ds.sk, 0, db, ds.sbe, ds.sbn, 0,
            h, h.stride(0), y, 0, P, E, D, F, k_split, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, num_warps=p.down_warps,
            num_stages=p.num_stages, STAGES=p.num_stages, **meta)
        return _combine.combine(y, ids, out, E)

    run.syncs = syncs  # the one-launch counters, for inspection
    return run


def _sync(syncs: dict, device: torch.device) -> torch.Tensor:
    """The one-launch kernel's two counters on this device: zeroed once, at the built function's first call
    there (an eager warm-up before any CUDA-graph capture, so no graph holds a memset), and by the kernel's
    last program at the end of every call. Calls run one after another on a stream; one built function
    must not run on two streams at once (they would share the counters)."""
    buf = syncs.get(device)
    if buf is None:
        buf = syncs[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return buf


def cost(block: MoEBlock, params: GemvParams, tokens: int, distinct: float) -> tuple[float, float]:
    """(flops, bytes): each distinct expert's weights once, x and h traffic, y partials and combine."""
    wb = 2 if block.weight_dtype != "float32" else 4
    P = tokens * block.k
    flops = 2.0 * 3 * P * block.D * block.F
    by = distinct * block.weight_bytes_per_expert + tokens * block.D * wb * 2 + 2 * P * block.F * wb
    if params.down_mode == "expert":
        by += _combine.cost(params.split_k, P, tokens, block.D, wb)[1] + params.split_k * P * block.D * 4
    if not (params.fused_route and P <= FUSED_ROUTE_MAX_PAIRS):
        by += routing.cost(P, block.E)[1]
    return flops, by
