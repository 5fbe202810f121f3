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

Measured (H200, session 12 calls 6-8, the table in the same call; bench/results/NOTES.md "Session 12"): the best
configuration, 8x12LRHBD, takes 26.2-26.7 µs at qwen3-30b-a3b T = 1 against the table's 26.7-27.0 (parity), and
41.9-42.4 µs at T = 2 against 45.2-45.8 (7-8 % faster). Tried there and retired (in the history): a per-pair
pipelined down phase during gate/up, as a second ring (b8fa0b5) or one ring in the consumer's order (375e160):
4.1 µs per round, 34.9-37.4 µs at T = 1; the down loop on the tensor cores, unswizzled (56fcb9d: 3.4 µs per
eight boxes, the 512-byte rows eight-way bank-conflicted in ldmatrix) and on 128-byte-swizzled chunks
(b350b11, 5fcbe4c: 0.74-0.86 µs per eight boxes, no faster end to end).

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
def _producer(gu_desc, dn_desc, ids_ptr, work_ptr, ring, halves, ready, empty, dbuf, dready, dempty, itq, itq_full,
              itq_empty, D, F, P, item_lo, item_hi, d0, nbox, n_pre, n_items,
              NFB: gl.constexpr, NKC: gl.constexpr, NC: gl.constexpr, BF: gl.constexpr, BK: gl.constexpr,
              BKD: gl.constexpr, SLOTS: gl.constexpr, NB: gl.constexpr, IDREG: gl.constexpr, DYN: gl.constexpr):
    idr, idv = _ids_vec(ids_ptr, P, IDREG)
    for b in range(n_pre):  # down rows first: they stream while gate/up runs
        e = _id(ids_ptr, idr, idv, b // NC, IDREG)
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
        mbarrier.expect(dready.index(s), dn_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(dn_desc, [e * D + d0, (b % NC) * BKD], dready.index(s), dbuf.index(s))


@gluon.jit
def _add(a, b):
    return a + b


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
def _consumer(x_ptr, wts_ptr, h_ptr, out_ptr, sync_ptr, ts_ptr, ring, halves, ready, empty, dbuf, dready,
              dempty, xs, hs, itq, itq_full, itq_empty, D, F, P, item_lo, item_hi, d0, nbox, G, TS: gl.constexpr,
              LATE: gl.constexpr,
              K_TOP: gl.constexpr, NFB: gl.constexpr, NKC: gl.constexpr, NC: gl.constexpr, BF: gl.constexpr,
              BK: gl.constexpr, BKD: gl.constexpr, DR: gl.constexpr, SLOTS: gl.constexpr, NB: gl.constexpr,
              num_warps: gl.constexpr, LOWP: gl.constexpr, BAR: gl.constexpr,
              DYN: gl.constexpr):
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
    hr = gl.arange(0, hs.type.shape[0], layout=gl.SliceLayout(1, L))
    dcols = gl.arange(0, BKD, layout=V)
    hs.store(gl.load(h_ptr + hr[:, None] * BKD + dcols[None, :], mask=(hr < P * NC)[:, None], other=0.0,
                     cache_modifier=".cg"))
    _cta_barrier()
    _stamp(ts_ptr, 4, TS)
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
                   IDREG: gl.constexpr = False, LOWP: gl.constexpr = False,
                   BAR: gl.constexpr = False, DYN: gl.constexpr = False):
    cta = gl.program_id(0)
    gl.static_assert(BAR or not DYN)  # the barrier's last arrival resets the work counter
    item_lo = cta * n_items // G
    item_hi = (cta + 1) * n_items // G
    d0 = cta * DR
    gl.static_assert(2 * BF == DR and BK == BKD)  # a ring slot (gate rows, then up rows) holds one down box
    ring = gl.allocate_shared_memory(gu_desc.dtype, [SLOTS, 2 * BF, BK], gu_desc.layout)
    halves = ring._reinterpret(gu_desc.dtype, [2 * SLOTS, BF, BK], gu_desc.layout)  # even: gate, odd: up
    dbuf = gl.allocate_shared_memory(dn_desc.dtype, [NB, DR, BKD], dn_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    dready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    dempty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    xs = gl.allocate_shared_memory(gl.bfloat16, [XR, BK], flat)  # x rows of every token, BK at a time
    hs = gl.allocate_shared_memory(gl.bfloat16, [HR, BKD], flat)  # h of every pair after the grid barrier
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
        (_consumer, (x_ptr, wts_ptr, h_ptr, out_ptr, sync_ptr, ts_ptr + cta * 8, ring, halves, ready, empty, dbuf,
                     dready, dempty, xs, hs, itq, itq_full, itq_empty, D, F, P, item_lo, item_hi, d0, nbox, G, TS,
                     LATE, K_TOP, NFB, NKC, NC, BF, BK, BKD, DR, SLOTS, NB, num_warps, LOWP, BAR, DYN)),
        (_producer, (gu_desc, dn_desc, ids_ptr, sync_ptr + 3, ring, halves, ready, empty, dbuf, dready, dempty, itq,
                     itq_full, itq_empty, D, F, P, item_lo, item_hi, d0, nbox, n_pre, n_items, NFB, NKC, NC, BF, BK,
                     BKD, SLOTS, NB, IDREG, DYN)),
    ], [1], [24])


def _layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)  # rows read whole, no swizzle


