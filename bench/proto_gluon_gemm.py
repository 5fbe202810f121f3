"""Prototype (not in the package): a warp-specialised Hopper gate/up GEMM in Gluon, checked against torch and
timed beside the package's TMA one-dot gate/up kernel on the same sorted rows (one H200 call).

Why: at mixtral-8x7b T = 1024 the package's gate/up runs at ~530 TFLOP/s (ncu, session 9) against the
~790 TFLOP/s bf16 matmul ceiling; Triton's software pipeline issues the TMA loads from the same warps that
run the wgmma. Here one producer warp only issues TMA loads into a ring of STAGES shared-memory slots
(mbarrier `ready` per slot, completed by the TMA's byte count); the consumer warpgroups only wait, run one
wgmma of N = 2·BN per K step on the [2, BN, BK] gate/up box (the package's one-dot layout) and hand the slot
back (`empty`) once the wgmma that read it has retired (wait(1) keeps one in flight). The epilogue (SwiGLU,
h rows in sorted order, rows past the tile's expert masked) is the package's.

The tile list (expert, first sorted row, rows) is built by torch from the routing counts, outside the timed
region: this times the GEMM kernels alone, the package's kernel finding its tiles itself.

    python3 bench/proto_gluon_gemm.py --out DIR      # H200: check, then time; the table last
    python bench/proto_gluon_gemm.py --compile       # CPU: compile the Gluon kernel for sm_90 only
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from functools import partial
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@gluon.jit
def _producer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, row0, e2, n0, K, BK: gl.constexpr,
              STAGES: gl.constexpr):
    for i in range(gl.cdiv(K, BK)):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [row0, i * BK], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(w_desc, [e2, n0, i * BK], ready.index(s), b_bufs.index(s))


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, num_warps: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, 2 * BN, 16])
    acc = gl.full([BM, 2 * BN], 0.0, gl.float32, mma)
    for i in range(gl.cdiv(K, BK)):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        b = b_bufs.index(s).reshape([2 * BN, BK]).permute((1, 0))  # [BK, 2BN]: gate columns, then up
        acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)  # step i-1 retired
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return (acc,)


@gluon.jit
def _setup(x_desc, w_desc, tiles_ptr, n_tiles, CONSUMERS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
           BK: gl.constexpr, STAGES: gl.constexpr):
    """This program's tile (expert, first sorted row, rows) and F block, its ring of STAGES shared-memory
    slots and their barriers (`empty` completes when all CONSUMERS partitions have handed a slot back)."""
    pid = gl.program_id(0)
    tile = pid % n_tiles  # the tiles of one F block run together: an expert's tiles share its weights in L2
    n0 = (pid // n_tiles) * BN
    e = gl.load(tiles_ptr + 3 * tile)
    row0 = gl.load(tiles_ptr + 3 * tile + 1)
    rows = gl.load(tiles_ptr + 3 * tile + 2)
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 2, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return e, row0, rows, n0, a_bufs, b_bufs, ready, empty


@gluon.jit
def gate_up_ws_kernel(x_desc, w_desc, tiles_ptr, h_ptr, F, K, n_tiles,
                      BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    e, row0, rows, n0, a_bufs, b_bufs, ready, empty = _setup(x_desc, w_desc, tiles_ptr, n_tiles, 1, BM, BN, BK,
                                                             STAGES)
    res = gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, K, BM, BN, BK, STAGES, num_warps)),
        (_producer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, row0, 2 * e, n0, K, BK, STAGES)),
    ], [1], [24])
    acc = res[0]
    g, u = gl.split(gl.permute(gl.reshape(acc, [BM, 2, BN]), (0, 2, 1)))
    h = g / (1.0 + gl.exp(-g)) * u
    out: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    h = gl.convert_layout(h.to(gl.bfloat16), out)
    r = gl.arange(0, BM, layout=gl.SliceLayout(1, out))
    c = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, out))
    ptr = h_ptr + (row0 + r)[:, None] * F + c[None, :]
    gl.store(ptr, h, mask=(r < rows)[:, None] & (c < F)[None, :])


@gluon.jit
def _half(a_bufs, b_bufs, ready, empty, h_ptr, F, K, row0, rows, n0, HALF: gl.constexpr, BM: gl.constexpr,
          BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One consumer warpgroup of gate_up_ws2_kernel: rows [HALF·BM/2, (HALF + 1)·BM/2) of the tile, one wgmma
    of [BM/2, 2·BN] per K step, then its own SwiGLU epilogue. A half whose rows all lie past the tile's
    expert issues no wgmma: it only hands each slot back, so a short last tile of an expert costs the
    tensor cores half a tile."""
    HM: gl.constexpr = BM // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 2 * BN, 16])
    acc = gl.full([HM, 2 * BN], 0.0, gl.float32, mma)
    n_k = gl.cdiv(K, BK)
    if HALF * HM < rows:
        for i in range(n_k):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            b = b_bufs.index(s).reshape([2 * BN, BK]).permute((1, 0))
            acc = warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        g, u = gl.split(gl.permute(gl.reshape(acc, [HM, 2, BN]), (0, 2, 1)))
        h = g / (1.0 + gl.exp(-g)) * u
        out: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        h = gl.convert_layout(h.to(gl.bfloat16), out)
        r = HALF * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, out))
        c = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, out))
        gl.store(h_ptr + (row0 + r)[:, None] * F + c[None, :], h, mask=(r < rows)[:, None] & (c < F)[None, :])
    else:
        for i in range(n_k):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)


