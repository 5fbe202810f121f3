"""Prototype (not in the package): the whole MoE block at a few tokens in ONE persistent Gluon launch whose
down-projection weights stream into shared memory while the gate/up projection runs (one H200 call checks it
against the float32 reference and times it beside the shipped table's schedule, with the bench's method).

Why (bench/results/NOTES.md, "Targets missed"): at qwen3-30b-a3b T = 1 the table's two-launch stream GEMV
takes 26.6 µs against the 19.6 µs target; ncu puts 4-7 µs of ramp and drain on each of its two launches, and
a second launch cannot start streaming the down weights before the first has finished. Session 9's one-launch
attempt kept its down programs spinning in registers; here the down weights go to shared memory instead.

G = D / DR programs (one per SM: ~216 KB of shared memory each, so all are resident and the grid barrier
below cannot deadlock), each with one producer warp and one consumer warpgroup:
  producer  first issues TMA loads of this program's down rows [d0, d0 + DR) of every selected expert (boxes
            [DR, BKD], as many as NB buffers hold: at qwen3-30b-a3b T = 1 22 of the 24 boxes), then streams
            its share of the gate/up rows (balanced: P·F/BF items of [BF, BK] gate and up boxes, a ring of
            SLOTS slots), then puts the next SLOTS down boxes into the ring's slots as the last gate/up steps
            free them (a slot, gate rows then up rows, is one [DR, BKD] down box), all before the barrier;
            boxes beyond that go into the down buffers the consumers release after it.
  consumer  gate/up GEMV from the slots (x from L2), SwiGLU, h [P, F] fp32 to global memory; then a grid
            barrier (release add / acquire spin on a counter that the last program resets, so a CUDA graph
            needs no memset); then the down GEMV of its DR columns over the buffered boxes, the routing weight
            and the sum over each token's k pairs in registers: out [T, D] written once, no combine, no atomics
            on data.

T ≤ TM (x and h of every token and pair are copied to shared memory once each, with one wide load).

    python3 bench/proto_small_t.py --out DIR    # H200: check, then time; the table last
    python bench/proto_small_t.py --compile     # CPU: compile for sm_90 only
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6 / 3.7 names


@gluon.jit
def _stamp(ts_ptr, i, TS: gl.constexpr):
    """With TS: the GPU's global timer (ns) into ts_ptr[i] (phase boundaries of one program)."""
    if TS:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [i], dtype=gl.int64, is_pure=False,
                                      pack=1)
        gl.store(ts_ptr + i, t)
@gluon.jit
def _ids_vec(ids_ptr, P, IDREG: gl.constexpr):
    """With IDREG: the ids of every pair (at most 32) in the producer warp's registers, one load; else nothing."""
    r = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    if IDREG:
        v = gl.load(ids_ptr + r, mask=r < P, other=0).to(gl.int32)
    else:
        v = r * 0
    return r, v


@gluon.jit
def _id(ids_ptr, r, v, i, IDREG: gl.constexpr):
    """Expert of pair i: from the registers (a shuffle sum, no memory latency) or one global load each time. Session
    12: each producer load of an id was one dependent L2 round trip in the single issuing warp."""
    if IDREG:
        e = gl.sum(gl.where(r == i, v, 0), axis=0)
    else:
        e = gl.load(ids_ptr + i).to(gl.int32)
    return e


CFG = dict(BF=8, BK=256, BKD=256, DR=16, SLOTS=8, NB=12, TM=2)  # qwen3-30b-a3b, T ≤ TM: ~200 KB shared