def _constexprs(k: int, D: int, F: int, c: dict) -> dict:
    return dict(K_TOP=k, XR=c["TM"] * D // c["BK"], HR=triton.next_power_of_2(c["TM"] * k * F // c["BKD"]),
                NFB=F // c["BF"],
                NKC=D // c["BK"], NC=F // c["BKD"], BF=c["BF"], BK=c["BK"], BKD=c["BKD"], DR=c["DR"],
                SLOTS=c["SLOTS"], NB=c["NB"], LATE=c.get("LATE", False), num_warps=c.get("W", 4),
                IDREG=c.get("IDREG", False), LOWP=c.get("LOWP", False),
                BAR=c.get("BAR", False), DYN=c.get("DYN", False))


def compile_sm90(K_TOP=8, D=2048, F=768, ts=False, **cfg):
    """Compile for sm_90 (no GPU needed): (shared bytes, ptx); ts: with the phase time stamps."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    c = dict(CFG, **cfg)
    lay = _layout()
    sig = {"gu_desc": f"tensordesc<bf16[{c['BF']}, {c['BK']}],{lay!r}>",
           "dn_desc": f"tensordesc<bf16[{c['DR']}, {c['BKD']}],{lay!r}>",
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
    dn = TensorDescriptor(w.down, [E * D, F], [F, 1], [c["DR"], c["BKD"]], lay)
    sync = _SYNC.get(x.device)
    if sync is None:
        sync = _SYNC[x.device] = torch.zeros(4, dtype=torch.int32, device=x.device)
    if c.get("BAR") and G & (G - 1):
        raise ValueError(f"small_t: the epoch barrier needs a power-of-2 grid, G = {G}")
    if T > c["TM"] or T * k > 32:
        raise ValueError(f"small_t: T = {T} > TM = {c['TM']} (the shared-memory copies of x and h)")
    if c.get("DYN") and not c.get("BAR"):
        raise ValueError("small_t: dynamic items (D) need the epoch barrier (B), whose last arrival resets them")
    h = torch.empty(P, F, dtype=torch.bfloat16, device=x.device)
    out = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    small_t_kernel[(G,)](gu, dn, x, ids, wt, h, out, sync, sync if ts is None else ts, D, F, P, n_items, nbox,
                         min(nbox, c["NB"]), G, TS=ts is not None, **_constexprs(k, D, F, c))
    return out


def parse_config(text: str) -> dict:
    """SLOTSxNB[L][W8][R][H][B][D][tN] → dict(SLOTS, NB, LATE, W, IDREG, LOWP, BAR, DYN, TM): L the down loop's sums
    across lanes and warps once per token, W8 eight consumer warps instead of four (each box of a down group shared
    by two), R the producer's expert ids from registers (`_id`), H the down loop's products and in-thread sums in
    bf16 (packed bf16x2 instructions; sums as L does), B the epoch grid barrier (one atomic per program) and only
    reused down buffers released, D gate/up items from a work counter (the producer takes the next while it issues
    the current; needs B), tN at most N tokens (the shared-memory copies of x and h; default CFG's TM)."""
    import re

    m = re.fullmatch(r"(\d+)x(\d+)(L?)(?:W(\d+))?(R?)(H?)(B?)(D?)(?:t(\d+))?", text)
    if not m:
        raise ValueError(f"configuration {text!r}: SLOTSxNB[L][W8][R][H][B][D][tN]")
    return dict(SLOTS=int(m[1]), NB=int(m[2]), LATE=bool(m[3]), W=int(m[4] or 4), IDREG=bool(m[5]), LOWP=bool(m[6]),
                BAR=bool(m[7]), DYN=bool(m[8]), TM=int(m[9] or CFG["TM"]))


def config_name(c: dict) -> str:
    tm = "" if c["TM"] == CFG["TM"] else f"t{c['TM']}"
    flags = "".join(f for f, on in (("L", c["LATE"]), ("W8", c["W"] == 8), ("R", c["IDREG"]), ("H", c["LOWP"]),
                                    ("B", c["BAR"]), ("D", c["DYN"])) if on)
    return f"one-launch-{c['SLOTS']}x{c['NB']}{flags}{tm}"


STAMPS = ("start", "gate_up_done", "barrier_passed", "end", "h_in_smem", "dbuf_boxes_done", "ring_boxes_done")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 only (CPU), then exit")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--configs", default="8x12LRHBD,8x12LR",
                    help="SLOTSxNB[L][W8][R][H][B][D][tN] (parse_config): gate/up slots x down buffers (multiples "
                         "of 4) and the variant letters; every configuration's phases are stamped")
    args = ap.parse_args()
    if args.compile:
        compile_sm90(ts=True)
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
        cands += [(config_name(c), partial(small_t, **c), c) for c in confs if T <= c["TM"]]
        for tag, fn, c in cands:
            if c is not None:  # phase stamps of this configuration, then its checks and timing
                ts = torch.zeros(D // CFG["DR"], 8, dtype=torch.int64, device=dev)
                for _ in range(3):
                    flush.sum()  # L2 flushed first, as in the timed replays
                    fn(x0, ids0, wt0, w, ts=ts)
                torch.cuda.synchronize()
                rel = (ts - ts[:, 0].min()).double() / 1e3  # µs from the first program's start
                stamps = {name: [round(float(v), 2) for v in (rel[:, i].min(), rel[:, i].median(), rel[:, i].max())]
                          for i, name in enumerate(STAMPS)}
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
