"""fused stream_gemv: gate/up, activation and down of every selected expert in ONE launch.

Selected by `GemvParams(down_mode="fused")` (schedule kind stream_gemv); the parameters it reads:

    block_n      BF, width of the F-slice one program owns
    block_k      BK, chunk of D in the gate/up K loop
    rows         RP ∈ {1, 2, 4, 8}: rows of one expert served from one read of the weights (FMA)
    block_d      BD, chunk of D in the down loop
    num_warps, num_stages, fused_route

Grid (F / BF, slots).  Program (f, s) owns expert e_s and the F-slice [f·BF, (f+1)·BF):

    gate/up   g, u [RP, BF] = W_gate/up[e][slice, :] · x[rows]ᵀ      K loop over D, cp.async pipelined
    act       h [RP, BF] = act(g (+ bias), u (+ bias))               (routing weight on x: scaled first)
    down      for each D chunk: y [RP, BD] = down[e][chunk, slice] · h   (+ down bias in slice 0)
              acc[tok, chunk] += w_tj · y                             fp32 atomics, acc [T, D]

so every weight byte is read exactly once, all in one launch with E_active · F/BF programs in flight.
The last program to finish (ticket counter, after a gpu-scope fence) casts acc into out [T, D], then
zeroes acc and the ticket: the workspace is zero again for the next call (and for every replay of a
CUDA graph), so no memset or cast launch is needed.  The workspace (acc [≥ T·D] fp32 + the ticket)
belongs to the built function and one device; calls on the same device must not overlap in time
(one stream, as a model's layers run).

Work items come straight from the ids when P = T·k ≤ PAIR_SLOT_MAX_PAIRS and fused_route is set:
slot s is pair s, and it does the work only when ids[s] is the first occurrence of its expert (O(P)
per program, no routing kernel: one launch in all).  Otherwise routing.py's counts/order (one or two
small launches ahead) and `_find_slot`.  Rows beyond RP of one expert take further passes (re-reading
that expert's slice); sentinel ids outside [0, E) are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ir import MoEBlock, UnsupportedSchedule
from ..common import ExpertTensors
from . import routing
from ._common import (
    H200_SMEM_LIMIT,
    _act,
    _find_slot,
    _row_gate_up,
    _rows_gate_up,
    bias_args,
    check_call,
    consts,
    interpreting,
    layout_strides,
    next_pow2,
)

PAIR_SLOT_MAX_PAIRS = 256  # P above this: the routing kernel groups the pairs (see the docstring)
PAIR_CHUNK = 64  # ids scanned per step by the in-kernel grouping
MAX_ROWS = 8  # RP: FMA rows per weight read (more rows of one expert take more passes)
# fp32 values per thread in the gate/up accumulators + the down product: above these, ptxas (sm_90)
# spilled in the configs compiled by tests/codegen/test_triton_compile.py (the rest of the kernel
# takes ~100–150 registers: loaded tiles, their fp32 copies, addresses)
REG_BUDGET = {1: 96, 2: 80}  # rows = 1; rows ≥ 2


def check(p) -> None:
    """Refuse a fused GemvParams the kernel cannot run (UnsupportedSchedule names the knob)."""
    if p.rows > MAX_ROWS:
        raise UnsupportedSchedule(f"GemvParams rows={p.rows} with down_mode='fused': at most {MAX_ROWS} "
                                  "rows per weight read (FMA; more rows of an expert take more passes)")
    threads = 32 * p.num_warps
    gu = p.rows * p.block_n * p.block_k * 2 // threads
    dn = p.rows * p.block_d * p.block_n // threads
    limit = REG_BUDGET[min(p.rows, 2)]
    if gu + dn > limit:
        raise UnsupportedSchedule(
            f"GemvParams down_mode='fused' rows={p.rows} block_n={p.block_n} block_k={p.block_k} "
            f"block_d={p.block_d} num_warps={p.num_warps}: {gu} gate/up accumulator + {dn} down product "
            f"fp32 registers per thread, limit {limit}; lower block_k/block_d or raise num_warps")
    smem = smem_bytes(p)
    if smem > H200_SMEM_LIMIT:
        raise UnsupportedSchedule(
            f"GemvParams down_mode='fused' block_n={p.block_n} block_k={p.block_k} block_d={p.block_d} "
            f"num_stages={p.num_stages}: needs {smem // 1024} KiB shared memory, limit "
            f"{H200_SMEM_LIMIT // 1024} KiB; lower block_k, block_d or num_stages")


def smem_bytes(p, elem: int = 2) -> int:
    """Pipelined buffers of both K loops (bf16 weights), counted as if they could not share memory."""
    return p.num_stages * (2 * p.block_n * p.block_k + p.block_d * p.block_n) * elem


# ------------------------------------------------------------------------------------ jit helpers


@triton.jit
def _pair_slot(ids_ptr, P, E, slot, BP: tl.constexpr):
    """Slot = pair `slot`: (e, m_e) if ids[slot] is the first pair of a valid expert e, else m = 0."""
    e = tl.load(ids_ptr + slot).to(tl.int32)
    before = 0
    m = 0
    for c0 in range(0, P, BP):
        offs = c0 + tl.arange(0, BP)
        idv = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)  # [BP]
        hit = idv == e
        m += tl.sum(hit.to(tl.int32), axis=0)
        before += tl.sum((hit & (offs < slot)).to(tl.int32), axis=0)
    m = tl.where((e >= 0) & (e < E) & (before == 0), m, 0)
    return e, m


@triton.jit
def _pair_rows(ids_ptr, P, e, c, ROWS: tl.constexpr, BP: tl.constexpr):
    """Pair indices [ROWS] of the c-th .. (c+ROWS−1)-th pairs routed to e, in pair order (0 past the end)."""
    r = tl.arange(0, ROWS)
    pairs = tl.zeros([ROWS], dtype=tl.int32)
    run = 0
    for c0 in range(0, P, BP):
        offs = c0 + tl.arange(0, BP)
        idv = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)  # [BP]
        hit = idv == e
        rank = run + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        sel = hit[None, :] & (rank[None, :] == (c + r)[:, None])  # [ROWS, BP]
        pairs += tl.sum(tl.where(sel, offs[None, :], 0), axis=1)
        run += tl.sum(hit.to(tl.int32), axis=0)
    return pairs


@triton.jit
def _slice_down(acc_ptr, D, toks, rmask, h, scale, w_e, sn, sk, b_e, sbn, first, f0, F,
                ROWS: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
                STAGES: tl.constexpr):
    """acc[toks, :] += scale · (down[e][:, f0:f0+BF] · h (+ bias when `first`)), D chunk by D chunk.
    h [ROWS, BF] fp32, scale [ROWS]; the down tile [BD, BF] is read once for all ROWS rows."""
    offs_f = f0 + tl.arange(0, BF)
    fm = offs_f < F
    wcol = w_e + offs_f[None, :] * sk  # [1, BF]
    arow = acc_ptr + toks.to(tl.int64)[:, None] * D  # [ROWS, 1]
    for d0 in tl.range(0, D, BD, num_stages=STAGES):
        offs_d = d0 + tl.arange(0, BD)
        dm = offs_d < D
        wv = tl.load(wcol + offs_d[:, None] * sn, mask=dm[:, None] & fm[None, :], other=0.0,
                     eviction_policy="evict_first").to(tl.float32)  # [BD, BF]
        y = tl.sum(wv[None, :, :] * h[:, None, :], axis=2)  # [ROWS, BD]
        if HAS_BIAS:
            b = tl.load(b_e + offs_d * sbn, mask=dm & first, other=0.0).to(tl.float32)  # [BD]
            y += b[None, :]
        y = y * scale[:, None]
        tl.atomic_add(arow + offs_d[None, :], y, mask=rmask[:, None] & dm[None, :], sem="relaxed")


@triton.jit(do_not_specialize=["P", "T", "K_TOP", "n_prog"])
def fused_gemv_kernel(
    x_ptr, s_xt, ids_ptr, wts_ptr, counts_ptr, sorted_ptr,
    gu_ptr, gse, gsn, gsk, gup, gb_ptr, gsbe, gsbn, gbup,
    dn_ptr, dse, dsn, dsk, db_ptr, dsbe, dsbn,
    acc_ptr, tick_ptr, out_ptr, s_ot,
    P, T, K_TOP, E, F, D, n_prog, alpha, limit,
    ROUTED: tl.constexpr, BLOCK_E: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
    BF: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr, NT: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, STAGES: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_f = tl.program_id(0)
    slot = tl.program_id(1)
    f0 = pid_f * BF
    offs_f = f0 + tl.arange(0, BF)
    fm = offs_f < F
    if ROUTED:
        e, st, m = _find_slot(counts_ptr, E, slot, 0, False, BLOCK_E)
    else:
        e, m = _pair_slot(ids_ptr, P, E, slot, BP)
        st = 0
    ec = tl.where(m > 0, e, 0).to(tl.int64)
    gw = gu_ptr + ec * gse
    dw = dn_ptr + ec * dse
    gb = gb_ptr + ec * gsbe
    dbe = db_ptr + ec * dsbe
    r = tl.arange(0, ROWS)
    for c in range(0, m, ROWS):
        rmask = c + r < m  # [ROWS]
        if ROUTED:
            pairs = tl.load(sorted_ptr + st + c + r, mask=rmask, other=0)
        else:
            pairs = _pair_rows(ids_ptr, P, e, c, ROWS, BP)
        toks = pairs // K_TOP  # [ROWS]
        wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [ROWS]
        if ROWS == 1:
            g1, u1 = _row_gate_up(x_ptr, s_xt, tl.sum(toks, axis=0), gw, gsn, gsk, gup, f0, F, D,
                                  BF, BK, STAGES)
            g = g1[None, :]  # [1, BF]
            u = u1[None, :]
        else:
            g, u = _rows_gate_up(x_ptr, s_xt, toks, rmask, gw, gsn, gsk, gup, f0, F, D,
                                 ROWS, BF, BK, STAGES)  # [ROWS, BF] each
        if W_IN:
            g = g * wt[:, None]
            u = u * wt[:, None]
        if HAS_BIAS:
            bg = tl.load(gb + offs_f * gsbn, mask=fm, other=0.0).to(tl.float32)  # [BF]
            bu = tl.load(gb + offs_f * gsbn + gbup, mask=fm, other=0.0).to(tl.float32)
            g = g + bg[None, :]
            u = u + bu[None, :]
        h = _act(g, u, ACT, alpha, limit)  # [ROWS, BF] fp32
        if W_IN:
            scale = rmask.to(tl.float32)
        else:
            scale = wt
        _slice_down(acc_ptr, D, toks, rmask, h, scale, dw, dsn, dsk, dbe, dsbn, pid_f == 0, f0, F,
                    ROWS, BF, BD, HAS_BIAS, STAGES)
    # every program takes a ticket once its atomics are visible at gpu scope; the last one casts
    if not INTERP:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [tl.arange(0, NT)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    ticket = tl.atomic_add(tick_ptr, 1, sem="acq_rel")
    if ticket == n_prog - 1:
        n = T * D
        for i0 in range(0, n, BC):
            offs = i0 + tl.arange(0, BC)
            om = offs < n
            v = tl.load(acc_ptr + offs, mask=om, other=0.0, volatile=True)  # [BC] fp32
            tl.store(acc_ptr + offs, tl.zeros([BC], dtype=tl.float32), mask=om)
            t = offs // D
            tl.store(out_ptr + t.to(tl.int64) * s_ot + (offs - t * D), v.to(out_ptr.dtype.element_ty),
                     mask=om)
        tl.atomic_xchg(tick_ptr, 0, sem="relaxed")


# ---------------------------------------------------------------------------------------- launcher


class _Workspace:
    """acc fp32 [capacity] + ticket int32 per device, all zero between calls (the kernel's last program
    restores that).  Growing keeps the old buffers alive: a captured CUDA graph may still use them."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.retired: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get(self, device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        cur = self.live.get(key)
        if cur is None or cur[0].numel() < n:
            if cur is not None:
                self.retired.append(cur)
            cap = max(n, 2 * cur[0].numel() if cur is not None else n)
            cur = (torch.empty(cap, dtype=torch.float32, device=device).zero_(),  # acc [≥ T·D]
                   torch.empty(1, dtype=torch.int32, device=device).zero_())  # ticket
            self.live[key] = cur
        return cur


