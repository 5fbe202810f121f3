"""The activation pre-pass of the w8a8 FP8 kernels: rows of x (or of h) → e4m3 values and one fp32 scale per row
and G channels, by quant.quantize_rows' rule bit for bit (`_fp8._quant_groups`), one program per BR rows and
one group of G channels. grouped_gemm_fp8.py launches it on x [T, D] before the gate/up GEMM and, with h_pass,
on h [P, F] before the down GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _grid_release, _grid_wait
from ._fp8 import _quant_groups
from .launch import launch, pdl_launch
from .layout import cdiv, interpreting


@triton.jit(do_not_specialize=["T"])
def quant_rows_kernel(x_ptr, s_xt, q_ptr, s_ptr, T, D, BR: tl.constexpr, G: tl.constexpr,
                      EMULATE: tl.constexpr, PDL: tl.constexpr = False, WAIT_FIRST: tl.constexpr = False):
    """x [T, D] → q [T, D] e4m3, s [T, D / G] fp32: one program per BR rows and one group of G channels. With
    PDL, launched programmatically after the routing: x is the block's input, so it runs beside the routing
    and waits for it only at its end (a chain's kernel finishes after the one before it); WAIT_FIRST (x the
    output of the launch before, h of the gate/up GEMM): it waits before it reads."""
    if PDL and WAIT_FIRST:
        _grid_wait()
    if PDL:
        _grid_release()
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = rows < T
    offs = tl.program_id(1) * G + tl.arange(0, G)
    v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * s_xt + offs[None, :], mask=rm[:, None], other=0.0)
    q, s = _quant_groups(v.to(tl.float32), BR, G, G, EMULATE)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * D + offs[None, :], q, mask=rm[:, None])
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * (D // G) + tl.program_id(1) + tl.arange(0, 1)[None, :], s,
             mask=rm[:, None])
    if PDL and not WAIT_FIRST:
        _grid_wait()


def rows_per_program(group: int) -> int:
    """BR, the rows one program quantises: up to 16, at most 4096 values a program."""
    return max(1, min(16, 4096 // group))


def quant_rows(x: torch.Tensor, group: int, pdl: bool = False, after: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, D] e4m3, s [T, D / group] fp32) of x [T, D] by `quant_rows_kernel` (quant.quantize_rows' rule);
    `pdl`: launched programmatically after the routing, or, `after`, after the kernel that writes x (the
    kernel's doc)."""
    T, D = x.shape
    q = torch.empty(T, D, dtype=torch.float8_e4m3fn, device=x.device)  # [T, D]
    s = torch.empty(T, D // group, dtype=torch.float32, device=x.device)  # [T, D / G]
    br = rows_per_program(group)
    launch(quant_rows_kernel, (cdiv(T, br), D // group), x, x.stride(0), q, s, T, D,
           BR=br, G=group, EMULATE=interpreting(), num_warps=4, PDL=pdl,
           **({"WAIT_FIRST": True} if pdl and after else {}), **pdl_launch(pdl))
    return q, s
