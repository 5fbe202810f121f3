"""Prototype, not in the package: ONE persistent launch for both projections of a small-T GEMV.

Why: at T = 1 the two-kernel stream GEMV spends 28 µs on qwen3-30b-a3b's 75 MB (floor 15.7 µs) and each
short kernel pays its own ramp and tail (bench/results/NOTES.md).  PDL and L2-prefetch hints that tried to
overlap them were slower.  Here G co-resident programs (G ≤ what the SMs hold at once) run

    phase 1   gate/up items (selected expert, F-block) p, p + G, …   → h [P, F]
    preload   the weights of the program's first down item [k experts, BN2 rows of D, F] into registers:
              real loads, issued as soon as the program's phase-1 work is done, so HBM keeps streaming
              through the phase-1 tail instead of idling
    barrier   grid-wide: one int64 counter, thread 0 arrives with acq_rel and spins with acquire
              (target = next multiple of G, so the counter never needs a reset between calls)
    phase 2   h of the token's k pairs (L1 bypassed) · the preloaded weights, weighted, summed over k
              → out [T, D]; items past G run as plain token-mode down items.

Interpreted (TRITON_INTERPRET=1) the programs run one after another, so the barrier cannot work there:
the launcher runs phase 1 and phase 2 as two launches of the same kernel (PHASE 1, 2), which checks
the arithmetic and the item split, not the hand-off.  Only standard layouts, SwiGLU, no bias, weights on
the output, P = T·k ≤ 64 (ids grouped in-kernel), F ≤ FP.

    timeout 240 python3 bench/proto_persistent.py --out $OUT   # on the H200: check, then time against
                                                               # stream_gemv (timeout: a barrier that
                                                               # cannot complete would hang)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetune.codegen.common import ExpertTensors  # noqa: E402
from moetune.codegen.triton._common import (  # noqa: E402
    _fused_pairs,
    _fused_slot,
    _row_gate_up,
    _store_h,
    _token_down,
    interpreting,
    next_pow2,
)
from moetune.ir import MoEBlock, UnsupportedSchedule  # noqa: E402


@dataclass(frozen=True)
class PersistentParams:
    block_n: int = 8  # gate/up rows of F per phase-1 item
    block_k: int = 256  # phase-1 K chunk (along D)
    down_block_n: int = 4  # rows of D per phase-2 item
    num_warps: int = 8
    num_stages: int = 4
    per_sm: int = 2  # programs per SM (G = SMs · per_sm, checked against the occupancy)


@triton.jit(do_not_specialize=["P", "G", "n_items1", "n_items2"])
def persistent_gemv_kernel(
    x_ptr, s_xt, ids_ptr, wts_ptr,
    wg_ptr, g_se, g_sn, g_sk, g_up,
    wd_ptr, d_se, d_sn, d_sk,
    h_ptr, s_hp, out_ptr, s_ot, bar_ptr,
    P, E, F, D, n_items1, n_items2, G,
    PHASE: tl.constexpr, K_TOP: tl.constexpr, KP: tl.constexpr, BP: tl.constexpr,
    BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr, FP: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    if PHASE != 2:
        nb1 = tl.cdiv(F, BN1)
        for it in range(pid, n_items1, G):
            slot = it // nb1
            n0 = (it % nb1) * BN1
            e, m, match, mrank = _fused_slot(ids_ptr, P, E, slot, BP)
            w_e = wg_ptr + tl.where(m > 0, e, 0).to(tl.int64) * g_se
            for c in range(0, m):
                pairs = _fused_pairs(match, mrank, c, 1, BP)  # [1]
                pair = tl.sum(pairs, axis=0)
                g1, u1 = _row_gate_up(x_ptr, s_xt, pair // K_TOP, w_e, g_sn, g_sk, g_up, n0, F, D,
                                      BN1, BK1, STAGES)
                _store_h(h_ptr, s_hp, pairs, pairs >= 0, g1[None, :], u1[None, :], pairs.to(tl.float32),
                         w_e, 0, 0, n0, F, 0.0, 0.0, BN1, 0, False, False)
    if PHASE != 1:
        nb2 = tl.cdiv(D, BN2)
        t = pid // nb2
        n0 = (pid % nb2) * BN2
        ok_item = pid < n_items2
        jk = tl.arange(0, KP)
        p = t * K_TOP + jk  # [KP]
        ev = tl.load(ids_ptr + p, mask=ok_item & (jk < K_TOP), other=-1).to(tl.int32)
        ok = ok_item & (jk < K_TOP) & (ev >= 0) & (ev < E)
        ec = tl.where(ok, ev, 0).to(tl.int64)
        offs_n = n0 + tl.arange(0, BN2)
        offs_f = tl.arange(0, FP)
        m3 = ok[:, None, None] & (offs_n < D)[None, :, None] & (offs_f < F)[None, None, :]
        wv = tl.load(wd_ptr + ec[:, None, None] * d_se + offs_n[None, :, None] * d_sn
                     + offs_f[None, None, :] * d_sk, mask=m3, other=0.0)  # [KP, BN2, FP] preloaded
        if PHASE == 0:  # grid barrier: every h row is written before any is read
            tl.debug_barrier()
            old = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
            target = (old // G + 1) * G
            cur = old + 1
            while cur < target:
                cur = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
        hv = tl.load(h_ptr + p.to(tl.int64)[:, None] * s_hp + offs_f[None, :],
                     mask=ok[:, None] & (offs_f < F)[None, :], other=0.0, cache_modifier=".cg")  # [KP, FP]
        wt = tl.load(wts_ptr + p, mask=ok, other=0.0).to(tl.float32)
        y = tl.sum(wv.to(tl.float32) * hv.to(tl.float32)[:, None, :], axis=2)  # [KP, BN2]
        res = tl.sum(y * wt[:, None], axis=0)
        tl.store(out_ptr + t.to(tl.int64) * s_ot + offs_n, res.to(out_ptr.dtype.element_ty),
                 mask=ok_item & (offs_n < D))
        for it in range(pid + G, n_items2, G):  # items past the first: plain token-mode down
            t2 = it // nb2
            n2 = (it % nb2) * BN2
            r2 = _token_down(h_ptr, s_hp, ids_ptr, wts_ptr, t2, E, wd_ptr, d_se, d_sn, d_sk, wd_ptr, 0, 0,
                             n2, D, F, K_TOP, KP, BN2, 128, False, False, STAGES)
            o2 = n2 + tl.arange(0, BN2)
            tl.store(out_ptr + t2.to(tl.int64) * s_ot + o2, r2.to(out_ptr.dtype.element_ty), mask=o2 < D)


def occupancy(kernel, num_warps: int) -> int:
    """Programs of a compiled kernel that one sm_90 SM holds at once (registers, shared memory, warps)."""
    regs = max(kernel.n_regs, 1)
    per_warp = math.ceil(regs * 32 / 256) * 256  # register allocation granularity: 256 per warp
    by_regs = 65536 // (per_warp * num_warps)
    by_smem = (228 * 1024) // (kernel.metadata.shared + 1024)
    return max(0, min(by_regs, by_smem, 64 // num_warps, 32))


class PersistentGemv:
    """The experts function of the prototype: fn(x, ids, weights, w) → out [T, D]."""

    def __init__(self, block: MoEBlock, p: PersistentParams = PersistentParams()):
        if block.layout.transposed or block.layout.interleaved or block.layout.has_bias:
            raise UnsupportedSchedule("persistent prototype: standard layout without bias only")
        if block.activation.kind != "swiglu" or block.weight_application != "output":
            raise UnsupportedSchedule("persistent prototype: SwiGLU with weights on the output only")
        self.block, self.p = block, p
        self.fp = next_pow2(block.F)
        regs = next_pow2(block.k) * p.down_block_n * self.fp // (32 * p.num_warps) // 2
        if regs > 96:
            raise UnsupportedSchedule(f"persistent prototype: the preloaded down item needs {regs} registers "
                                      "per thread (limit 96); lower down_block_n or raise num_warps")
        self.bar: dict[torch.device, torch.Tensor] = {}
        self.grid: dict[torch.device, int] = {}

    def info(self) -> dict:
        return {"grid": next(iter(self.grid.values()), None)}

    def __call__(self, x, ids, weights, w: ExpertTensors) -> torch.Tensor:
        b, p = self.block, self.p
        E, k, D, F = b.E, b.k, b.D, b.F
        T = x.shape[0]
        P = T * k
        if P > 64:
            raise UnsupportedSchedule(f"persistent prototype: P = {P} pairs > 64")
        ids_f, wts_f = ids.reshape(-1), weights.reshape(-1)
        h = torch.empty(P, F, dtype=x.dtype, device=x.device)  # [P, F]
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        n1 = min(P, E) * triton.cdiv(F, p.block_n)
        n2 = T * triton.cdiv(D, p.down_block_n)
        gu, dn = w.gate_up, w.down
        args = (x, x.stride(0), ids_f, wts_f, gu, gu.stride(0), gu.stride(1), gu.stride(2), F * gu.stride(1),
                dn, dn.stride(0), dn.stride(1), dn.stride(2), h, h.stride(0), out, out.stride(0))
        meta = dict(K_TOP=k, KP=next_pow2(k), BP=max(16, next_pow2(P)), BN1=p.block_n, BK1=p.block_k,
                    BN2=p.down_block_n, FP=self.fp, STAGES=p.num_stages, num_warps=p.num_warps,
                    num_stages=p.num_stages)
        if interpreting():  # sequential programs: the two phases as two launches of G = 3 programs each,
            bar = torch.zeros(1, dtype=torch.int64, device=x.device)  # so every item loop runs
            for phase in (1, 2):
                persistent_gemv_kernel[(3,)](*args, bar, P, E, F, D, n1, n2, 3, PHASE=phase, **meta)
            return out
        dev = x.device
        if dev not in self.bar:  # first call: the counter, and G from the compiled kernel's occupancy
            self.bar[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
            ck = persistent_gemv_kernel.warmup(*args, self.bar[dev], P, E, F, D, n1, n2, 1, PHASE=0,
                                               grid=(1,), **meta)
            ck._init_handles()
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            fit = occupancy(ck, p.num_warps)
            if fit < 1:
                raise UnsupportedSchedule("persistent prototype: one program does not fit an SM")
            self.grid[dev] = sms * min(p.per_sm, fit)
        G = self.grid[dev]
        persistent_gemv_kernel[(G,)](*args, self.bar[dev], P, E, F, D, n1, n2, G, PHASE=0, **meta)
        return out


# ------------------------------------------------------------------------------------------ H200 run


def read_only_us(nbytes: int, flush, reps: int = 100) -> float:
    """Graph-mode median of ONE launch that only reads `nbytes` (cold L2): what a single kernel that
    streams the cell's weight bytes costs, ramp and tail included; the bound for a one-launch design."""
    from kernels import read_kernel  # bench/kernels.py

    dev = flush.device
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
    grid = torch.cuda.get_device_properties(dev).multi_processor_count * 8
    dst = torch.empty(grid, dtype=torch.float32, device=dev)

    def run():
        read_kernel[(grid,)](src, dst, src.numel(), BLOCK=2048, num_warps=8)

    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    times = []
    for _ in range(reps):
        flush.sum()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)



