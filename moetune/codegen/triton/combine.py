"""The combine: out[t] = Σ_s Σ_j y[s, t·k + j] over valid pairs, cast to the output dtype.

The down kernels write one row per (K split s, pair p), routing weight already applied (fp32, or the
activation's 16-bit dtype with GemmParams.y_half), so this is the whole "sum over k back to token
order", in fp32: deterministic (no atomics), one small launch, reads S·T·k·D rows and writes T·D.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_pow2
from .launch import launch


@triton.jit(do_not_specialize=["P", "S"])
def combine_kernel(y_ptr, ids_ptr, out_ptr, s_ot, P, E, N, S,
                   K_TOP: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr):
    """out[t, BD block] = Σ_s Σ_j y[s, t·k + j]: the token's k rows of a split as ONE [KP, BD] load (all
    in flight at once; one row at a time kept a single load per warp in flight: 2.4 TB/s on the H200 at
    qwen3-30b-a3b T = 1024, ncu, bench/results/h200-s9/README.md), summed over j in fp32."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    nm = offs < N
    jk = tl.arange(0, KP)
    p = t * K_TOP + jk  # [KP]
    e = tl.load(ids_ptr + p, mask=jk < K_TOP, other=-1).to(tl.int32)
    ok = (jk < K_TOP) & (e >= 0) & (e < E)
    acc = tl.zeros([BD], dtype=tl.float32)
    for s in range(0, S):
        rows = y_ptr + (s * P + p).to(tl.int64)[:, None] * N + offs[None, :]  # [KP, BD]
        acc += tl.sum(tl.load(rows, mask=ok[:, None] & nm[None, :], other=0.0).to(tl.float32), axis=0)
    tl.store(out_ptr + t.to(tl.int64) * s_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=nm)


def combine(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, E: int,
            block_d: int = 512) -> torch.Tensor:
    """y [S, P, D] (fp32 or 16-bit), ids [T, k] → out [T, D] (written in place and returned)."""
    S, P, D = y.shape
    T, k = ids.shape
    bd = min(block_d, next_pow2(D))
    launch(combine_kernel, (T, cdiv(D, bd)), y, ids, out, out.stride(0), P, E, D, S,
           K_TOP=k, KP=next_pow2(k), BD=bd, num_warps=4)
    return out


def cost(S: int, P: int, T: int, D: int, out_bytes: int, y_bytes: int = 4) -> tuple[float, float]:
    return float(S * P * D), float(S * P * D * y_bytes + T * D * out_bytes)
