"""The tuner's baseline is transformers' own experts function of the block's weight format: its bf16 experts
functions on unquantised experts, its FP8 experts functions (block scales, dynamic activation groups) on FP8
ones, each checked against the float32 reference; an FP8 baseline whose hub kernel cannot be fetched fails
with transformers' own reason, never with a dtype error from the bf16 path."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moetune.codegen.torch.tolerance import worst_error
from moetune.ir import MoEBlock, WeightFormat
from moetune.search.baseline import BASELINES, baseline_fn
from moetune.search.objective import expert_tensors, make_cases, reference

BF16 = MoEBlock(E=4, k=2, D=256, F=128, name="tiny")
FP8 = BF16.with_weight_format(WeightFormat.fp8_block())


def _case(block: MoEBlock, T: int = 5):
    w = expert_tensors(block, torch.device("cpu"))
    return w, make_cases(block, w, T, 1, torch.Generator().manual_seed(7))[0]


@pytest.mark.parametrize("name", BASELINES)
def test_the_bf16_baseline_is_transformers_experts_function(name):
    fn, label = baseline_fn(BF16, name)
    assert label == f"transformers:{name}"
    w, c = _case(BF16)
    assert worst_error(fn(c.x, c.ids, c.weights, w), reference(BF16, c)) <= 1


@pytest.mark.parametrize("name", BASELINES)
def test_the_fp8_baseline_is_transformers_fp8_experts_function(name, monkeypatch):
    """With the hub kernel's three entry points in the slot transformers loads them into (here computed by
    dequantising), the FP8 baseline reads the FP8 weights and their scales in place and agrees with float32."""
    from transformers.integrations import finegrained_fp8 as f8

    from moetune.testing.fp8 import dequantizing_fp8_kernel

    monkeypatch.setattr(f8, "_FINEGRAINED_FP8", dequantizing_fp8_kernel())
    fn, label = baseline_fn(FP8, name)
    assert label == f"transformers:fp8_{name}"
    w, c = _case(FP8)
    assert w.gate_up.dtype == torch.float8_e4m3fn
    assert worst_error(fn(c.x, c.ids, c.weights, w), reference(FP8, c)) <= 1


@pytest.mark.skipif(importlib.util.find_spec("kernels") is not None, reason="the kernels package would fetch it")
def test_without_the_hub_kernel_the_fp8_baseline_fails_with_transformers_reason(monkeypatch):
    from transformers.integrations import finegrained_fp8 as f8

    monkeypatch.setattr(f8, "_FINEGRAINED_FP8", None)
    fn, _ = baseline_fn(FP8, "grouped_mm")
    w, c = _case(FP8)
    with pytest.raises(ImportError, match="finegrained-fp8"):
        fn(c.x, c.ids, c.weights, w)