@gluon.jit
def _half0(a_bufs, b_bufs, ready, empty, h_ptr, F, K, row0, rows, n0, BM: gl.constexpr, BN: gl.constexpr,
           BK: gl.constexpr, STAGES: gl.constexpr):
    _half(a_bufs, b_bufs, ready, empty, h_ptr, F, K, row0, rows, n0, 0, BM, BN, BK, STAGES)


@gluon.jit
def _worker(x_desc, w_desc, a_bufs, b_bufs, ready, empty, h_ptr, F, K, row0, rows, e2, n0,
            ROLE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """The two worker partitions share one signature: ROLE 0 the TMA producer, 1 the second half."""
    if ROLE == 0:
        _producer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, row0, e2, n0, K, BK, STAGES)
    else:
        _half(a_bufs, b_bufs, ready, empty, h_ptr, F, K, row0, rows, n0, 1, BM, BN, BK, STAGES)


@gluon.jit
def gate_up_ws2_kernel(x_desc, w_desc, tiles_ptr, h_ptr, F, K, n_tiles,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       num_warps: gl.constexpr):
    """gate_up_ws_kernel with the two consumer warpgroups as two partitions, each on its half of the rows
    (num_warps = 4: the default partition is the first half)."""
    e, row0, rows, n0, a_bufs, b_bufs, ready, empty = _setup(x_desc, w_desc, tiles_ptr, n_tiles, 2, BM, BN, BK,
                                                             STAGES)  # both halves hand a slot back
    gl.warp_specialize([
        (_half0, (a_bufs, b_bufs, ready, empty, h_ptr, F, K, row0, rows, n0, BM, BN, BK, STAGES)),
        (_worker, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, h_ptr, F, K, row0, rows, 2 * e, n0, 0, BM, BN,
                   BK, STAGES)),
        (_worker, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, h_ptr, F, K, row0, rows, 2 * e, n0, 1, BM, BN,
                   BK, STAGES)),
    ], [1, 4], [24, 240])


