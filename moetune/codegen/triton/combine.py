"""The combine: out[t] = Σ_s Σ_j y[s, t·k + j] over valid pairs, cast to the output dtype.

The down kernels write one row per (K split s, pair p), routing weight already applied (fp32, or the
activation's 16-bit dtype with GemmParams.y_half), so this is the whole "sum over k back to token
order", in fp32: deterministic (no atomics), one small launch, reads S·T·k·D rows and writes T·D.

A program takes one token and BD columns, and loads its k rows as one [BD, KP] tile with D the
contiguous axis. BD is one 16-byte vector per thread over all the program's threads, so each thread
holds its vector of every one of the k rows: all k loads are in flight at once and the sum over k stays
inside the thread (no shared memory, no barrier), which is faster than loading one row at a time.
With `pdl` it is a programmatic dependent launch (_common's module doc): a program reads its token's ids,
then waits for the down kernel's y.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _grid_wait
from .launch import launch, pdl_launch
from .layout import cdiv, flat_pairs, next_pow2


@triton.jit(do_not_specialize=["P"])
def combine_kernel(y_ptr, ids_ptr, out_ptr, s_ot, P, E, N,
                   S: tl.constexpr, K_TOP: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr,
                   PDL: tl.constexpr = False):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)  # [BD]
    nm = offs < N
    jk = tl.arange(0, KP)
    p = t * K_TOP + jk  # [KP] this token's pairs
    e = tl.load(ids_ptr + p, mask=jk < K_TOP, other=-1).to(tl.int32)
    ok = (jk < K_TOP) & (e >= 0) & (e < E)  # a sentinel id's pair adds nothing
    if PDL:
        _grid_wait()
    acc = tl.zeros([BD], dtype=tl.float32)
    for s in tl.static_range(S):
        tile = y_ptr + (s * P + p).to(tl.int64)[None, :] * N + offs[:, None]  # [BD, KP]
        acc += tl.sum(tl.load(tile, mask=nm[:, None] & ok[None, :], other=0.0).to(tl.float32), axis=1)
    tl.store(out_ptr + t.to(tl.int64) * s_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=nm)


def block_d(D: int, y_bytes: int) -> tuple[int, int]:
    """(BD, warps): one 16-byte vector of y per thread, up to 4 warps, no wider than D needs."""
    vec = 16 // y_bytes
    warps = max(1, min(4, next_pow2(D) // (32 * vec)))
    return 32 * vec * warps, warps


def combine(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, E: int, pdl: bool = False) -> torch.Tensor:
    """y [S, P, D] (fp32 or 16-bit), ids [T, k] → out [T, D] (written in place and returned); `pdl`: launched
    programmatically after the kernel that writes y (module doc)."""
    S, P, D = y.shape
    T, k = ids.shape
    bd, warps = block_d(D, y.element_size())
    launch(combine_kernel, (T, cdiv(D, bd)), y, flat_pairs(ids), out, out.stride(0), P, E, D,
           S=S, K_TOP=k, KP=next_pow2(k), BD=bd, num_warps=warps, PDL=pdl, **pdl_launch(pdl))
    return out


def cost(S: int, P: int, T: int, D: int, out_bytes: int, y_bytes: int = 4) -> tuple[float, float]:
    return float(S * P * D), float(S * P * D * y_bytes + T * D * out_bytes)
