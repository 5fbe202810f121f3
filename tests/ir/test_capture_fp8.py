"""Capture of transformers' FP8Experts: the fp8_block format read off the module, and what is refused, why."""

import pytest
import torch

from moetune import testing as tm
from moetune.ir import WeightFormat
from moetune.ir.capture import capture
from moetune.testing import fp8

# families whose experts have the standard layout (GPT-OSS is transposed, interleaved and biased)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "olmoe"]
BLOCK = (8, 8)  # divides D = 64 and F = 40


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_experts_captured_as_the_bf16_block_in_fp8_blocks(family, dtype):
    plain = capture(tm.build(family, dtype=getattr(torch, dtype)))
    model = fp8.to_fp8(tm.build(family, dtype=getattr(torch, dtype)), BLOCK)
    found = capture(model)
    assert [c.ok for c in found] == [True] * len(plain), [c.reason for c in found]
    fmt = WeightFormat.fp8_block(BLOCK, "float32", dtype)
    for c, p in zip(found, plain, strict=True):
        assert type(c.experts).__mro__[1].__name__ == "FP8Experts"
        assert c.block.weight_format == fmt and c.block.weight_dtype == "float8_e4m3fn"
        assert c.block == p.block.with_weight_format(fmt)
        assert c.block.signature() != p.block.signature()


def test_ue8m0_scales_and_the_module_unchanged():
    model = fp8.to_fp8(tm.build("qwen3_moe", dtype=torch.bfloat16), BLOCK, "ue8m0")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_scale_inv.dtype == torch.float8_e8m0fnu
    before = {n: (p.dtype, p.data_ptr()) for n, p in experts.named_parameters()}
    found = capture(model)
    assert all(c.ok for c in found)
    assert found[0].block.weight_format == WeightFormat.fp8_block(BLOCK, "ue8m0", "bfloat16")
    assert {n: (p.dtype, p.data_ptr()) for n, p in experts.named_parameters()} == before


def test_block_size_read_from_the_scales_when_the_module_has_none():
    model = fp8.to_fp8(tm.build("qwen3_moe", dtype=torch.bfloat16), BLOCK)
    for m in model.modules():
        if type(m).__name__ == "TinyFP8Experts":
            m.__dict__.pop("block_size")
            assert not hasattr(m, "block_size")
    assert capture(model)[0].block.weight_format.block == BLOCK


def _set(name, value):
    return lambda e: setattr(e, name, value)


def _param(name, make):
    return lambda e: setattr(e, name, torch.nn.Parameter(make(getattr(e, name)), requires_grad=False))


@pytest.mark.parametrize("change, words", [
    (_set("activation_scheme", "static"), ["activation_scheme='static'", "supported: dynamic"]),
    (_set("has_gate", False), ["has_gate=False"]),
    (_set("block_size", None), ["per-tensor scales", "block_size=None"]),
    (_param("gate_up_proj", lambda t: torch.zeros(t.shape[0], t.shape[1], t.shape[2] // 2, dtype=torch.int8)),
     ["FP4 experts"]),
    (_param("down_proj_scale_inv", lambda t: t[:, :-1]), ["down_proj_scale_inv", "[16, 7, 5]", "[16, 8, 5]"]),
    (_param("gate_up_proj_scale_inv", lambda t: t.bfloat16()), ["bfloat16", "float32", "float8_e8m0fnu"]),
    (_set("gate_softcap", 30.0), ["softcapped"]),
    (_set("limit", 7.0), ["limit=7.0", "swiglu_alpha"]),
])
def test_refused_with_reason(change, words):
    model = fp8.to_fp8(tm.build("qwen3_moe", dtype=torch.bfloat16), BLOCK)
    blk = model.model.layers[0].mlp
    change(blk.experts)
    found = capture(model)
    assert not found[0].ok and found[0].block is None
    for w in words:
        assert w in found[0].reason, found[0].reason
    assert found[0].reason.startswith("model.layers.0.mlp") and found[1].ok


def test_partial_last_block_refused():
    model = fp8.to_fp8(tm.build("qwen3_moe", dtype=torch.bfloat16), (16, 16))  # F = 40: 16 does not divide it
    found = capture(model)
    assert not found[0].ok
    assert "partial last block" in found[0].reason and "F (gate/up rows)=40 is not a multiple of 16" in \
        found[0].reason


def test_mxfp4_still_refused():
    model = tm.build("qwen3_moe")
    blk = model.model.layers[0].mlp
    blk.experts.__class__ = type("Mxfp4Experts", (type(blk.experts),), {})
    found = capture(model)
    assert not found[0].ok and "MXFP4" in found[0].reason


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "mixtral"])
def test_activation_dtype_read_off_a_router_computing_in_it(family):
    """A model built in float32 and moved to bf16 keeps config.dtype float32; its router's weight (which meets
    the activations in a matrix product) says bf16."""
    model = fp8.to_fp8(tm.build(family).to(torch.bfloat16), BLOCK)
    assert model.config.dtype == torch.float32
    found = capture(model)
    assert found and all(c.ok for c in found), [c.reason for c in found]
    assert all(c.block.weight_format == WeightFormat.fp8_block(BLOCK, "float32", "bfloat16") for c in found)
