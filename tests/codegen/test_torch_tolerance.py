"""The one tolerance: worst_error against the float32 reference, scaled per dtype."""

from __future__ import annotations

import pytest
import torch

from moetune.codegen.torch import tolerances, worst_error


def test_worst_error_scales_and_catches_nan():
    ref = torch.tensor([[100.0, 0.0]])
    assert worst_error(ref.bfloat16(), ref) == 0
    assert worst_error(torch.tensor([[100.0, 1.0]]).bfloat16(), ref) <= 1  # 1 % of the row's scale
    assert worst_error(torch.tensor([[100.0, 3.0]]).bfloat16(), ref) > 1
    assert worst_error(torch.tensor([[100.0, 1e-2]]), ref) > 1  # float32: 1e-5 of the scale
    assert worst_error(torch.tensor([[float("nan"), 0.0]]), ref) == float("inf")
    with pytest.raises(KeyError, match="float64"):
        tolerances(torch.float64)


def test_tf32_loosens_float32_only():
    assert tolerances(torch.float32, tf32=True) == tolerances(torch.float16)
    assert tolerances(torch.bfloat16, tf32=True) == tolerances(torch.bfloat16)
    ref = torch.tensor([[100.0, 1.0]])
    out = torch.tensor([[100.0, 1.2]])  # 2e-3 of the scale: beyond float32, within TF32
    assert worst_error(out, ref) > 1 and worst_error(out, ref, tf32=True) <= 1