def build(block: MoEBlock, p):
    """ExpertsFn of a stream_gemv schedule whose GemvParams has down_mode='fused'."""
    E, k, D, F = block.E, block.k, block.D, block.F
    act = block.activation
    alpha, limit = float(act.alpha or 0.0), float(act.limit or 0.0)
    ws = _Workspace()
    interp = interpreting()

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        check_call(block, x, ids, weights, w)
        T = x.shape[0]
        P = T * k
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        if T == 0:
            return out
        gs, ds = layout_strides(block, w)
        gb, db = bias_args(block, w)
        ids_f, wts_f = ids.reshape(-1), weights.reshape(-1)  # [P]
        routed = not (p.fused_route and P <= PAIR_SLOT_MAX_PAIRS)
        if routed:
            counts, sorted_pairs = routing.route(ids, E)
            slots = min(P, E)
        else:
            counts, sorted_pairs = ids_f, ids_f
            slots = P
        acc, tick = ws.get(x.device, T * D)
        cst = consts(block, x, w)
        cst.pop("UPCAST")  # no tl.dot here
        grid = (triton.cdiv(F, p.block_n), slots)
        nt = 32 * p.num_warps
        fused_gemv_kernel[grid](
            x, x.stride(0), ids_f, wts_f, counts, sorted_pairs,
            w.gate_up, gs.se, gs.sn, gs.sk, gs.up, gb, gs.sbe, gs.sbn, gs.bup,
            w.down, ds.se, ds.sn, ds.sk, db, ds.sbe, ds.sbn,
            acc, tick, out, out.stride(0),
            P, T, k, E, F, D, grid[0] * grid[1], alpha, limit,
            ROUTED=routed, BLOCK_E=max(16, next_pow2(E)) if routed else 16, BP=PAIR_CHUNK, ROWS=p.rows,
            BF=p.block_n, BK=p.block_k, BD=p.block_d, BC=max(8 * nt, 1024), NT=nt, STAGES=p.num_stages,
            INTERP=interp, num_warps=p.num_warps, num_stages=p.num_stages, **cst)
        return out

    return run


def cost(block: MoEBlock, params, tokens: int, distinct: float) -> tuple[float, float]:
    """(flops, bytes): each distinct expert's weights once, x per program from L2 (counted once),
    out written, acc read and zeroed by the last program; routing when the ids are not grouped in-kernel."""
    wb = 2 if block.weight_dtype != "float32" else 4
    P = tokens * block.k
    flops = 2.0 * 3 * P * block.D * block.F
    by = distinct * block.weight_bytes_per_expert + 2 * tokens * block.D * wb + 2 * tokens * block.D * 4
    if not (params.fused_route and P <= PAIR_SLOT_MAX_PAIRS):
        by += routing.cost(P, block.E)[1]
    return flops, by
