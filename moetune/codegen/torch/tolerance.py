"""One place for how close a kernel's result must be to the float32 reference, per dtype."""

from __future__ import annotations

import torch

_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing a `dtype` kernel output against the float32 reference.

    float32: accumulation order only. bfloat16 / float16: the inputs, the gate/up rows and the
    output are rounded to the dtype (8 / 11 mantissa bits) around float32-accumulated GEMMs.
    """
    if dtype not in _TOL:
        raise KeyError(f"no tolerance for {dtype}; known: {', '.join(str(d) for d in _TOL)}")
    return _TOL[dtype]