def compile_sm90(BM=128, BN=128, BK=64, STAGES=4, num_warps=8, two=False):
    """Compile the kernel (two: gate_up_ws2_kernel, num_warps 4) for sm_90 (no GPU needed): (shared bytes,
    ptx)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    a_l = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_l = gl.NVMMASharedLayout.get_default_for([2, BN, BK], gl.bfloat16)
    sig = {"x_desc": f"tensordesc<bf16[{BM}, {BK}],{a_l!r}>", "w_desc": f"tensordesc<bf16[2, {BN}, {BK}],{b_l!r}>",
           "tiles_ptr": "*i32", "h_ptr": "*bf16", "F": "i32", "K": "i32", "n_tiles": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "STAGES": "constexpr",
           "num_warps": "constexpr"}
    names = list(sig)
    cx = {(names.index(n),): v for n, v in dict(BM=BM, BN=BN, BK=BK, STAGES=STAGES, num_warps=num_warps).items()}
    src = GluonASTSource(gate_up_ws2_kernel if two else gate_up_ws_kernel, sig, constexprs=cx)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=168))
    return k.metadata.shared, k.asm["ptx"]


# ------------------------------------------------------------------------------------------------ GPU side


def tile_list(counts, BM: int):
    """[n, 3] int32 (expert, first sorted row, rows) of every BM-row tile, from the routing counts."""
    import torch

    c = counts.tolist()
    rows, start = [], 0
    for e, m in enumerate(c):
        for t in range(0, m, BM):
            rows.append((e, start + t, min(BM, m - t)))
        start += m
    return torch.tensor(rows, dtype=torch.int32, device=counts.device)


def run_ws(xs, gu, tiles, h=None, BM=128, BN=128, BK=64, STAGES=4, num_warps=8, two=False):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, F2, D = gu.shape
    F = F2 // 2
    a_l = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_l = gl.NVMMASharedLayout.get_default_for([2, BN, BK], gl.bfloat16)
    x_desc = TensorDescriptor(xs, list(xs.shape), list(xs.stride()), [BM, BK], a_l)
    w_desc = TensorDescriptor(gu, [2 * E, F, D], [F * D, D, 1], [2, BN, BK], b_l)
    n = tiles.shape[0]
    kernel = gate_up_ws2_kernel if two else gate_up_ws_kernel
    kernel[(n * triton.cdiv(F, BN),)](x_desc, w_desc, tiles, h, F, D, n, BM, BN, BK, STAGES,
                                      num_warps=4 if two else num_warps, maxnreg=168)


def run_pkg(xs, gu, counts, sorted_pairs, wts, h=None, P=0, BM=128, BN=128, BK=64, stages=4, num_warps=8, one_dot=True):
    """The package's TMA gate/up kernel (PROJ 0) on the same sorted rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moetune.codegen.triton.grouped_gemm import grouped_gemm_tma_kernel, max_tiles

    E, F2, D = gu.shape
    F = F2 // 2
    nt = max_tiles(P, E, BM)
    a = TensorDescriptor(xs, [P, D], [D, 1], [BM, BK])
    b = (TensorDescriptor(gu, [2 * E, F, D], [F * D, D, 1], [2, BN, BK]) if one_dot
         else TensorDescriptor(gu, [E * F2, D], [D, 1], [BN, BK]))
    be = max(16, 1 << (E - 1).bit_length())
    grouped_gemm_tma_kernel[(nt * triton.cdiv(F, BN),)](
        a, b, wts, counts, sorted_pairs, h, 0, 0, 0, h, h, P, E, F, D, nt, D, 1.0, 0.0,
        BLOCK_E=be, BM=BM, BN=BN, BK=BK, GROUP_M=8, PROJ=0, ACT=0, HAS_BIAS=False, W_IN=False, UPCAST=False,
        ONE_DOT=one_dot, num_warps=num_warps, num_stages=stages)


def run_cublas(xs, gu, bounds, h=None):
    """torch (cuBLAS) on the same work: one bf16 matmul per expert over its sorted rows, then SwiGLU."""
    import torch

    F = gu.shape[1] // 2
    for e, (lo, hi) in enumerate(bounds):
        if hi > lo:
            gg = torch.mm(xs[lo:hi], gu[e].T)  # [m, 2F]
            h[lo:hi] = torch.nn.functional.silu(gg[:, :F]) * gg[:, F:]


