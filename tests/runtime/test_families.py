"""Every tiny family, bf16 and FP8, captured and compiled, each block's output equal to the original block's
within the dtype's tolerance; an unhooked family left as is with one warning. The capture check that CI also
runs on the lowest transformers the package accepts (.ci/run), so it needs only torch and transformers.

FP8 experts are transformers' FP8Experts as its FP8 loading builds them: `replace_with_fp8_linear` on the meta
device, then the quantised tensors loaded into them (`moetune.testing.fp8`). transformers' own FP8 forward
runs here with the hub kernel's entry points computed by dequantising (`fp8.dequantizing_fp8_kernel`).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import moetune
from moetune.codegen.torch import worst_error
from moetune.ir import WeightFormat
from moetune.ir.capture import capture
from moetune.runtime import plans
from moetune.testing import FAMILIES, UNHOOKED, build, fp8, moe_blocks

HOOKED = [f for f in FAMILIES if f not in UNHOOKED]
FP8_FAMILIES = [f for f in HOOKED if f != "gpt_oss"]  # FP8Experts has no bias: GPT-OSS stays bf16
BLOCK = (8, 8)  # divides D = 64 and F = 40


@pytest.fixture(autouse=True)
def _fp8_kernel(monkeypatch):
    from transformers.integrations import finegrained_fp8 as f8

    monkeypatch.setattr(f8, "_FINEGRAINED_FP8", fp8.dequantizing_fp8_kernel())


def loaded_fp8(family: str) -> torch.nn.Module:
    """The bf16 tiny model of `family` with its experts built by transformers' FP8 loading on the meta
    device (`replace_with_fp8_linear`, experts only) and loaded with the bf16 experts quantised per BLOCK."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    model = build(family, dtype=torch.bfloat16)
    quantised = fp8.to_fp8(build(family, dtype=torch.bfloat16), BLOCK)
    blocks = dict(moe_blocks(model))
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = FineGrainedFP8Config(weight_block_size=list(BLOCK), modules_to_not_convert=linears)
    replace_with_fp8_linear(model, modules_to_not_convert=linears, quantization_config=config, pre_quantized=True)
    for path, block in blocks.items():
        experts, q = block.experts, quantised.get_submodule(path).experts
        assert type(experts).__name__ == "FP8Experts" and experts.gate_up_proj.is_meta
        block.experts = experts.to_empty(device="cpu").eval()
        with torch.no_grad():
            for name, t in q.named_parameters():
                getattr(experts, name).copy_(t)
    return model


def block_out(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = block(x)
    return y[0] if isinstance(y, tuple) else y  # GPT-OSS's block also returns its router's scores


def model_of(family: str, weights: str) -> torch.nn.Module:
    return build(family, dtype=torch.bfloat16) if weights == "bf16" else loaded_fp8(family)


CASES = [(f, "bf16") for f in HOOKED] + [(f, "fp8") for f in FP8_FAMILIES]


@pytest.mark.parametrize("family, weights", CASES, ids=[f"{f}-{w}" for f, w in CASES])
def test_every_block_captured_and_its_output_kept(family, weights):
    model = model_of(family, weights)
    found = capture(model)
    assert [c.path for c in found] == [n for n, _ in moe_blocks(model)]
    assert found and all(c.ok for c in found), [c.reason for c in found]
    fmt = WeightFormat.fp8_block(BLOCK, "float32", "bfloat16") if weights == "fp8" else WeightFormat("bfloat16")
    assert all(c.block.weight_format == fmt for c in found)
    g = torch.Generator().manual_seed(0)
    inputs = {c.path: [torch.randn(1, T, c.block.D, generator=g).bfloat16() for T in (1, 5, 33)] for c in found}
    with torch.inference_mode():
        want = {p: [block_out(model.get_submodule(p), x) for x in xs] for p, xs in inputs.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every block captured: nothing to say
            moetune.compile(model)
        assert len(plans(model)) == len(found)
        for p, xs in inputs.items():
            for x, ref in zip(xs, want[p], strict=True):
                assert worst_error(block_out(model.get_submodule(p), x), ref.float()) <= 1, (p, x.shape)
    moetune.uncompile(model)


@pytest.mark.parametrize("family", sorted(UNHOOKED))
def test_a_model_left_as_is_says_so_once_with_each_blocks_reason(family):
    model = build(family)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        moetune.compile(model)
    assert not plans(model)
    assert len(said) == 1, [str(w.message) for w in said]
    text = str(said[0].message)
    assert text.startswith(f"moetune.compile: no MoE block of {type(model).__name__} was captured")
    for path, block in moe_blocks(model):
        assert f"{path}" in text and type(block).__name__ in text and "no experts hook" in text
    moetune.uncompile(model)


def test_blocks_partly_captured_say_which_and_why_in_one_warning():
    model = build("qwen3_moe")
    model.model.layers[1].mlp.experts.has_gate = False
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        moetune.compile(model)
    assert len(plans(model)) == 1 and len(said) == 1, [str(w.message) for w in said]
    assert str(said[0].message) == (
        "moetune.compile: 1 of 2 MoE blocks of Qwen3MoeForCausalLM were not captured and run transformers' "
        "experts: model.layers.1.mlp (Qwen3MoeSparseMoeBlock): experts without a gate projection (has_gate=False, "
        "up_proj only) are not supported; left as is")
    moetune.uncompile(model)
