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