@gluon.jit
def _gu_issue(gu_desc, ids_ptr, idr, idv, halves, ready, empty, item, it, F, NFB: gl.constexpr, NKC: gl.constexpr,
              BF: gl.constexpr, BK: gl.constexpr, SLOTS: gl.constexpr, IDREG: gl.constexpr):
    """The TMA loads of one gate/up item (its gate and up rows [BF, BK], NKC steps) into the ring."""
    e = _id(ids_ptr, idr, idv, item // NFB, IDREG)
    row = e * 2 * F + (item % NFB) * BF
    for kc in range(NKC):
        s = it % SLOTS
        mbarrier.wait(empty.index(s), ((it // SLOTS) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        mbarrier.expect(ready.index(s), 2 * gu_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(gu_desc, [row, kc * BK], ready.index(s), halves.index(2 * s))
        tma.async_copy_global_to_shared(gu_desc, [row + F, kc * BK], ready.index(s), halves.index(2 * s + 1))
        it += 1
    return it


ITQ = gl.constexpr(2)  # DYN: item indices in flight from the producer to the consumers


@gluon.jit
def _itq_push(itq, itq_full, itq_empty, n, item):
    q = n % ITQ
    mbarrier.wait(itq_empty.index(q), ((n // ITQ) & 1) ^ 1)
    itq.index(q).store(gl.full([32], item, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    _cta_barrier()  # the warp's stores before the one-thread arrive
    mbarrier.arrive(itq_full.index(q), count=1)


@gluon.jit
def _itq_pop(itq, itq_full, itq_empty, n, num_warps: gl.constexpr):
    q = n % ITQ
    mbarrier.wait(itq_full.index(q), (n // ITQ) & 1)
    item = gl.max(itq.index(q).load(gl.BlockedLayout([1], [32], [num_warps], [0])), axis=0)
    _cta_barrier()  # every consumer thread's load before the one-thread arrive
    mbarrier.arrive(itq_empty.index(q), count=1)
    return item


@gluon.jit
def _box_sw(dn_desc, bar, buf, i0, stride, row, col):
    """SW: one down box [DR, 4·64] as four 128-byte-swizzled [DR, 64] chunks, chunk kc at buf[i0 + kc·stride]
    (chunk-major within a group of eight boxes, so chunk kc of the group is one [8·DR, 64] operand)."""
    mbarrier.expect(bar, 4 * dn_desc.block_type.nbytes)
    for kc in gl.static_range(4):
        tma.async_copy_global_to_shared(dn_desc, [row, col + kc * 64], bar, buf.index(i0 + kc * stride))


@gluon.jit
def _producer(gu_desc, dn_desc, ids_ptr, work_ptr, ring, ring_sw, halves, ready, empty, dbuf, dready, dempty, itq,
              itq_full, itq_empty, D, F, P, item_lo, item_hi, d0, nbox, n_pre, n_items,
              NFB: gl.constexpr, NKC: gl.constexpr, NC: gl.constexpr, BF: gl.constexpr, BK: gl.constexpr,
              BKD: gl.constexpr, SLOTS: gl.constexpr, NB: gl.constexpr, IDREG: gl.constexpr, DYN: gl.constexpr,
              SW: gl.constexpr):
    idr, idv = _ids_vec(ids_ptr, P, IDREG)
    for b in range(n_pre):  # down rows first: they stream while gate/up runs
        e = _id(ids_ptr, idr, idv, b // NC, IDREG)
        if SW:
            _box_sw(dn_desc, dready.index(b), dbuf, (b // 8) * 32 + b % 8, 8, e * D + d0, (b % NC) * BKD)
        else:
            mbarrier.expect(dready.index(b), dn_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(dn_desc, [e * D + d0, (b % NC) * BKD], dready.index(b), dbuf.index(b))
    it = 0
    if DYN:  # items from the launch's work counter, one ahead; each index handed to the consumers through itq
        item = gl.atomic_add(work_ptr, 1, sem="relaxed", scope="gpu")
        n = 0
        while item < n_items:
            nxt = gl.atomic_add(work_ptr, 1, sem="relaxed", scope="gpu")
            _itq_push(itq, itq_full, itq_empty, n, item)
            n += 1
            it = _gu_issue(gu_desc, ids_ptr, idr, idv, halves, ready, empty, item, it, F, NFB, NKC, BF, BK, SLOTS,
                           IDREG)
            item = nxt
        _itq_push(itq, itq_full, itq_empty, n, -1)  # the end of the items
    else:
        for item in range(item_lo, item_hi):
            it = _gu_issue(gu_desc, ids_ptr, idr, idv, halves, ready, empty, item, it, F, NFB, NKC, BF, BK, SLOTS,
                           IDREG)
    # the gate/up ring is free once its last slot is read: the next down boxes go there, before the barrier
    if SW:  # a box's chunks land across the ring's slots: every slot released first (the steps end on slot 0)
        for sl in gl.static_range(SLOTS):
            mbarrier.wait(empty.index(sl), ((it // SLOTS) & 1) ^ 1)
        for b in range(NB, gl.minimum(nbox, NB + SLOTS)):
            e = _id(ids_ptr, idr, idv, b // NC, IDREG)
            _box_sw(dn_desc, ready.index(b - NB), ring_sw, b - NB, SLOTS, e * D + d0, (b % NC) * BKD)
    else:
        for b in range(NB, gl.minimum(nbox, NB + SLOTS)):
            s = it % SLOTS
            e = _id(ids_ptr, idr, idv, b // NC, IDREG)
            mbarrier.wait(empty.index(s), ((it // SLOTS) & 1) ^ 1)
            mbarrier.expect(ready.index(s), dn_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(dn_desc, [e * D + d0, (b % NC) * BKD], ready.index(s), ring.index(s))
            it += 1
    for b in range(NB + SLOTS, nbox):  # the rest: into the down buffers the consumers release
        q = b - SLOTS
        s = q % NB
        e = _id(ids_ptr, idr, idv, b // NC, IDREG)
        mbarrier.wait(dempty.index(s), ((q // NB) - 1) & 1)
        if SW:
            _box_sw(dn_desc, dready.index(s), dbuf, (s // 8) * 32 + s % 8, 8, e * D + d0, (b % NC) * BKD)
        else:
            mbarrier.expect(dready.index(s), dn_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(dn_desc, [e * D + d0, (b % NC) * BKD], dready.index(s), dbuf.index(s))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _down_mma(out_ptr, ts_ptr, ring, ready, dbuf, dready, dempty, hs, nbox, d0, D, ring_phase, TS: gl.constexpr,
              K_TOP: gl.constexpr, NC: gl.constexpr, BKD: gl.constexpr, DR: gl.constexpr, SLOTS: gl.constexpr,
              NB: gl.constexpr):
    """The down loop on the tensor cores (configuration suffix M): eight boxes at a time as A [8·DR, BKD] (rows of
    box j at j·DR, two boxes per warp), B = the eight boxes' h rows [BKD, 8]; box j's product sits in column j of
    its rows, so the accumulator's block diagonal sums a token's boxes (the other columns are never read).
    mma.sync m16n8k16: 16 per box instead of BKD·DR / 32 FMAs per lane (the FMA loop: 0.6-0.8 µs per four boxes)."""
    gl.static_assert(NB % 8 == 0 and SLOTS % 8 == 0 and (K_TOP * NC) % 8 == 0 and DR == 16)
    ML: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ML, k_width=2)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ML, k_width=2)
    rows2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)  # row-major
    dg8 = dbuf._reinterpret(dbuf.dtype, [NB // 8, 8 * DR, BKD], rows2)
    rg8 = ring._reinterpret(ring.dtype, [SLOTS // 8, 8 * DR, BKD], rows2)
    hg8 = hs._reinterpret(hs.dtype, [hs.type.shape[0] // 8, 8, BKD], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    r = gl.arange(0, 8 * DR, layout=gl.SliceLayout(1, ML))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, ML))
    diag = c[None, :] == (r // DR)[:, None]  # [8·DR, 8]: box j's rows, column j
    RL: gl.constexpr = gl.BlockedLayout([1, DR], [32, 1], [4, 1], [1, 0])  # one row of the 8·DR per thread
    r2 = gl.arange(0, 8 * DR, layout=gl.SliceLayout(1, RL))
    dd = gl.arange(0, DR, layout=gl.SliceLayout(0, RL))
    fold = (r2 % DR)[:, None] == dd[None, :]  # [8·DR, DR]: row j·DR + d → column d
    acc = gl.zeros([8 * DR, 8], gl.float32, ML)
    for g in range(nbox // 8):
        b0 = g * 8
        if b0 == NB:
            _stamp(ts_ptr, 5, TS)  # the boxes of the down buffers done
        if b0 == NB + SLOTS:
            _stamp(ts_ptr, 6, TS)  # the boxes of the ring done
        if b0 < NB:  # boxes b0..b0+7 in down buffers b0..b0+7
            for j in gl.static_range(8):
                mbarrier.wait(dready.index(b0 + j), 0)
            a = dg8.index(g).load(AL)
            fence_async_shared()
            for j in gl.static_range(8):
                mbarrier.arrive(dempty.index(b0 + j), count=1)
        elif b0 < NB + SLOTS:  # in the gate/up ring's slots b0 - NB ..
            for j in gl.static_range(8):
                mbarrier.wait(ready.index(b0 - NB + j), ring_phase)
            a = rg8.index((b0 - NB) // 8).load(AL)
        else:  # streamed into released down buffers
            q0 = b0 - SLOTS
            for j in gl.static_range(8):
                mbarrier.wait(dready.index(q0 % NB + j), (q0 // NB) & 1)
            a = dg8.index((q0 % NB) // 8).load(AL)
            fence_async_shared()
            for j in gl.static_range(8):
                mbarrier.arrive(dempty.index(q0 % NB + j), count=1)
        b = hg8.index(g).permute((1, 0)).load(BL)  # [BKD, 8]
        acc = mma_v2(a, b, acc * (b0 % (K_TOP * NC) != 0).to(gl.float32))  # a token's first group starts anew
        if (b0 + 8) % (K_TOP * NC) == 0:  # this token's boxes done: the block diagonal, then the eight boxes
            v = gl.convert_layout(gl.sum(gl.where(diag, acc, 0.0), axis=1), gl.SliceLayout(1, RL))
            tot = gl.sum(gl.where(fold, v[:, None], 0.0), axis=0)  # [DR]
            gl.store(out_ptr + (b0 // (K_TOP * NC)) * D + d0 + dd, tot.to(gl.bfloat16))


@gluon.jit
def _mma4(src, base, hsw, g, a0, a1, a2, a3, AL: gl.constexpr, BL: gl.constexpr):
    """The four K chunks of a group, one accumulator each (four independent mma.sync chains instead of one)."""
    a0 = mma_v2(src.index(base + 0).load(AL), hsw.index(g * 4 + 0).permute((1, 0)).load(BL), a0)
    a1 = mma_v2(src.index(base + 1).load(AL), hsw.index(g * 4 + 1).permute((1, 0)).load(BL), a1)
    a2 = mma_v2(src.index(base + 2).load(AL), hsw.index(g * 4 + 2).permute((1, 0)).load(BL), a2)
    a3 = mma_v2(src.index(base + 3).load(AL), hsw.index(g * 4 + 3).permute((1, 0)).load(BL), a3)
    return a0, a1, a2, a3


@gluon.jit
def _down_mma_sw(out_ptr, ts_ptr, ring_sw, ready, dbuf, dready, dempty, hsw, nbox, d0, D, ring_phase,
                 TS: gl.constexpr, BAR: gl.constexpr, K_TOP: gl.constexpr, NC: gl.constexpr, DR: gl.constexpr,
                 SLOTS: gl.constexpr, NB: gl.constexpr):
    """The tensor-core down loop on 128-byte-swizzled chunks (suffix S; the unswizzled `_down_mma` read its
    512-byte rows eight-way bank-conflicted: 3.4 µs per eight boxes, session 12 call 4). Eight boxes at a time,
    in four K chunks of 64: A = chunk kc of the eight boxes [8·DR, 64], B = their h rows [64, 8]; box j's product in
    column j of its rows, the block diagonal summed per token."""
    gl.static_assert(NB % 8 == 0 and SLOTS == 8 and (K_TOP * NC) % 8 == 0 and DR == 16)
    ML: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ML, k_width=2)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ML, k_width=2)
    SWL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dmma = dbuf._reinterpret(dbuf.dtype, [NB // 8 * 4, 8 * DR, 64], SWL)
    rmma = ring_sw._reinterpret(ring_sw.dtype, [4, 8 * DR, 64], SWL)
    r = gl.arange(0, 8 * DR, layout=gl.SliceLayout(1, ML))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, ML))
    diag = c[None, :] == (r // DR)[:, None]  # [8·DR, 8]: box j's rows, column j
    RL: gl.constexpr = gl.BlockedLayout([1, DR], [32, 1], [4, 1], [1, 0])  # one row of the 8·DR per thread
    r2 = gl.arange(0, 8 * DR, layout=gl.SliceLayout(1, RL))
    dd = gl.arange(0, DR, layout=gl.SliceLayout(0, RL))
    fold = (r2 % DR)[:, None] == dd[None, :]  # [8·DR, DR]: row j·DR + d → column d
    a0 = gl.zeros([8 * DR, 8], gl.float32, ML)
    a1 = a0
    a2 = a0
    a3 = a0
    for g in range(nbox // 8):
        b0 = g * 8
        if b0 == NB:
            _stamp(ts_ptr, 5, TS)  # the boxes of the down buffers done
        if b0 == NB + SLOTS:
            _stamp(ts_ptr, 6, TS)  # the boxes of the ring done
        keep = (b0 % (K_TOP * NC) != 0).to(gl.float32)  # a token's first group starts anew
        a0 = a0 * keep
        a1 = a1 * keep
        a2 = a2 * keep
        a3 = a3 * keep
        if b0 < NB:  # boxes b0..b0+7 in down buffers b0..b0+7
            for j in gl.static_range(8):
                mbarrier.wait(dready.index(b0 + j), 0)
            if g == 0:
                _stamp(ts_ptr, 7, TS)  # the first group's boxes waited for
            a0, a1, a2, a3 = _mma4(dmma, (b0 // 8) * 4, hsw, g, a0, a1, a2, a3, AL, BL)
            if not BAR or b0 + NB + SLOTS < nbox:
                fence_async_shared()
                for j in gl.static_range(8):
                    mbarrier.arrive(dempty.index(b0 + j), count=1)
        elif b0 < NB + SLOTS:  # in the gate/up ring
            for j in gl.static_range(8):
                mbarrier.wait(ready.index(j), ring_phase)
            a0, a1, a2, a3 = _mma4(rmma, 0, hsw, g, a0, a1, a2, a3, AL, BL)
        else:  # streamed into released down buffers
            q0 = b0 - SLOTS
            for j in gl.static_range(8):
                mbarrier.wait(dready.index(q0 % NB + j), (q0 // NB) & 1)
            a0, a1, a2, a3 = _mma4(dmma, ((q0 % NB) // 8) * 4, hsw, g, a0, a1, a2, a3, AL, BL)
            if not BAR or b0 + NB < nbox:
                fence_async_shared()
                for j in gl.static_range(8):
                    mbarrier.arrive(dempty.index(q0 % NB + j), count=1)
        if (b0 + 8) % (K_TOP * NC) == 0:  # this token's boxes done: the block diagonal, then the eight boxes
            v = gl.convert_layout(gl.sum(gl.where(diag, (a0 + a1) + (a2 + a3), 0.0), axis=1), gl.SliceLayout(1, RL))
            tot = gl.sum(gl.where(fold, v[:, None], 0.0), axis=0)  # [DR]
            gl.store(out_ptr + (b0 // (K_TOP * NC)) * D + d0 + dd, tot.to(gl.bfloat16))


@gluon.jit
def _gu_item(x_ptr, h_ptr, halves, ready, empty, xs3, pr, wv, rows, item, it, F, K_TOP: gl.constexpr,
             NFB: gl.constexpr, NKC: gl.constexpr, BF: gl.constexpr, BK: gl.constexpr, SLOTS: gl.constexpr,
             L: gl.constexpr):
    """Gate/up item `item`: h[p, f0:f0+BF] from the ring's NKC steps, SwiGLU, the routing weight folded in."""
    p = item // NFB
    f0 = (item % NFB) * BF
    xrow = (p // K_TOP) * NKC
    accg = gl.full([BF, BK], 0.0, gl.float32, L)  # products summed over K once, at the item's end
    accu = gl.full([BF, BK], 0.0, gl.float32, L)
    for kc in range(NKC):
        s = it % SLOTS
        mbarrier.wait(ready.index(s), (it // SLOTS) & 1)
        g = halves.index(2 * s).load(L).to(gl.float32)
        u = halves.index(2 * s + 1).load(L).to(gl.float32)
        fence_async_shared()  # the shared loads before the slot's next TMA write
        mbarrier.arrive(empty.index(s), count=1)
        xk = xs3.index(xrow + kc).load(L).to(gl.float32)  # [1, BK]
        accg += g * xk
        accu += u * xk
        it += 1
    gs = gl.sum(accg, axis=1)
    wp = gl.sum(gl.where(pr == p, wv, 0.0), axis=0)
    gl.store(h_ptr + p * F + f0 + rows, (wp * gs / (1.0 + gl.exp(-gs)) * gl.sum(accu, axis=1)).to(gl.bfloat16))
    return it


@gluon.jit
def _consumer(x_ptr, wts_ptr, h_ptr, out_ptr, sync_ptr, ts_ptr, ring, ring_sw, halves, ready, empty, dbuf, dready,
              dempty, xs, hs, itq, itq_full, itq_empty, D, F, P, item_lo, item_hi, d0, nbox, G, TS: gl.constexpr,
              LATE: gl.constexpr,
              K_TOP: gl.constexpr, NFB: gl.constexpr, NKC: gl.constexpr, NC: gl.constexpr, BF: gl.constexpr,
              BK: gl.constexpr, BKD: gl.constexpr, DR: gl.constexpr, SLOTS: gl.constexpr, NB: gl.constexpr,
              num_warps: gl.constexpr, MMA: gl.constexpr, LOWP: gl.constexpr, BAR: gl.constexpr,
              DYN: gl.constexpr, SW: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])  # a warp reads 512 B of a row
    V: gl.constexpr = gl.SliceLayout(0, L)
    _stamp(ts_ptr, 0, TS)
    # every pair's routing weight in every thread (one load): applied to h, so the down loop needs none
    PM: gl.constexpr = 32  # pairs at most (TM · K_TOP)
    WL: gl.constexpr = gl.BlockedLayout([PM], [32], [num_warps], [0])
    pr = gl.arange(0, PM, layout=WL)
    wv = gl.load(wts_ptr + pr, mask=pr < P, other=0.0).to(gl.float32)
    # x of every token into shared memory with one wide load (row r: x[r // NKC, (r % NKC)·BK:][:BK])
    xr = gl.arange(0, xs.type.shape[0], layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, BK, layout=V)
    xs.store(gl.load(x_ptr + xr[:, None] * BK + cols[None, :], mask=(xr < (P // K_TOP) * NKC)[:, None], other=0.0))
    xs3 = xs._reinterpret(xs.dtype, [xs.type.shape[0], 1, BK], xs.layout)  # rows one at a time, [1, BK]
    _cta_barrier()
    rows = gl.arange(0, BF, layout=gl.SliceLayout(1, L))
    it = 0
    if DYN:
        n = 0
        item = _itq_pop(itq, itq_full, itq_empty, n, num_warps)
        while item >= 0:
            it = _gu_item(x_ptr, h_ptr, halves, ready, empty, xs3, pr, wv, rows, item, it, F, K_TOP, NFB, NKC, BF, BK,
                          SLOTS, L)
            n += 1
            item = _itq_pop(itq, itq_full, itq_empty, n, num_warps)
    else:
        for item in range(item_lo, item_hi):
            it = _gu_item(x_ptr, h_ptr, halves, ready, empty, xs3, pr, wv, rows, item, it, F, K_TOP, NFB, NKC, BF, BK,
                          SLOTS, L)
    # grid barrier: every program's h stores before any program's h loads
    _stamp(ts_ptr, 1, TS)
    _cta_barrier()  # this warpgroup's stores before the one-thread release below
    if BAR:  # epoch barrier on sync[2], which only grows: no second round of atomics to reset it (G a power of 2)
        old = gl.atomic_add(sync_ptr + 2, 1, sem="release", scope="gpu")
        target = old - (old & (G - 1)) + G  # the end of this launch's epoch; wrap-safe compare below
        if DYN and (old & (G - 1)) == G - 1:  # the last arrival: every program's grabs are done, reset the counter
            gl.atomic_xchg(sync_ptr + 3, 0, sem="relaxed", scope="gpu")
        while gl.atomic_add(sync_ptr + 2, 0, sem="acquire", scope="gpu") - target < 0:
            pass
    else:
        gl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
        while gl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < G:
            pass
        if gl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:  # the last one through resets
            gl.atomic_add(sync_ptr, -G, sem="relaxed", scope="gpu")
            gl.atomic_add(sync_ptr + 1, -G, sem="relaxed", scope="gpu")
    _stamp(ts_ptr, 2, TS)
    # all of h into shared memory with one wide load from L2 (row r: h[r // NC, (r % NC)·BKD:][:BKD])
    if SW:  # h in the chunked arrangement: index 4·g + kc holds rows 8g..8g+7, columns kc·64..kc·64+63
        HL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        rr = gl.arange(0, hs.type.shape[0] * 8, layout=gl.SliceLayout(1, HL))[:, None]  # row of the 2-D view
        hc = gl.arange(0, 64, layout=gl.SliceLayout(0, HL))[None, :]
        hrow = 8 * (rr // 32) + rr % 8  # index rr // 8 = 4·g + kc, its row rr % 8
        hs2 = hs._reinterpret(hs.dtype, [hs.type.shape[0] * 8, 64], hs.layout)
        hs2.store(gl.load(h_ptr + hrow * BKD + ((rr // 8) % 4) * 64 + hc, mask=hrow < P * NC, other=0.0,
                          cache_modifier=".cg"))
    else:
        hr = gl.arange(0, hs.type.shape[0], layout=gl.SliceLayout(1, L))
        dcols = gl.arange(0, BKD, layout=V)
        hs.store(gl.load(h_ptr + hr[:, None] * BKD + dcols[None, :], mask=(hr < P * NC)[:, None], other=0.0,
                         cache_modifier=".cg"))
    _cta_barrier()
    _stamp(ts_ptr, 4, TS)
    if SW:
        gl.static_assert(NKC % SLOTS == 0)  # the gate/up steps end on slot 0
        _down_mma_sw(out_ptr, ts_ptr, ring_sw, ready, dbuf, dready, dempty, hs, nbox, d0, D, (it // SLOTS) & 1, TS,
                     BAR, K_TOP, NC, DR, SLOTS, NB)
    elif MMA:
        gl.static_assert(NKC % SLOTS == 0)  # the gate/up steps end on slot 0: ring box j is in slot j
        _down_mma(out_ptr, ts_ptr, ring, ready, dbuf, dready, dempty, hs, nbox, d0, D, (it // SLOTS) & 1, TS, K_TOP,
                  NC, BKD, DR, SLOTS, NB)
    else:
        # down, 4 boxes at a time, one per warp: out[t, d0:d0+DR] = Σ_boxes of t (w_p · h[p]) · W[e_p, d0:d0+DR, :]ᵀ
        gl.static_assert((num_warps == 4 or num_warps == 8) and NB % 4 == 0 and SLOTS % 4 == 0
                         and (K_TOP * NC) % 4 == 0)
        gl.static_assert(NKC % SLOTS == 0)  # the gate/up steps end on slot 0: ring box j is in slot j
        # warps [4, W/4]: box j of a group to warp row j; with 8 warps each of its two warps takes half the rows
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [4, num_warps // 4, 1], [2, 1, 0])
        S2: gl.constexpr = gl.SliceLayout(2, L3)
        rows3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)  # row-major
        dgroups = dbuf._reinterpret(dbuf.dtype, [NB // 4, 4, DR, BKD], rows3)
        rgroups = ring._reinterpret(ring.dtype, [SLOTS // 4, 4, DR, BKD], rows3)
        hgroups = hs._reinterpret(hs.dtype, [hs.type.shape[0] // 4, 4, 1, BKD],
                                  gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        drows = gl.arange(0, DR, layout=gl.SliceLayout(0, S2))
        acc = gl.full([DR], 0.0, gl.float32, gl.SliceLayout(0, S2))
        acc_l = gl.sum(gl.reshape(gl.full([4, DR, BKD], 0.0, gl.float32, L3), [4, DR, 32, BKD // 32]), axis=3)
        ring_phase = (it // SLOTS) & 1
        for g in range(nbox // 4):
            b0 = g * 4
            if b0 == NB:
                _stamp(ts_ptr, 5, TS)  # the boxes of the down buffers done
            if b0 == NB + SLOTS:
                _stamp(ts_ptr, 6, TS)  # the boxes of the ring done
            if b0 < NB:  # boxes b0..b0+3 in down buffers b0..b0+3
                for j in gl.static_range(4):
                    mbarrier.wait(dready.index(b0 + j), 0)
                w = dgroups.index(g).load(L3)
                if not BAR or b0 + NB + SLOTS < nbox:  # BAR: only buffers a later box reuses are released
                    fence_async_shared()
                    for j in gl.static_range(4):
                        mbarrier.arrive(dempty.index(b0 + j), count=1)
            elif b0 < NB + SLOTS:  # in the gate/up ring's slots b0 - NB ..
                for j in gl.static_range(4):
                    mbarrier.wait(ready.index(b0 - NB + j), ring_phase)
                w = rgroups.index((b0 - NB) // 4).load(L3)
            else:  # streamed into released down buffers
                q0 = b0 - SLOTS
                for j in gl.static_range(4):
                    mbarrier.wait(dready.index(q0 % NB + j), (q0 // NB) & 1)
                w = dgroups.index((q0 % NB) // 4).load(L3)
                if not BAR or b0 + NB < nbox:
                    fence_async_shared()
                    for j in gl.static_range(4):
                        mbarrier.arrive(dempty.index(q0 % NB + j), count=1)
            if LOWP:  # bf16 products summed in bf16 inside each thread (packed bf16x2 math), then fp32
                part = gl.reduce(gl.reshape(w * hgroups.index(g).load(L3), [4, DR, 32, BKD // 32]), 3,
                                 _add).to(gl.float32)  # [4, DR, 32]
                prod = part  # (unused)
            else:
                prod = w.to(gl.float32) * hgroups.index(g).load(L3).to(gl.float32)  # [4, DR, BKD]
                part = gl.sum(gl.reshape(prod, [4, DR, 32, BKD // 32]), axis=3)  # [4, DR, 32]
            if LATE or LOWP:  # sums inside each thread only; across lanes and warps once per token
                acc_l = acc_l * (b0 % (K_TOP * NC) != 0).to(gl.float32) + part  # a token's first group starts anew
                if (b0 + 4) % (K_TOP * NC) == 0:  # this token's boxes done
                    tot = gl.convert_layout(gl.sum(gl.sum(acc_l, axis=2), axis=0), gl.SliceLayout(0, S2))
                    gl.store(out_ptr + (b0 // (K_TOP * NC)) * D + d0 + drows, tot.to(gl.bfloat16))
            else:
                acc += gl.sum(gl.sum(prod, axis=2), axis=0)  # [DR]: across the warps at every group
                if (b0 + 4) % (K_TOP * NC) == 0:  # this token's boxes done
                    gl.store(out_ptr + (b0 // (K_TOP * NC)) * D + d0 + drows, acc.to(gl.bfloat16))
                    acc = acc * 0.0
    _stamp(ts_ptr, 3, TS)


@gluon.jit
def small_t_kernel(gu_desc, dn_desc, x_ptr, ids_ptr, wts_ptr, h_ptr, out_ptr, sync_ptr, ts_ptr,
                   D, F, P, n_items, nbox, n_pre, G,
                   K_TOP: gl.constexpr, XR: gl.constexpr, HR: gl.constexpr, NFB: gl.constexpr, NKC: gl.constexpr,
                   NC: gl.constexpr, BF: gl.constexpr,
                   BK: gl.constexpr, BKD: gl.constexpr, DR: gl.constexpr, SLOTS: gl.constexpr, NB: gl.constexpr,
                   num_warps: gl.constexpr, TS: gl.constexpr = False, LATE: gl.constexpr = False,
                   IDREG: gl.constexpr = False, MMA: gl.constexpr = False, LOWP: gl.constexpr = False,
                   BAR: gl.constexpr = False, DYN: gl.constexpr = False, SW: gl.constexpr = False):
    cta = gl.program_id(0)
    gl.static_assert(BAR or not DYN)  # the barrier's last arrival resets the work counter
    item_lo = cta * n_items // G
    item_hi = (cta + 1) * n_items // G
    d0 = cta * DR
    gl.static_assert(2 * BF == DR and BK == BKD)  # a ring slot (gate rows, then up rows) holds one down box
    if SW:  # 128-byte-swizzled [DR, 64] chunks (the down descriptor's boxes); gate/up sees the ring unswizzled
        ring_sw = gl.allocate_shared_memory(dn_desc.dtype, [4 * SLOTS, DR, 64], dn_desc.layout)
        ring = ring_sw._reinterpret(gu_desc.dtype, [SLOTS, 2 * BF, BK], gu_desc.layout)
        dbuf = gl.allocate_shared_memory(dn_desc.dtype, [4 * NB, DR, 64], dn_desc.layout)
        hs = gl.allocate_shared_memory(gl.bfloat16, [HR // 8 * 4, 8, 64], dn_desc.layout)
    else:
        ring = gl.allocate_shared_memory(gu_desc.dtype, [SLOTS, 2 * BF, BK], gu_desc.layout)
        ring_sw = ring
        dbuf = gl.allocate_shared_memory(dn_desc.dtype, [NB, DR, BKD], dn_desc.layout)
        hs = gl.allocate_shared_memory(gl.bfloat16, [HR, BKD], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    halves = ring._reinterpret(gu_desc.dtype, [2 * SLOTS, BF, BK], gu_desc.layout)  # even: gate, odd: up
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    dready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    dempty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    xs = gl.allocate_shared_memory(gl.bfloat16, [XR, BK], flat)  # x rows of every token, BK at a time
    itq = gl.allocate_shared_memory(gl.int32, [ITQ, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # DYN: items
    itq_full = gl.allocate_shared_memory(gl.int64, [ITQ, 1], mbarrier.MBarrierLayout())
    itq_empty = gl.allocate_shared_memory(gl.int64, [ITQ, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(ITQ):
        mbarrier.init(itq_full.index(i), count=1)
        mbarrier.init(itq_empty.index(i), count=1)
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(NB):
        mbarrier.init(dready.index(i), count=1)
        mbarrier.init(dempty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (x_ptr, wts_ptr, h_ptr, out_ptr, sync_ptr, ts_ptr + cta * 8, ring, ring_sw, halves, ready, empty,
                     dbuf, dready, dempty, xs, hs, itq, itq_full, itq_empty, D, F, P, item_lo, item_hi, d0, nbox, G,
                     TS, LATE, K_TOP, NFB, NKC, NC, BF, BK, BKD, DR, SLOTS, NB, num_warps, MMA, LOWP, BAR, DYN, SW)),
        (_producer, (gu_desc, dn_desc, ids_ptr, sync_ptr + 3, ring, ring_sw, halves, ready, empty, dbuf, dready,
                     dempty, itq, itq_full, itq_empty, D, F, P, item_lo, item_hi, d0, nbox, n_pre, n_items, NFB, NKC,
                     NC, BF, BK, BKD, SLOTS, NB, IDREG, DYN, SW)),
    ], [1], [24])


def _layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)  # rows read whole, no swizzle


def _down_box(c: dict) -> tuple[list[int], object]:
    """The down descriptor's box and layout: [DR, BKD] unswizzled, or with S [DR, 64] 128-byte-swizzled chunks."""
    if c.get("SW"):
        return [c["DR"], 64], gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return [c["DR"], c["BKD"]], _layout()


def _constexprs(k: int, D: int, F: int, c: dict) -> dict:
    return dict(K_TOP=k, XR=c["TM"] * D // c["BK"], HR=triton.next_power_of_2(c["TM"] * k * F // c["BKD"]),
                NFB=F // c["BF"],
                NKC=D // c["BK"], NC=F // c["BKD"], BF=c["BF"], BK=c["BK"], BKD=c["BKD"], DR=c["DR"],
                SLOTS=c["SLOTS"], NB=c["NB"], LATE=c.get("LATE", False), num_warps=c.get("W", 4),
                IDREG=c.get("IDREG", False), MMA=c.get("MMA", False), LOWP=c.get("LOWP", False),
                BAR=c.get("BAR", False), DYN=c.get("DYN", False), SW=c.get("SW", False))


def compile_sm90(K_TOP=8, D=2048, F=768, ts=False, **cfg):
    """Compile for sm_90 (no GPU needed): (shared bytes, ptx); ts: with the phase time stamps."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    c = dict(CFG, **cfg)
    lay = _layout()
    sig = {"gu_desc": f"tensordesc<bf16[{c['BF']}, {c['BK']}],{lay!r}>",
           "dn_desc": "tensordesc<bf16[{}, {}],{!r}>".format(*_down_box(c)[0], _down_box(c)[1]),
           "x_ptr": "*bf16", "ids_ptr": "*i64", "wts_ptr": "*bf16", "h_ptr": "*bf16", "out_ptr": "*bf16",
           "sync_ptr": "*i32", "ts_ptr": "*i64"}
    sig.update({n: "i32" for n in ("D", "F", "P", "n_items", "nbox", "n_pre", "G")})
    cx = dict(_constexprs(K_TOP, D, F, c), TS=ts)
    names = list(small_t_kernel.arg_names)  # the kernel's own parameter order
    sig.update({n: "constexpr" for n in cx})
    sig = {n: sig[n] for n in names}
    src = GluonASTSource(small_t_kernel, sig, constexprs={(names.index(n),): v for n, v in cx.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=c.get("W", 4)))
    return k.metadata.shared, k.asm["ptx"]


_SYNC: dict = {}


def small_t(x, ids, wt, w, ts=None, **cfg):
    """out [T, D] of the block (bf16 x, ids [T, k], routing weights wt [T, k], weights w) in one launch."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    c = dict(CFG, **cfg)
    T, k = ids.shape
    E, F2, D = w.gate_up.shape
    F = F2 // 2
    P = T * k
    G = D // c["DR"]
    n_items, nbox = P * (F // c["BF"]), P * (F // c["BKD"])
    lay = _layout()
    gu = TensorDescriptor(w.gate_up, [E * F2, D], [D, 1], [c["BF"], c["BK"]], lay)
    dn = TensorDescriptor(w.down, [E * D, F], [F, 1], *_down_box(c))
    sync = _SYNC.get(x.device)
    if sync is None:
        sync = _SYNC[x.device] = torch.zeros(4, dtype=torch.int32, device=x.device)
    h = torch.empty(P, F, dtype=torch.bfloat16, device=x.device)
    out = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    if c.get("BAR") and G & (G - 1):
        raise ValueError(f"small_t: the epoch barrier needs a power-of-2 grid, G = {G}")
    if T > c["TM"] or T * k > 32:
        raise ValueError(f"small_t: T = {T} > TM = {c['TM']} (the shared-memory copies of x and h)")
    if c.get("DYN") and not c.get("BAR"):
        raise ValueError("small_t: dynamic items (D) need the epoch barrier (B), whose last arrival resets them")
    small_t_kernel[(G,)](gu, dn, x, ids, wt, h, out, sync, sync if ts is None else ts, D, F, P, n_items, nbox,
                         min(nbox, c["NB"]), G, TS=ts is not None, **_constexprs(k, D, F, c))
    return out


# ---- FIFO variant (configuration NF: a ring of N slots): the down projection runs pair by pair during gate/up ----
# Gate/up items are dealt round-robin in pair-major order (program c takes items c, c + G, ...), so pair p's h is
# whole after round ((p + 1)·NFB − 1) // G. Each program adds 1 to the pair's counter per item it stores
# (release). One ring of SLOTS slots carries everything the program reads, in the order its consumer uses it:
# round j's gate/up item (NKC slots of [2·BF, BK]), then the down boxes ([DR, BKD], the same bytes) of the groups
# that round multiplies; the producer never waits for anything but the consumer's progress through the ring, so
# the stream stays SLOTS deep. The consumer, in round j: gate/up item j; the groups whose h it loaded in round
# j − 1 (registers); then it waits (acquire) for the pairs whole by round j − 1 and loads their h for round j + 1,
# so neither the wait nor the load stands between two ring reads. Left after gate/up: the last rounds' pairs only
# (the one-barrier kernel above left every down box: 0.6-0.8 µs per group of four after its barrier).
# Session 12 call 1 measured a first version (a second ring for the down boxes, h loaded after the wait, in the
# same round): correct, but 4.1 µs per round, 34.9 against the table's 26.8 µs at T = 1 (commit b8fa0b5).

# groups of four boxes one round may hand to the next at most (their h in registers; `fifo_plan` checks)
GPR = gl.constexpr(3)


@gluon.jit
def _pdone(r, P, G, NFB: gl.constexpr):
    """Pairs whose gate/up items all lie in rounds ≤ r (0 for r < 0)."""
    return gl.maximum(gl.minimum(P, G * (r + 1) // NFB), 0)


@gluon.jit
def _q(j, P, G, NFB: gl.constexpr, NC: gl.constexpr):
    """Groups of four down boxes the consumer has multiplied, or holds h for, when round j begins."""
    return _pdone(j - 2, P, G, NFB) * NC // 4


@gluon.jit
def _ring_box(dn_desc, ids_ptr, idr, idv, ring, ready, empty, it, b, D, d0,
              NC: gl.constexpr, BKD: gl.constexpr, SLOTS: gl.constexpr, IDREG: gl.constexpr):
    s = it % SLOTS
    mbarrier.wait(empty.index(s), ((it // SLOTS) & 1) ^ 1)
    e = _id(ids_ptr, idr, idv, b // NC, IDREG)
    mbarrier.expect(ready.index(s), dn_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(dn_desc, [e * D + d0, (b % NC) * BKD], ready.index(s), ring.index(s))


@gluon.jit
def _producer_fifo(gu_desc, dn_desc, ids_ptr, ring, halves, ready, empty, D, F, P, n_items, nbox, G, cta, R, d0,
                   NFB: gl.constexpr, NKC: gl.constexpr, NC: gl.constexpr, BF: gl.constexpr, BK: gl.constexpr,
                   BKD: gl.constexpr, SLOTS: gl.constexpr, IDREG: gl.constexpr):
    idr, idv = _ids_vec(ids_ptr, P, IDREG)
    it = 0
    for j in range(R):
        item = cta + j * G
        if item < n_items:
            e = _id(ids_ptr, idr, idv, item // NFB, IDREG)
            row = e * 2 * F + (item % NFB) * BF
            for kc in range(NKC):
                s = it % SLOTS
                mbarrier.wait(empty.index(s), ((it // SLOTS) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
                mbarrier.expect(ready.index(s), 2 * gu_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(gu_desc, [row, kc * BK], ready.index(s), halves.index(2 * s))
                tma.async_copy_global_to_shared(gu_desc, [row + F, kc * BK], ready.index(s),
                                                halves.index(2 * s + 1))
                it += 1
        for b in range(4 * _q(j - 1, P, G, NFB, NC), 4 * _q(j, P, G, NFB, NC)):  # the groups round j multiplies
            _ring_box(dn_desc, ids_ptr, idr, idv, ring, ready, empty, it, b, D, d0, NC, BKD, SLOTS, IDREG)
            it += 1
    for b in range(4 * _q(R - 1, P, G, NFB, NC), nbox):  # the rest, in order
        _ring_box(dn_desc, ids_ptr, idr, idv, ring, ready, empty, it, b, D, d0, NC, BKD, SLOTS, IDREG)
        it += 1


@gluon.jit
def _group(ring, ready, empty, it, hv, acc_l, out_ptr, b0, d0, D, K_TOP: gl.constexpr, NC: gl.constexpr,
           BKD: gl.constexpr, DR: gl.constexpr, SLOTS: gl.constexpr, L3: gl.constexpr):
    """Down boxes b0..b0+3 from ring slots it..it+3 times their h rows hv [4, 1, BKD]; a token's last group stores."""
    S2: gl.constexpr = gl.SliceLayout(2, L3)
    rows3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
    rgroups = ring._reinterpret(ring.dtype, [SLOTS // 4, 4, DR, BKD], rows3)
    s0 = it % SLOTS
    for jj in gl.static_range(4):
        mbarrier.wait(ready.index(s0 + jj), (it // SLOTS) & 1)
    w = rgroups.index(s0 // 4).load(L3)
    fence_async_shared()
    for jj in gl.static_range(4):
        mbarrier.arrive(empty.index(s0 + jj), count=1)
    prod = w.to(gl.float32) * hv.to(gl.float32)  # [4, DR, BKD]
    part = gl.sum(gl.reshape(prod, [4, DR, 32, BKD // 32]), axis=3)  # [4, DR, 32]: sums inside each thread
    acc_l = acc_l * (b0 % (K_TOP * NC) != 0).to(gl.float32) + part  # a token's first group starts anew
    if (b0 + 4) % (K_TOP * NC) == 0:  # this token's boxes done: across lanes and warps once
        tot = gl.convert_layout(gl.sum(gl.sum(acc_l, axis=2), axis=0), gl.SliceLayout(0, S2))
        gl.store(out_ptr + (b0 // (K_TOP * NC)) * D + d0 + gl.arange(0, DR, layout=gl.SliceLayout(0, S2)),
                 tot.to(gl.bfloat16))
    return acc_l


@gluon.jit
def _wait_pairs(cnt_ptr, pw, pd, NFB: gl.constexpr):
    while pw < pd:
        while gl.atomic_add(cnt_ptr + pw, 0, sem="acquire", scope="gpu") < NFB:
            pass
        pw += 1
    return pw


@gluon.jit
def _consumer_fifo(x_ptr, wts_ptr, h_ptr, out_ptr, cnt_ptr, ts_ptr, ring, halves, ready, empty, xs,
                   D, F, P, n_items, nbox, G, cta, R, d0, TS: gl.constexpr, K_TOP: gl.constexpr,
                   NFB: gl.constexpr, NKC: gl.constexpr, NC: gl.constexpr, BF: gl.constexpr, BK: gl.constexpr,
                   BKD: gl.constexpr, DR: gl.constexpr, SLOTS: gl.constexpr, PM: gl.constexpr,
                   num_warps: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])  # a warp reads 512 B of a row
    V: gl.constexpr = gl.SliceLayout(0, L)
    _stamp(ts_ptr, 0, TS)
    WL: gl.constexpr = gl.BlockedLayout([PM], [32], [num_warps], [0])
    pr = gl.arange(0, PM, layout=WL)
    wv = gl.load(wts_ptr + pr, mask=pr < P, other=0.0).to(gl.float32)  # every pair's routing weight
    xr = gl.arange(0, xs.type.shape[0], layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, BK, layout=V)
    xs.store(gl.load(x_ptr + xr[:, None] * BK + cols[None, :], mask=(xr < (P // K_TOP) * NKC)[:, None], other=0.0))
    xs3 = xs._reinterpret(xs.dtype, [xs.type.shape[0], 1, BK], xs.layout)
    _cta_barrier()
    rows = gl.arange(0, BF, layout=gl.SliceLayout(1, L))
    gl.static_assert(num_warps == 4 and SLOTS % 4 == 0 and NKC % 4 == 0 and (K_TOP * NC) % 4 == 0 and 2 * BF == DR)
    gl.static_assert(GPR == 3)
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [4, 1, 1], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(2, L3)
    i4 = gl.arange(0, 4, layout=gl.SliceLayout(1, S2))
    hc = gl.arange(0, BKD, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    hoff = i4[:, None, None] * BKD + hc[None, None, :]  # [4, 1, BKD]: the h rows of a group (row b: box b)
    acc_l = gl.sum(gl.reshape(gl.full([4, DR, BKD], 0.0, gl.float32, L3), [4, DR, 32, BKD // 32]), axis=3)
    hv0 = gl.full([4, 1, BKD], 0.0, gl.bfloat16, L3)
    hv1 = hv0
    hv2 = hv0
    it = 0
    pw = 0
    for j in range(R):
        item = cta + j * G
        if item < n_items:  # gate/up: h[p, f0:f0+BF], routing weight folded in
            p = item // NFB
            f0 = (item % NFB) * BF
            xrow = (p // K_TOP) * NKC
            accg = gl.full([BF, BK], 0.0, gl.float32, L)
            accu = gl.full([BF, BK], 0.0, gl.float32, L)
            for kc in range(NKC):
                s = it % SLOTS
                mbarrier.wait(ready.index(s), (it // SLOTS) & 1)
                g = halves.index(2 * s).load(L).to(gl.float32)
                u = halves.index(2 * s + 1).load(L).to(gl.float32)
                fence_async_shared()
                mbarrier.arrive(empty.index(s), count=1)
                xk = xs3.index(xrow + kc).load(L).to(gl.float32)
                accg += g * xk
                accu += u * xk
                it += 1
            gs = gl.sum(accg, axis=1)
            wp = gl.sum(gl.where(pr == p, wv, 0.0), axis=0)
            gl.store(h_ptr + p * F + f0 + rows,
                     (wp * gs / (1.0 + gl.exp(-gs)) * gl.sum(accu, axis=1)).to(gl.bfloat16))
            _cta_barrier()  # this warpgroup's h stores before the one-thread release
            gl.atomic_add(cnt_ptr + p, 1, sem="release", scope="gpu")
        if j == R - 1:
            _stamp(ts_ptr, 1, TS)
        ga = _q(j - 1, P, G, NFB, NC)  # the groups whose h round j − 1 loaded
        gb = _q(j, P, G, NFB, NC)
        if ga < gb:
            acc_l = _group(ring, ready, empty, it, hv0, acc_l, out_ptr, 4 * ga, d0, D, K_TOP, NC, BKD, DR, SLOTS, L3)
            it += 4
        if ga + 1 < gb:
            acc_l = _group(ring, ready, empty, it, hv1, acc_l, out_ptr, 4 * ga + 4, d0, D, K_TOP, NC, BKD, DR, SLOTS,
                           L3)
            it += 4
        if ga + 2 < gb:
            acc_l = _group(ring, ready, empty, it, hv2, acc_l, out_ptr, 4 * ga + 8, d0, D, K_TOP, NC, BKD, DR, SLOTS,
                           L3)
            it += 4
        gn = _q(j + 1, P, G, NFB, NC)  # the groups round j + 1 multiplies: their pairs' h, loaded now
        pw = _wait_pairs(cnt_ptr, pw, _pdone(j - 1, P, G, NFB), NFB)
        hv0 = gl.load(h_ptr + 4 * gb * BKD + hoff, mask=(hoff >= 0) & (gb < gn), other=0.0, cache_modifier=".cg")
        hv1 = gl.load(h_ptr + 4 * (gb + 1) * BKD + hoff, mask=(hoff >= 0) & (gb + 1 < gn), other=0.0,
                      cache_modifier=".cg")
        hv2 = gl.load(h_ptr + 4 * (gb + 2) * BKD + hoff, mask=(hoff >= 0) & (gb + 2 < gn), other=0.0,
                      cache_modifier=".cg")
    _stamp(ts_ptr, 4, TS)
    ga = _q(R - 1, P, G, NFB, NC)
    gb = _q(R, P, G, NFB, NC)
    if ga < gb:
        acc_l = _group(ring, ready, empty, it, hv0, acc_l, out_ptr, 4 * ga, d0, D, K_TOP, NC, BKD, DR, SLOTS, L3)
        it += 4
    if ga + 1 < gb:
        acc_l = _group(ring, ready, empty, it, hv1, acc_l, out_ptr, 4 * ga + 4, d0, D, K_TOP, NC, BKD, DR, SLOTS, L3)
        it += 4
    if ga + 2 < gb:
        acc_l = _group(ring, ready, empty, it, hv2, acc_l, out_ptr, 4 * ga + 8, d0, D, K_TOP, NC, BKD, DR, SLOTS, L3)
        it += 4
    pw = _wait_pairs(cnt_ptr, pw, P, NFB)  # the pairs of the last rounds
    _stamp(ts_ptr, 2, TS)
    ng = nbox // 4
    hv = gl.load(h_ptr + 4 * gb * BKD + hoff, mask=(hoff >= 0) & (gb < ng), other=0.0, cache_modifier=".cg")
    for g in range(gb, ng):
        hcur = hv
        hv = gl.load(h_ptr + 4 * (g + 1) * BKD + hoff, mask=(hoff >= 0) & (g + 1 < ng), other=0.0,
                     cache_modifier=".cg")  # the next group's h while this one multiplies
        acc_l = _group(ring, ready, empty, it, hcur, acc_l, out_ptr, 4 * g, d0, D, K_TOP, NC, BKD, DR, SLOTS, L3)
        it += 4
    _stamp(ts_ptr, 3, TS)
    if gl.atomic_add(cnt_ptr + PM, 1, sem="acq_rel", scope="gpu") == G - 1:  # the last program resets the counters
        for q in range(P):
            gl.atomic_xchg(cnt_ptr + q, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(cnt_ptr + PM, 0, sem="relaxed", scope="gpu")


@gluon.jit
def fifo_kernel(gu_desc, dn_desc, x_ptr, ids_ptr, wts_ptr, h_ptr, out_ptr, cnt_ptr, ts_ptr,
                D, F, P, n_items, nbox, G, R,
                K_TOP: gl.constexpr, XR: gl.constexpr, NFB: gl.constexpr, NKC: gl.constexpr, NC: gl.constexpr,
                BF: gl.constexpr, BK: gl.constexpr, BKD: gl.constexpr, DR: gl.constexpr, SLOTS: gl.constexpr,
                PM: gl.constexpr, num_warps: gl.constexpr, TS: gl.constexpr = False, IDREG: gl.constexpr = False):
    cta = gl.program_id(0)
    d0 = cta * DR
    gl.static_assert(BK == BKD)
    ring = gl.allocate_shared_memory(gu_desc.dtype, [SLOTS, 2 * BF, BK], gu_desc.layout)
    halves = ring._reinterpret(gu_desc.dtype, [2 * SLOTS, BF, BK], gu_desc.layout)  # even: gate, odd: up
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    xs = gl.allocate_shared_memory(gl.bfloat16, [XR, BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer_fifo, (x_ptr, wts_ptr, h_ptr, out_ptr, cnt_ptr, ts_ptr + cta * 8, ring, halves, ready, empty, xs,
                          D, F, P, n_items, nbox, G, cta, R, d0, TS, K_TOP, NFB, NKC, NC, BF, BK, BKD, DR, SLOTS,
                          PM, num_warps)),
        (_producer_fifo, (gu_desc, dn_desc, ids_ptr, ring, halves, ready, empty, D, F, P, n_items, nbox, G, cta, R,
                          d0, NFB, NKC, NC, BF, BK, BKD, SLOTS, IDREG)),
    ], [1], [24])


FIFO_PM = 32  # pairs at most (the routing weights' register vector; the counters' length)
FIFO_CFG = dict(SLOTS=24, TM=4)


def fifo_plan(P: int, G: int, NFB: int, NC: int) -> int:
    """Rounds of the FIFO schedule; raises if one round would hand more than GPR groups to the next."""
    R = -(-P * NFB // G)
    pdone = lambda r: max(0, min(P, G * (r + 1) // NFB))  # noqa: E731
    q = lambda j: pdone(j - 2) * NC // 4  # noqa: E731
    for j in range(R + 1):
        if q(j + 1) - q(j) > GPR:
            raise ValueError(f"FIFO schedule: round {j} hands {q(j + 1) - q(j)} groups to the next, at most {GPR}")
    return R


def _fifo_constexprs(k: int, D: int, F: int, c: dict) -> dict:
    return dict(K_TOP=k, XR=c["TM"] * D // c["BK"], NFB=F // c["BF"], NKC=D // c["BK"], NC=F // c["BKD"],
                BF=c["BF"], BK=c["BK"], BKD=c["BKD"], DR=c["DR"], SLOTS=c["SLOTS"], PM=FIFO_PM, num_warps=4,
                IDREG=c.get("IDREG", False))


def compile_sm90_fifo(K_TOP=8, D=2048, F=768, ts=False, **cfg):
    """Compile the FIFO kernel for sm_90 (no GPU needed): (shared bytes, ptx)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    c = {**CFG, **FIFO_CFG, **cfg}
    lay = _layout()
    sig = {"gu_desc": f"tensordesc<bf16[{c['BF']}, {c['BK']}],{lay!r}>",
           "dn_desc": f"tensordesc<bf16[{c['DR']}, {c['BKD']}],{lay!r}>",
           "x_ptr": "*bf16", "ids_ptr": "*i64", "wts_ptr": "*bf16", "h_ptr": "*bf16", "out_ptr": "*bf16",
           "cnt_ptr": "*i32", "ts_ptr": "*i64"}
    sig.update({n: "i32" for n in ("D", "F", "P", "n_items", "nbox", "G", "R")})
    cx = dict(_fifo_constexprs(K_TOP, D, F, c), TS=ts)
    names = list(fifo_kernel.arg_names)
    sig.update({n: "constexpr" for n in cx})
    sig = {n: sig[n] for n in names}
    src = GluonASTSource(fifo_kernel, sig, constexprs={(names.index(n),): v for n, v in cx.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    return k.metadata.shared, k.asm["ptx"]


_CNT: dict = {}


def small_t_fifo(x, ids, wt, w, ts=None, **cfg):
    """out [T, D] of the block in one FIFO launch (see above); T·k ≤ FIFO_PM, T ≤ TM."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    c = {**CFG, **FIFO_CFG, **{k_: v for k_, v in cfg.items() if k_ in ("SLOTS", "TM", "IDREG")}}
    T, k = ids.shape
    E, F2, D = w.gate_up.shape
    F = F2 // 2
    P = T * k
    if T > c["TM"] or P > FIFO_PM:
        raise ValueError(f"small_t_fifo: T = {T} > TM = {c['TM']} or T·k = {P} > {FIFO_PM}")
    G = D // c["DR"]
    NFB, NC = F // c["BF"], F // c["BKD"]
    R = fifo_plan(P, G, NFB, NC)
    lay = _layout()
    gu = TensorDescriptor(w.gate_up, [E * F2, D], [D, 1], [c["BF"], c["BK"]], lay)
    dn = TensorDescriptor(w.down, [E * D, F], [F, 1], [c["DR"], c["BKD"]], lay)
    cnt = _CNT.get(x.device)
    if cnt is None:
        cnt = _CNT[x.device] = torch.zeros(FIFO_PM + 1, dtype=torch.int32, device=x.device)
    h = torch.empty(P, F, dtype=torch.bfloat16, device=x.device)
    out = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    fifo_kernel[(G,)](gu, dn, x, ids, wt, h, out, cnt, cnt if ts is None else ts, D, F, P, P * NFB, P * NC, G, R,
                      TS=ts is not None, **_fifo_constexprs(k, D, F, c))
    return out


def parse_config(text: str) -> dict:
    """SLOTSxNB[L][W8][R][M][H][B][D][S][tN] → dict(SLOTS, NB, LATE, W, IDREG, MMA, LOWP, BAR, DYN, SW, TM,
    FIFO=False): L the down loop's
    sums across lanes and warps once per token, W8 eight consumer warps instead of four (each box of a down group
    shared by two), R the producer's expert ids from registers (`_id`), M the down loop on the tensor cores
    (`_down_mma`), H its products and in-thread sums in bf16 (packed bf16x2 instructions; sums as L does), B the
    epoch grid barrier (one atomic per program) and only reused down buffers released, D gate/up items from a work
    counter (the producer takes the next while it issues the current; needs B), S the tensor-core down loop on
    128-byte-swizzled [DR, 64] chunks (`_down_mma_sw`), tN at
    most N tokens (the shared-memory copies of x and h; default CFG's TM); SLOTSF[R] → the FIFO kernel with a ring
    of SLOTS slots (its down loop sums as L does)."""
    import re

    m = re.fullmatch(r"(\d+)F(R?)", text)
    if m:
        return dict(SLOTS=int(m[1]), IDREG=bool(m[2]), FIFO=True)
    m = re.fullmatch(r"(\d+)x(\d+)(L?)(?:W(\d+))?(R?)(M?)(H?)(B?)(D?)(S?)(?:t(\d+))?", text)
    if not m:
        raise ValueError(f"configuration {text!r}: SLOTSxNB[L][W8][R][M][H][B][D][S][tN] or SLOTSF[R]")
    return dict(SLOTS=int(m[1]), NB=int(m[2]), LATE=bool(m[3]), W=int(m[4] or 4), IDREG=bool(m[5]), MMA=bool(m[6]),
                LOWP=bool(m[7]), BAR=bool(m[8]), DYN=bool(m[9]), SW=bool(m[10]), TM=int(m[11] or CFG["TM"]),
                FIFO=False)


def config_name(c: dict) -> str:
    r = "R" if c["IDREG"] else ""
    if c["FIFO"]:
        return f"one-launch-{c['SLOTS']}F{r}"
    tm = "" if c["TM"] == CFG["TM"] else f"t{c['TM']}"
    return (f"one-launch-{c['SLOTS']}x{c['NB']}{'L' if c['LATE'] else ''}{'W8' if c['W'] == 8 else ''}{r}"
            f"{'M' if c['MMA'] else ''}{'H' if c['LOWP'] else ''}{'B' if c['BAR'] else ''}"
            f"{'D' if c['DYN'] else ''}{'S' if c['SW'] else ''}{tm}")


def config_fn(c: dict):
    if c["FIFO"]:
        return partial(small_t_fifo, SLOTS=c["SLOTS"], IDREG=c["IDREG"])
    return partial(small_t, **{k: v for k, v in c.items() if k != "FIFO"})


STAMPS = ("start", "gate_up_done", "barrier_passed", "end", "h_in_smem", "dbuf_boxes_done", "ring_boxes_done",
          "group0_waited")
STAMPS_FIFO = ("start", "gate_up_done", "last_flags_passed", "end", "rounds_done")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 only (CPU), then exit")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--configs", default="24FR,8x12LR",
                    help="SLOTSxNB[L][W8][R] or SLOTSF[R]: gate/up slots x down buffers (multiples of 4); L: the "
                         "down loop's sums across lanes and warps once per token (H200 session 11: 28.8 against "
                         "31.1 µs at T=1); W8: eight consumer warps; R: the producer's ids from registers; SLOTSF: "
                         "the FIFO kernel (T ≤ 4); every configuration's phases are stamped")
    args = ap.parse_args()
    if args.compile:
        compile_sm90(ts=True)
        compile_sm90_fifo(ts=True)
        print(json.dumps(dict(fifo_shared=compile_sm90_fifo()[0])))
        shared, ptx = compile_sm90()
        print(json.dumps(dict(shared=shared, tma=ptx.count("cp.async.bulk.tensor"), bar=ptx.count("bar.sync"),
                              atom=ptx.count("atom."))))
        return
    import statistics

    import kernels as B
    import torch

    from moetune.codegen.triton import BACKEND
    from moetune.ir import MoEBlock
    from moetune.search.objective import reference
    from moetune.search.timing import Case

    dev = "cuda"
    shape = "qwen3-30b-a3b"
    E, k, D, F = B.SHAPES[shape]
    block = MoEBlock(E=E, k=k, D=D, F=F, name=shape)
    w = B.expert_weights(E, D, F, dev)
    flush = torch.randn(128 * 1024 * 1024, dtype=torch.bfloat16, device=dev)
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        sets = B.routings(T, E, k, D, dev, seed=1000 + T)  # the bench's routings of this cell
        distinct = statistics.mean(len(torch.unique(s[1])) for s in sets)
        fl = B.floor_us(E, k, D, F, T, distinct)
        x0, ids0, wt0 = sets[0]
        ref = reference(block, Case(x0, ids0, wt0, w))
        refs = [reference(block, Case(x, ids, wt, w)) for x, ids, wt in sets[:8]]  # 8 fresh routings
        table = str(Path(__file__).resolve().parents[1] / "cache" / "h200.sqlite")
        confs = [parse_config(c) for c in args.configs.split(",")]
        # the table first: a hang of a prototype's grid-wide waits (cut by the caller's timeout) keeps its figure
        cands = [(tag, BACKEND.build(block, s), None) for tag, s in B.table_variant(table, shape, T)]
        cands += [(config_name(c), config_fn(c), c) for c in confs if T <= (FIFO_CFG if c["FIFO"] else c)["TM"]]
        for tag, fn, c in cands:
            if c is not None:  # phase stamps of this configuration, then its checks and timing
                ts = torch.zeros(D // CFG["DR"], 8, dtype=torch.int64, device=dev)
                for _ in range(3):
                    flush.sum()  # L2 flushed first, as in the timed replays
                    fn(x0, ids0, wt0, w, ts=ts)
                torch.cuda.synchronize()
                rel = (ts - ts[:, 0].min()).double() / 1e3  # µs from the first program's start
                stamps = {name: [round(float(v), 2) for v in (rel[:, i].min(), rel[:, i].median(), rel[:, i].max())]
                          for i, name in enumerate(STAMPS_FIFO if c["FIFO"] else STAMPS)}
                rows.append(dict(shape=shape, tokens=T, variant="stamps " + tag, stamps_us_min_med_max=stamps))
                print(json.dumps(rows[-1]), flush=True)
            rec = dict(shape=shape, tokens=T, variant=tag, floor_us=round(fl, 2))
            try:
                if c is not None:  # eager, before any timing
                    rec["eager_rel_err_max"] = max(B.rel_err(fn(x, ids, wt, w), r)
                                                   for (x, ids, wt), r in zip(sets[:8], refs, strict=True))
                t_us, gerr, mean_us = B.graph_checked_time(fn, sets, w, flush, ref)
                rec.update(graph_rel_err=gerr, time_us=t_us, routing_mean_us=mean_us)
            except Exception as ex:  # noqa: BLE001  (a prototype: report and go on)
                rec["error"] = repr(ex)[:300]
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "proto_small_t.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'T':>4} {'variant':18} {'µs':>8} {'floor':>7} {'%':>5} {'graph err':>9} {'eager err':>9}")
    for r in rows:
        if "stamps_us_min_med_max" in r:
            print(f"{r['tokens']:4} {r['variant']}: {r['stamps_us_min_med_max']}")
            continue
        t = r.get("time_us")
        print(f"{r['tokens']:4} {r['variant']:18} {t if t is None else round(t, 1)!s:>8} {r['floor_us']:7.1f} "
              f"{'' if not t else round(100 * r['floor_us'] / t)!s:>5} {r.get('graph_rel_err', float('nan')):9.1e} "
              f"{r.get('eager_rel_err_max', float('nan')):9.1e} {r.get('error', '')[:60]}")


if __name__ == "__main__":
    main()
