"""Prototype, not in the package: small-T GEMV with the down projection fused into the gate/up programs.

Why: at T = 1 the two-kernel stream GEMV spends 27.9 µs on qwen3-30b-a3b's 75 MB where ONE launch that
only reads the same bytes takes 21.5 µs (bench/results/NOTES.md, session 3). The second launch's ramp
and tail is the gap. PDL, L2 prefetch and one persistent launch with a grid barrier all lost. Here no
program ever waits for another:

    program (selected expert e, F-block f)   for each row of e (pair p, usually one):
        g, u = gate/up rows [f·BN, f·BN + BN) of e · x[token of p]     (stream the [2·BN, D] rows)
        h    = silu(g)·u · routing weight                              [BN] fp32, in registers
        y[f, p, :] = down[e][:, f-block] · h                           (stream the [D, BN] columns)
    combine (the package's kernel)           out[t] = Σ_f Σ_j y[f, t·k + j]

So every weight byte is read once, all in one launch, and the h round trip through HBM is gone; the
price is the fp32 planes y [F/BN, P, D] that the (tiny) combine reads back: deterministic, no atomics.
The down block is read as D rows of BN contiguous elements (2·BN bytes each): BN trades that access
width against the number of programs.

`rows` (RP) rows of one expert share each read of its weight chunks (T ≥ 8, where experts get 1.3–4
rows). P = T·k ≤ 64: the pairs of each expert straight from ids; above: the package's routing kernel
first. Only standard layouts, SwiGLU, no bias, weights on the output.

    timeout 300 python3 bench/proto_fused_down.py --out $OUT   # on the H200: check, then time against
                                                               # stream_gemv and a read-only kernel
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetune.codegen.common import ExpertTensors  # noqa: E402
from moetune.codegen.triton import combine as _combine  # noqa: E402
from moetune.codegen.triton import routing  # noqa: E402
from moetune.codegen.triton._common import (  # noqa: E402
    _act,
    _find_slot,
    _fused_pairs,
    _fused_slot,
    _row_gate_up,
    _rows_gate_up,
    layout_strides,
    next_pow2,
)
from moetune.ir import MoEBlock, UnsupportedSchedule  # noqa: E402

FUSED_MAX_PAIRS = 64  # P above this: the package's routing kernel groups the pairs first


@dataclass(frozen=True)
class FusedParams:
    block_n: int = 32  # rows of F per program (gate and up rows; columns of the down block)
    block_k: int = 256  # gate/up K chunk (along D)
    block_d: int = 128  # down: rows of D per step
    rows: int = 1  # rows of one expert served by each read of its weight chunks (RP)
    num_warps: int = 4
    num_stages: int = 4


@triton.jit(do_not_specialize=["P"])
def fused_down_kernel(x_ptr, s_xt, ids_ptr, counts_ptr, sorted_ptr, wts_ptr, gu_ptr, gse, gsn, gsk, gup,
                      dn_ptr, dse, dsn, dsk, y_ptr, P, E, D, F, n_fb,
                      K_TOP: tl.constexpr, BP: tl.constexpr, BLOCK_E: tl.constexpr, FUSED: tl.constexpr,
                      RP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                      STAGES: tl.constexpr):
    pid = tl.program_id(0)
    slot = pid // n_fb
    fb = pid % n_fb
    if FUSED:  # P ≤ BP: the expert's pairs straight from ids, no routing kernel
        e, m, match, mrank = _fused_slot(ids_ptr, P, E, slot, BP)
        start = 0
    else:
        e, start, m = _find_slot(counts_ptr, E, slot, 0, False, BLOCK_E)
    n0 = fb * BN
    offs_f = n0 + tl.arange(0, BN)
    fm = offs_f < F
    ec = e.to(tl.int64)
    gu_e = gu_ptr + ec * gse
    dn_e = dn_ptr + ec * dse + offs_f[None, :] * dsk  # [1, BN]
    r = tl.arange(0, RP)
    for c0 in range(0, m, RP):  # RP rows of expert e per read of its weight chunks
        rmask = (c0 + r) < m
        if FUSED:
            pairs = _fused_pairs(match, mrank, c0, RP, BP)  # [RP]
        else:
            pairs = tl.load(sorted_ptr + start + c0 + r, mask=rmask, other=0)
        wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [RP]
        if RP == 1:
            g1, u1 = _row_gate_up(x_ptr, s_xt, tl.sum(pairs, axis=0) // K_TOP, gu_e, gsn, gsk, gup, n0, F, D,
                                  BN, BK, STAGES)
            g, u = g1[None, :], u1[None, :]
        else:
            g, u = _rows_gate_up(x_ptr, s_xt, pairs // K_TOP, rmask, gu_e, gsn, gsk, gup, n0, F, D,
                                 RP, BN, BK, STAGES)
        h = tl.where(fm[None, :], _act(g, u, 0, 0.0, 0.0) * wt[:, None], 0.0)  # [RP, BN] fp32
        yrows = y_ptr + (fb * P + pairs).to(tl.int64)[:, None] * D  # [RP, 1]
        for d0 in tl.range(0, D, BD, num_stages=STAGES):
            offs_d = d0 + tl.arange(0, BD)
            dm = offs_d < D
            wv = tl.load(dn_e + offs_d[:, None] * dsn, mask=dm[:, None] & fm[None, :], other=0.0,
                         eviction_policy="evict_first")  # [BD, BN]
            yv = tl.sum(wv.to(tl.float32)[None, :, :] * h[:, None, :], axis=2)  # [RP, BD]
            tl.store(yrows + offs_d[None, :], yv, mask=rmask[:, None] & dm[None, :])


class FusedDown:
    """The experts function of the prototype: fn(x, ids, weights, w) → out [T, D]."""

    def __init__(self, block: MoEBlock, p: FusedParams = FusedParams()):
        lay = block.layout
        if lay.transposed or lay.interleaved or lay.has_bias:
            raise UnsupportedSchedule("fused-down prototype: standard layout without bias only")
        if block.activation.kind != "swiglu" or block.weight_application != "output":
            raise UnsupportedSchedule("fused-down prototype: SwiGLU with weights on the output only")
        self.block, self.p = block, p

    def __call__(self, x, ids, weights, w: ExpertTensors) -> torch.Tensor:
        b, p = self.block, self.p
        E, k, D, F = b.E, b.k, b.D, b.F
        T = x.shape[0]
        P = T * k
        gs, ds = layout_strides(b, w)
        n_fb = triton.cdiv(F, p.block_n)
        fused = P <= FUSED_MAX_PAIRS
        if fused:
            counts = sorted_pairs = ids  # unused
        else:
            counts, sorted_pairs = routing.route(ids, E)
        y = torch.empty(n_fb, P, D, dtype=torch.float32, device=x.device)  # [F/BN, P, D]
        fused_down_kernel[(min(E, P) * n_fb,)](
            x, x.stride(0), ids, counts, sorted_pairs, weights.reshape(-1), w.gate_up, gs.se, gs.sn, gs.sk,
            gs.up, w.down, ds.se, ds.sn, ds.sk, y, P, E, D, F, n_fb,
            K_TOP=k, BP=max(16, next_pow2(P)) if fused else 16, BLOCK_E=max(16, next_pow2(E)), FUSED=fused,
            RP=p.rows, BN=p.block_n, BK=p.block_k, BD=p.block_d, STAGES=p.num_stages, num_warps=p.num_warps,
            num_stages=p.num_stages)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # [T, D]
        return _combine.combine(y, ids, out, E)


# ------------------------------------------------------------------------------------------ H200 run


def main() -> None:
    """Check every variant (eager and graph replay) against the float32 reference, then time it beside
    the shipped stream_gemv default and a read-only kernel of the same bytes; a table last."""
    import kernels as B  # bench/kernels.py

    from moetune.codegen.triton import BACKEND, expected_distinct

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--cells", default="qwen3-30b-a3b:1,qwen3-30b-a3b:2,qwen3-30b-a3b:4,qwen3-30b-a3b:8,"
                                       "qwen3-30b-a3b:16,qwen3-30b-a3b:32,qwen3-30b-a3b:64,qwen3.5-397b-a17b:1,"
                                       "qwen3.5-397b-a17b:4,mixtral-8x7b:1,mixtral-8x7b:2,deepseek-v3:1")
    args = ap.parse_args()
    one = {f"f{bn}-k{bk}-d{bd}-w{nw}": FusedParams(block_n=bn, block_k=bk, block_d=bd, num_warps=nw)
           for bn, bk, bd, nw in ((16, 256, 128, 4), (32, 256, 128, 4), (64, 256, 64, 4), (32, 512, 128, 8),
                                  (128, 128, 32, 8))}
    several = {f"f{bn}-r{rp}-w{nw}": FusedParams(block_n=bn, block_k=128, block_d=64, rows=rp, num_warps=nw)
               for bn, rp, nw in ((32, 2, 4), (32, 4, 4), (64, 4, 8))}

    def candidates(block, T):
        """The cell's shipped defaults (stream_gemv, and grouped_gemm beyond ~1.5 rows per expert), then
        the one-row variants and, where experts get several rows, the RP = 2 / 4 ones."""
        rows = T * block.k / max(expected_distinct(block, T), 1.0)
        out = [("stream_gemv default", BACKEND.build(block, BACKEND.default(block, "stream_gemv", T)))]
        if rows > 1.2:
            out.append(("grouped_gemm default", BACKEND.build(block, BACKEND.default(block, "grouped_gemm", T))))
        vs = {**(one if rows < 2.5 else {}), **(several if rows > 1.2 else {})}
        return out + [(tag, FusedDown(block, vp)) for tag, vp in vs.items()]

    def read_only(block, T, distinct, flush):
        return [("read-only, same bytes", B.read_only_us(int(distinct * 3 * block.D * block.F * 2), flush))]

    B.probe_cells(args.cells, candidates, Path(args.out) / "proto-fused-down.json",
                  "fused-down GEMV prototype", read_only)


if __name__ == "__main__":
    main()
