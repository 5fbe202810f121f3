"""Routing preparation on the device: rows per expert and the expert-sorted order of the pairs.

    ids [T, k] ──▶ counts [E] int32     m_e, number of valid pairs routed to expert e
                   sorted_pairs [P]     pair indices p = t·k + j grouped by expert (stable), valid ones first

Every compute kernel derives its own work item (GEMM tile or GEMV slot) from `counts` with one prefix
sum in registers (`_common._find_tile`, `_find_slot`), so this is the whole work list: no host sync,
no torch op chain, capturable in a CUDA graph.  Ids outside [0, E) are dropped.

Counting sort with one-hot tiles [C, E]:
  P ≤ 4·C       one program does both phases (PHASE 2): one launch.
  larger P      G ≤ 64 programs of as few chunks as that allows: PHASE 0 writes per-program histograms
                hist [G, E]; PHASE 1 reads them all ([GB, E] tiles), takes its exclusive prefix and
                scatters its pairs. Two launches.
Workspace: counts E + sorted P + hist G·E int32.

`gather` copies the token rows into expert-sorted order, xs [P, D], for the TMA form of the grouped
GEMM (grouped_gemm.py): there every BLOCK_M tile is one rectangle [row0, row0 + BM) of xs.

With `pdl` (a chain of programmatic dependent launches, _common's module doc) every kernel here releases the
launch after it as it starts; PHASE 1 and the gather, launched programmatically, wait for the kernel before
them first. PHASE 0 / 2, the chain's first, are launched as usual.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _grid_release, _grid_wait
from .launch import launch, pdl_launch
from .layout import cdiv, flat_pairs, next_pow2


@triton.jit
def _histogram(ids_ptr, lo, hi, ei, BLOCK_E: tl.constexpr, C: tl.constexpr):
    """Pairs per expert [BLOCK_E] among pairs [lo, hi), one-hot [C, BLOCK_E] tiles."""
    cnt = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(lo, hi, C):
        p = c0 + tl.arange(0, C)
        idv = tl.load(ids_ptr + p, mask=p < hi, other=-1).to(tl.int32)  # [C]
        cnt += tl.sum((idv[:, None] == ei[None, :]).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _scatter(ids_ptr, sorted_ptr, lo, hi, E, ei, run, C: tl.constexpr):
    """Write pairs [lo, hi) to their stable sorted positions; run [BLOCK_E] is each expert's next free slot."""
    for c0 in range(lo, hi, C):
        p = c0 + tl.arange(0, C)
        idv = tl.load(ids_ptr + p, mask=p < hi, other=-1).to(tl.int32)
        oh = (idv[:, None] == ei[None, :]).to(tl.int32)  # [C, BLOCK_E]
        within = tl.cumsum(oh, axis=0) - oh
        pos = tl.sum(oh * (within + run[None, :]), axis=1)  # [C]
        ok = (idv >= 0) & (idv < E) & (p < hi)
        tl.store(sorted_ptr + pos, p, mask=ok)
        run += tl.sum(oh, axis=0)


@triton.jit
def _hist_prefix(hist_ptr, g, G, ei, BLOCK_E: tl.constexpr, GB: tl.constexpr):
    """(total per expert, sum over programs before g) of the per-program histograms hist [G, BLOCK_E],
    GB rows per load: [GB, BLOCK_E] tiles."""
    cnt = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    gi = tl.arange(0, GB)
    for g0 in range(0, G, GB):
        rows = g0 + gi
        hv = tl.load(hist_ptr + rows[:, None] * BLOCK_E + ei[None, :], mask=(rows < G)[:, None], other=0)
        cnt += tl.sum(hv, axis=0)
        before += tl.sum(tl.where((rows < g)[:, None], hv, 0), axis=0)
    return cnt, before


@triton.jit(do_not_specialize=["P", "per_prog", "G"])
def route_kernel(ids_ptr, counts_ptr, hist_ptr, sorted_ptr, P, E, per_prog, G,
                 PHASE: tl.constexpr, BLOCK_E: tl.constexpr, C: tl.constexpr, GB: tl.constexpr,
                 PDL: tl.constexpr = False):
    if PDL:
        _grid_release()
        if PHASE == 1:
            _grid_wait()
    g = tl.program_id(0)
    ei = tl.arange(0, BLOCK_E)
    lo = g * per_prog
    hi = tl.minimum(lo + per_prog, P)
    if PHASE == 1:  # every program's histogram
        cnt, before = _hist_prefix(hist_ptr, g, G, ei, BLOCK_E, GB)
    else:
        cnt = _histogram(ids_ptr, lo, hi, ei, BLOCK_E, C)
        before = tl.zeros([BLOCK_E], dtype=tl.int32)
    if PHASE == 0:
        tl.store(hist_ptr + g * BLOCK_E + ei, cnt)
    else:
        tl.store(counts_ptr + ei, cnt, mask=(ei < E) & (g == 0))
        _scatter(ids_ptr, sorted_ptr, lo, hi, E, ei, tl.cumsum(cnt, axis=0) - cnt + before, C)


