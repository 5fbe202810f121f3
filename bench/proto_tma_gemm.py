"""Prototype, not in the package: the large-T grouped GEMM with TMA loads for both operands.

Why: at many rows per expert the grouped GEMM is tensor-core bound and reaches 43–63 % of the floor
(mixtral-8x7b T = 1024: 1688 µs, target ≤ 975 µs; bench/results/NOTES.md). Its A operand is gathered
token rows (cp.async with per-row addresses) and its B tiles are plain pointer loads, issued by the same
warps that run wgmma. Here both operands come through tensor-memory-accelerator descriptors:

    route     counts [E], expert-sorted pairs (the package's routing kernel)
    align     xs [R, D]: token rows copied into expert segments padded to BLOCK_M, so every tile is one
              rectangle of one expert; row_pair [R] (−1 on padding)
    gate/up   A = xs box [BM, BK], B = gate_up viewed [E·2F, D] boxes [BN, BK] (gate and up rows of the
              tile's expert), SwiGLU epilogue → hs [R, F] (same padded order)
    down      A = hs box [BM, BK], B = down viewed [E·D, F] box [BN, BK], routing weight in the epilogue,
              fp32 rows y [P, D] scattered to pair order
    combine   the package's: sums the k rows of each token

R = ⌊P/BM⌋·BM + E·BM bounds the padded rows of any routing; workspace O(R·(D + F) + P·D).  Standard
layout (gate_up [E, 2F, D], down [E, D, F], contiguous), SwiGLU, no bias, weights on the output.

    timeout 300 python3 bench/proto_tma_gemm.py --out $OUT   # on the H200: check, then time against
                                                             # the shipped grouped_gemm defaults
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetune.codegen.common import ExpertTensors  # noqa: E402
from moetune.codegen.triton import combine as _combine  # noqa: E402
from moetune.codegen.triton import routing  # noqa: E402
from moetune.codegen.triton._common import _act, _find_tile, interpreting, next_pow2  # noqa: E402
from moetune.ir import MoEBlock, UnsupportedSchedule  # noqa: E402


@dataclass(frozen=True)
class TmaParams:
    block_m: int = 128
    block_n: int = 128  # gate/up: F columns per tile (gate and up accumulators)
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    down_block_n: int = 256
    down_block_k: int = 64
    down_warps: int = 8
    down_stages: int = 3


@triton.jit(do_not_specialize=["P"])
def align_kernel(x_ptr, s_xt, counts_ptr, sorted_ptr, xs_ptr, row_pair_ptr, P, E, D,
                 K_TOP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BLOCK_E: tl.constexpr):
    """Tile t's BM padded rows: the token rows of its expert's sorted pairs (padding: row_pair −1)."""
    t = tl.program_id(0)
    e, row0, left = _find_tile(counts_ptr, E, t, BM, 0, False, BLOCK_E)
    r = tl.arange(0, BM)
    valid = r < left
    pair = tl.load(sorted_ptr + row0 + r, mask=valid, other=0)  # [BM]
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = offs_d < D
    v = tl.load(x_ptr + (pair // K_TOP).to(tl.int64)[:, None] * s_xt + offs_d[None, :],
                mask=valid[:, None] & dm[None, :], other=0.0)
    rows = (t * BM + r).to(tl.int64)
    # padding rows of a real tile are zeros (their h and y are never kept: rows of a GEMM do not mix);
    # tiles past the last real one are not written at all, the GEMMs skip them
    tl.store(xs_ptr + rows[:, None] * D + offs_d[None, :], v, mask=(left > 0) & dm[None, :])
    tl.store(row_pair_ptr + rows, tl.where(valid, pair, -1), mask=(tl.program_id(1) == 0) & (left > 0))


@triton.jit(do_not_specialize=["n_tiles"])
def tma_gemm_kernel(a_desc, b_desc, counts_ptr, row_pair_ptr, wts_ptr, out_ptr, E, N, K, n_tiles,
                    alpha, limit, PROJ: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr):
    """PROJ 0: hs[tile rows, n] = act(xs · gateᵀ, xs · upᵀ); PROJ 1: y[pair, n] = w · (hs · downᵀ)."""
    pid = tl.program_id(0)
    nb_n = tl.cdiv(N, BN)
    in_group = GROUP_M * nb_n
    first = (pid // in_group) * GROUP_M
    gsize = tl.minimum(n_tiles - first, GROUP_M)
    tile = first + (pid % in_group) % gsize
    n0 = ((pid % in_group) // gsize) * BN
    e, _, left = _find_tile(counts_ptr, E, tile, BM, 0, False, BLOCK_E)
    if left > 0:
        r0 = tile * BM
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if PROJ == 0:
            accu = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                a = a_desc.load([r0, k0])  # [BM, BK]
                bg = b_desc.load([e * 2 * N + n0, k0])  # [BN, BK] gate rows
                bu = b_desc.load([e * 2 * N + N + n0, k0])  # [BN, BK] up rows
                if UPCAST:
                    a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
                acc = tl.dot(a, bg.T, acc)
                accu = tl.dot(a, bu.T, accu)
            h = _act(acc, accu, 0, alpha, limit)
            rows = (r0 + tl.arange(0, BM)).to(tl.int64)
            offs_n = n0 + tl.arange(0, BN)
            tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], h.to(out_ptr.dtype.element_ty),
                     mask=(offs_n < N)[None, :])
        else:
            for k0 in range(0, K, BK):
                a = a_desc.load([r0, k0])  # [BM, BK]
                b = b_desc.load([e * N + n0, k0])  # [BN, BK] down rows
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b.T, acc)
            rows = r0 + tl.arange(0, BM)
            pair = tl.load(row_pair_ptr + rows)  # [BM], −1 on padding
            ok = pair >= 0
            wt = tl.load(wts_ptr + pair, mask=ok, other=0.0).to(tl.float32)
            offs_n = n0 + tl.arange(0, BN)
            tl.store(out_ptr + pair.to(tl.int64)[:, None] * N + offs_n[None, :], acc * wt[:, None],
                     mask=ok[:, None] & (offs_n < N)[None, :])


class TmaGemm:
    """The experts function of the prototype: fn(x, ids, weights, w) → out [T, D]."""

    def __init__(self, block: MoEBlock, p: TmaParams = TmaParams()):
        lay = block.layout
        if lay.transposed or lay.interleaved or lay.has_bias:
            raise UnsupportedSchedule("TMA prototype: standard layout without bias only")
        if block.activation.kind != "swiglu" or block.weight_application != "output":
            raise UnsupportedSchedule("TMA prototype: SwiGLU with weights on the output only")
        self.block, self.p = block, p

    def __call__(self, x, ids, weights, w: ExpertTensors) -> torch.Tensor:
        b, p = self.block, self.p
        E, k, D, F = b.E, b.k, b.D, b.F
        T = x.shape[0]
        P = T * k
        gu, dn = w.gate_up, w.down
        if not (gu.is_contiguous() and dn.is_contiguous()):
            raise UnsupportedSchedule("TMA prototype: contiguous expert weights only")
        counts, sorted_pairs = routing.route(ids, E)
        bm = p.block_m
        n_tiles = P // bm + min(E, P)  # bounds Σ_e ⌈m_e / BM⌉
        R = n_tiles * bm
        block_e = max(16, next_pow2(E))
        xs = torch.empty(R, D, dtype=x.dtype, device=x.device)  # [R, D] padded expert segments
        row_pair = torch.empty(R, dtype=torch.int32, device=x.device)  # [R]
        bd = min(256, next_pow2(D))
        align_kernel[(n_tiles, triton.cdiv(D, bd))](x, x.stride(0), counts, sorted_pairs, xs, row_pair, P, E, D,
                                                     K_TOP=k, BM=bm, BD=bd, BLOCK_E=block_e, num_warps=4)
        upcast = interpreting() and torch.bfloat16 in (x.dtype, gu.dtype)
        hs = torch.empty(R, F, dtype=x.dtype, device=x.device)  # [R, F]
        a0 = TensorDescriptor.from_tensor(xs, [bm, p.block_k])
        b0 = TensorDescriptor.from_tensor(gu.view(E * 2 * F, D), [p.block_n, p.block_k])
        tma_gemm_kernel[(n_tiles * triton.cdiv(F, p.block_n),)](
            a0, b0, counts, row_pair, weights, hs, E, F, D, n_tiles, 0.0, 0.0, PROJ=0, BLOCK_E=block_e, BM=bm,
            BN=p.block_n, BK=p.block_k, GROUP_M=p.group_m, UPCAST=upcast, num_warps=p.num_warps,
            num_stages=p.num_stages)
        y = torch.empty(1, P, D, dtype=torch.float32, device=x.device)  # [1, P, D]
        a1 = TensorDescriptor.from_tensor(hs, [bm, p.down_block_k])
        b1 = TensorDescriptor.from_tensor(dn.view(E * D, F), [p.down_block_n, p.down_block_k])
        tma_gemm_kernel[(n_tiles * triton.cdiv(D, p.down_block_n),)](
            a1, b1, counts, row_pair, weights.reshape(-1), y, E, D, F, n_tiles, 0.0, 0.0, PROJ=1,
            BLOCK_E=block_e, BM=bm, BN=p.down_block_n, BK=p.down_block_k, GROUP_M=p.group_m, UPCAST=upcast,
            num_warps=p.down_warps, num_stages=p.down_stages)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        return _combine.combine(y, ids, out, E)


# ------------------------------------------------------------------------------------------ H200 run


def main() -> None:
    """Check every variant (eager and graph replay) against the float32 reference, then time it beside
    the shipped grouped_gemm default with bench/kernels.py's method; a table last."""
    import kernels as B  # bench/kernels.py

    from moetune.codegen.triton import BACKEND

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--cells", default="mixtral-8x7b:1024,mixtral-8x7b:512,qwen3-30b-a3b:1024,"
                                       "deepseek-v3:1024")
    args = ap.parse_args()
    variants = {
        "t128x128k64s4": TmaParams(),
        "t128x128k64s3": TmaParams(num_stages=3),
        "t128x64k64s4": TmaParams(block_n=64, num_stages=4),
        "t64x128k64s4": TmaParams(block_m=64, num_warps=4, down_block_n=128),
        "t128x128g32": TmaParams(group_m=32),
    }

    def candidates(block, T):
        return ([("grouped_gemm default", BACKEND.build(block, BACKEND.default(block, "grouped_gemm", T)))]
                + [(tag, TmaGemm(block, vp)) for tag, vp in variants.items()])

    B.probe_cells(args.cells, candidates, Path(args.out) / "proto-tma-gemm.json", "TMA grouped-GEMM prototype")


if __name__ == "__main__":
    main()