CELLS = {"mixtral-8x7b:1024": (8, 2, 4096, 14336, 1024), "mixtral-8x7b:512": (8, 2, 4096, 14336, 512),
         "qwen3-30b-a3b:1024": (128, 8, 2048, 768, 1024)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 only (CPU), then exit")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--cells", default=",".join(CELLS), help="comma-separated cells of CELLS")
    ap.add_argument("--variants", default="", help="regex: only the variants it matches (all by default)")
    args = ap.parse_args()
    if args.compile:
        for st, two in ((3, False), (4, False), (3, True), (4, True)):
            shared, ptx = compile_sm90(STAGES=st, num_warps=4 if two else 8, two=two)
            print(json.dumps(dict(stages=st, two=two, shared=shared, wgmma=ptx.count("wgmma.mma_async"),
                                  tma=ptx.count("cp.async.bulk.tensor"), setmaxnreg=ptx.count("setmaxnreg"))))
        return
    import torch

    from moetune.codegen.triton import routing

    dev = "cuda"
    rows = []
    for cell in args.cells.split(","):
        E, k, D, F, T = CELLS[cell]
        g = torch.Generator(device=dev).manual_seed(0)
        gu = (torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).to(torch.bfloat16)
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        logits = torch.randn(T, E, device=dev, generator=g)
        ids = logits.topk(k, dim=-1).indices
        x = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        P = T * k
        counts, sorted_pairs = routing.route(ids, E)
        xs = routing.gather(x, counts, sorted_pairs, k, torch.bfloat16)  # [P, D] sorted token rows
        wts = torch.ones(P, device=dev)
        # the float32 reference in sorted order
        e_of = torch.repeat_interleave(torch.arange(E, device=dev), counts.long())
        ref = torch.empty(P, F, device=dev)
        for e in range(E):
            sel = e_of == e
            if sel.any():
                gg = xs[sel].float() @ gu[e].float().T  # [m, 2F]
                ref[sel] = torch.nn.functional.silu(gg[:, :F]) * gg[:, F:]
        tiles = tile_list(counts, 128)
        variants = {f"ws-s{st}": partial(run_ws, xs, gu, tiles, STAGES=st) for st in (3, 4)}
        variants.update({f"ws2-s{st}": partial(run_ws, xs, gu, tiles, STAGES=st, two=True) for st in (3, 4)})
        variants["pkg-t1"] = partial(run_pkg, xs, gu, counts, sorted_pairs, wts, P=P)
        variants["pkg-t"] = partial(run_pkg, xs, gu, counts, sorted_pairs, wts, P=P, one_dot=False)
        ends = counts.cumsum(0).tolist()
        variants["cublas"] = partial(run_cublas, xs, gu, list(zip([0] + ends[:-1], ends, strict=True)))
        variants = {n: f for n, f in variants.items() if re.fullmatch(args.variants or ".*", n)}
        flops = 2.0 * P * D * 2 * F
        for name, fn in variants.items():
            h = torch.full((P, F), float("nan"), device=dev, dtype=torch.bfloat16)
            try:
                fn(h=h)
                torch.cuda.synchronize()
                err = ((h.float() - ref).norm() / ref.norm()).item()
            except Exception as ex:  # noqa: BLE001  (a prototype: report and go on)
                rows.append(dict(cell=cell, variant=name, ok=False, error=repr(ex)[:300]))
                print(cell, name, "failed:", repr(ex)[:300], flush=True)
                continue
            ok = err == err and err < 1e-2
            ts = []
            if ok:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn(h=h)
                for _ in range(args.reps):
                    flush.zero_()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    b.record()
                    b.synchronize()
                    ts.append(a.elapsed_time(b) * 1e3)
            t = statistics.median(ts) if ts else float("nan")
            rows.append(dict(cell=cell, variant=name, ok=ok, rel_err=err, time_us=t, tflops=flops / t / 1e6))
            print(cell, name, ok, f"{err:.1e}", f"{t:.1f} us", f"{flops / t / 1e6:.0f} TFLOP/s", flush=True)
    if args.out:
        Path(args.out, "proto_gluon_gemm.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'cell':22} {'variant':8} {'ok':3} {'rel_err':>8} {'µs':>8} {'TFLOP/s':>8}")
    for r in rows:
        if "time_us" in r:
            print(f"{r['cell']:22} {r['variant']:8} {'yes' if r['ok'] else 'NO':3} {r['rel_err']:8.1e} "
                  f"{r['time_us']:8.1f} {r['tflops']:8.0f}")
        else:
            print(f"{r['cell']:22} {r['variant']:8} NO  {r['error'][:60]}")


if __name__ == "__main__":
    main()
