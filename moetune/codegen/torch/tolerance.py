"""One place for how close a kernel's result must be to the float32 reference, per dtype."""

from __future__ import annotations

import torch

_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def tolerances(dtype: torch.dtype, *, tf32: bool = False) -> tuple[float, float]:
    """(rtol, atol) for comparing a `dtype` kernel output against the float32 reference.

    float32: accumulation order only; with `tf32` (a GPU kernel whose float32 matrix products round
    their inputs to TF32's 10 mantissa bits, as Triton's tl.dot does) the float16 bounds.
    bfloat16 / float16: the inputs, the gate/up rows, the hidden rows and the output are rounded to the
    dtype (8 / 11 mantissa bits) around float32-accumulated GEMMs. `atol` is in units of the output's
    scale, max(1, max|ref|): a rounding error of the hidden row reaches every output element of its
    token, small ones included.
    """
    if dtype not in _TOL:
        raise KeyError(f"no tolerance for {dtype}; known: {', '.join(str(d) for d in _TOL)}")
    return _TOL[torch.float16 if tf32 and dtype == torch.float32 else dtype]


def worst_error(out: torch.Tensor, ref: torch.Tensor, *, tf32: bool = False) -> float:
    """max |out − ref| / (atol·scale + rtol·|ref|) with `tolerances(out.dtype, tf32=tf32)`: ≤ 1 means within.

    NaN or inf in `out` where `ref` is finite counts as infinitely wrong."""
    if out.shape != ref.shape:
        raise ValueError(f"shape {tuple(out.shape)} against the reference's {tuple(ref.shape)}")
    if out.numel() == 0:
        return 0.0
    rtol, atol = tolerances(out.dtype, tf32=tf32)
    ref = ref.float()
    scale = max(1.0, ref.abs().max().item())
    err = (out.float() - ref).abs() / (atol * scale + rtol * ref.abs())
    return float("inf") if not torch.isfinite(err).all() else err.max().item()