def main() -> None:
    """Check every variant (eager and graph replay) against the float32 reference, then time it beside
    the shipped stream_gemv default and a read-only kernel of the same bytes; a table last."""
    import kernels as B  # bench/kernels.py

    from moetune.codegen.triton import BACKEND

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--cells", default="qwen3-30b-a3b:1,qwen3-30b-a3b:2,qwen3-30b-a3b:4,"
                                       "qwen3.5-397b-a17b:1,deepseek-v3:1")
    args = ap.parse_args()
    # sm_90 compile on the CPU machine (ptxas -v): 185-194 registers at 4 or 8 warps, no spills; so 8 warps
    # hold one program per SM, 4 warps two
    variants = {f"p{bn}-{dbn}-w{nw}-s{ps}": PersistentParams(block_n=bn, down_block_n=dbn, num_warps=nw,
                                                               per_sm=ps)
                for bn, dbn, nw, ps in ((16, 4, 8, 1), (16, 2, 8, 1), (32, 2, 8, 1), (8, 2, 4, 2), (16, 2, 4, 2))}

    def candidates(block, T):
        out = [("stream_gemv default", BACKEND.build(block, BACKEND.default(block, "stream_gemv", T)))]
        for tag, vp in variants.items():
            try:
                out.append((tag, PersistentGemv(block, vp)))
            except UnsupportedSchedule as e:
                print(f"{block.name} T={T} {tag}: {e}", flush=True)
        return out

    def read_only(block, T, distinct, flush):
        return [("read-only, same bytes", read_only_us(int(distinct * 3 * block.D * block.F * 2), flush))]

    B.probe_cells(args.cells, candidates, Path(args.out) / "proto-persistent.json",
                  "one-launch GEMV prototype", read_only)


if __name__ == "__main__":
    main()