@triton.jit(do_not_specialize=["P"])
def gather_kernel(x_ptr, s_xt, counts_ptr, sorted_ptr, xs_ptr, P, E, D,
                  K_TOP: tl.constexpr, BLOCK_E: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                  PDL: tl.constexpr = False):
    """xs[i, :] = x[token of sorted pair i, :] in xs' dtype, for the valid rows i < Σ_e m_e."""
    if PDL:
        _grid_release()
        _grid_wait()
    ei = tl.arange(0, BLOCK_E)
    total = tl.sum(tl.load(counts_ptr + ei, mask=ei < E, other=0), axis=0)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = rows < total
    pair = tl.load(sorted_ptr + rows, mask=rm, other=0)  # [BR]
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m2 = rm[:, None] & (offs_d < D)[None, :]
    v = tl.load(x_ptr + (pair // K_TOP).to(tl.int64)[:, None] * s_xt + offs_d[None, :], mask=m2)
    tl.store(xs_ptr + rows.to(tl.int64)[:, None] * D + offs_d[None, :], v.to(xs_ptr.dtype.element_ty),
             mask=m2)


def route_plan(P: int, E: int) -> tuple[int, int, int, int]:
    """(BLOCK_E, C, per_prog, G) for P pairs over E experts: G = 1 means one launch.

    Above 4·C pairs, as many programs as chunks of C pairs, up to 64: a program's chunks run one after
    the other (each waits for its ids' load), so fewer chunks per program is less time."""
    block_e = max(16, next_pow2(E))
    c = max(16, min(64, 8192 // block_e))
    if P <= 4 * c:
        return block_e, c, max(P, 1), 1
    g = min(64, cdiv(P, c))
    per = cdiv(cdiv(P, g), c) * c
    return block_e, c, per, cdiv(P, per)


def _hist_rows(G: int, block_e: int) -> int:
    """GB: histogram rows PHASE 1 loads at once, ≤ 4096 elements a tile."""
    return max(1, min(next_pow2(G), 4096 // block_e))


def route(ids: torch.Tensor, E: int, pdl: bool = False,
          hold: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [E] int32 and sorted_pairs [P] int32 of ids [T, k] (any int dtype), on ids' device; `pdl`: the
    first links of a chain of programmatic launches (module doc), whose caller passes `hold`, a list that
    takes the scratch the kernels read (the flat ids, hist) so that it outlives the chain's last launch
    (_common's module doc)."""
    flat = flat_pairs(ids)  # [P]
    P = flat.numel()
    block_e, c, per, g = route_plan(P, E)
    counts = torch.empty(E, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(max(P, 1), dtype=torch.int32, device=ids.device)
    if g == 1:
        launch(route_kernel, (1,), flat, counts, counts, sorted_pairs, P, E, per, 1,
               PHASE=2, BLOCK_E=block_e, C=c, GB=1, num_warps=4, PDL=pdl)
    else:
        hist = torch.empty(g * block_e, dtype=torch.int32, device=ids.device)
        gb = _hist_rows(g, block_e)
        launch(route_kernel, (g,), flat, counts, hist, sorted_pairs, P, E, per, g,
               PHASE=0, BLOCK_E=block_e, C=c, GB=gb, num_warps=4, PDL=pdl)
        launch(route_kernel, (g,), flat, counts, hist, sorted_pairs, P, E, per, g,
               PHASE=1, BLOCK_E=block_e, C=c, GB=gb, num_warps=4, PDL=pdl, **pdl_launch(pdl))
        if hold is not None:
            hold.append(hist)
    if hold is not None:
        hold.append(flat)
    return counts, sorted_pairs


def gather(x: torch.Tensor, counts: torch.Tensor, sorted_pairs: torch.Tensor, k: int,
           dtype: torch.dtype, pdl: bool = False) -> torch.Tensor:
    """xs [P, D] in `dtype`: row i is the token row of sorted pair i (rows past Σ_e m_e unwritten); `pdl`:
    launched programmatically (module doc)."""
    P, (E,), D = sorted_pairs.numel(), counts.shape, x.shape[1]
    xs = torch.empty(P, D, dtype=dtype, device=x.device)  # [P, D]
    br, bd = 16, min(256, next_pow2(D))
    launch(gather_kernel, (cdiv(P, br), cdiv(D, bd)),
        x, x.stride(0), counts, sorted_pairs, xs, P, E, D, K_TOP=k, BLOCK_E=max(16, next_pow2(E)),
        BR=br, BD=bd, num_warps=4, PDL=pdl, **pdl_launch(pdl))
    return xs


def cost(P: int, E: int) -> tuple[float, float]:
    """(flops, bytes) of the routing preparation: ids read twice, counts and the order written."""
    _, _, _, g = route_plan(P, E)
    return 0.0, float(2 * P * 8 + 4 * (E + P) + (2 * g * g * next_pow2(E) * 4 if g > 1 else 0))
