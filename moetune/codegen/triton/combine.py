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
                   K_TOP: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    nm = offs < N
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(K_TOP):
        p = t * K_TOP + j
        e = tl.load(ids_ptr + p).to(tl.int32)
        ok = (e >= 0) & (e < E)
        for s in range(0, S):
            row = y_ptr + (s * P + p).to(tl.int64) * N
            acc += tl.load(row + offs, mask=nm & ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * s_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=nm)


def combine(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, E: int,
            block_d: int = 512) -> torch.Tensor:
    """y [S, P, D] (fp32 or 16-bit), ids [T, k] → out [T, D] (written in place and returned)."""
    S, P, D = y.shape
    T, k = ids.shape
    bd = min(block_d, next_pow2(D))
    launch(combine_kernel, (T, cdiv(D, bd)), y, ids, out, out.stride(0), P, E, D, S,
           K_TOP=k, BD=bd, num_warps=4)
    return out


def cost(S: int, P: int, T: int, D: int, out_bytes: int, y_bytes: int = 4) -> tuple[float, float]:
    return float(S * P * D), float(S * P * D * y_bytes + T * D * out_bytes)
