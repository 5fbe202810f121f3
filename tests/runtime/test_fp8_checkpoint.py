"""The real loading path of FP8 checkpoints: a tiny pre-quantised checkpoint in the published format
(moetune.testing.fp8.write_checkpoint), loaded by transformers, compiled by moetune.

On CPU transformers dequantises an FP8 checkpoint to bf16 on load (and needs accelerate to load it at all);
on a GPU it builds FP8Experts. transformers' own FP8Experts forward does not run on CPU: every path of it
(eager loop, grouped_mm, batched_mm) calls the finegrained-fp8 Triton kernel of the `kernels` hub package
(or DeepGEMM), which CPU has not; the CPU tests compare with it only where it runs.
"""

from __future__ import annotations

import copy
import json
import os
import warnings

import pytest
import torch

import moetune
from moetune.codegen.quant import dequantize_blocks
from moetune.codegen.tensors import ExpertTensors
from moetune.codegen.torch import experts_reference, worst_error
from moetune.ir import WeightFormat
from moetune.ir.capture import capture
from moetune.runtime import plans
from moetune.testing import VOCAB, fp8

FAMILIES = ["qwen3_moe", "mixtral"]
FP8_128 = WeightFormat.fp8_block((128, 128), "float32", "bfloat16")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family → (folder with every linear layer FP8, folder with only the experts FP8)."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[family] = (fp8.write_checkpoint(root / "all", family),
                           fp8.write_checkpoint(root / "experts", family, quantize_linears=False))
    return out


def input_ids(S: int = 7, B: int = 2, device="cpu") -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3)).to(device)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_is_in_the_published_format(checkpoints, family):
    from safetensors.torch import load_file

    folder = checkpoints[family][0]
    cfg = json.loads((folder / "config.json").read_text())
    q = cfg["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "fmt", "weight_block_size", "activation_scheme")} == {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    t = load_file(folder / "model.safetensors")
    moe = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    names = ("gate_proj", "up_proj", "down_proj") if family == "qwen3_moe" else ("w1", "w3", "w2")
    for n, shape in zip(names, ((128, 256), (128, 256), (256, 128)), strict=True):
        key = f"model.layers.1.{moe}.experts.7.{n}.weight"
        w, s = t[key], t[f"{key}_scale_inv"]
        assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == shape
        assert s.dtype == torch.float32 and tuple(s.shape) == (shape[0] // 128, shape[1] // 128)
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "lm_head" in q["modules_to_not_convert"]
    only = json.loads((checkpoints[family][1] / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in only["modules_to_not_convert"]


@pytest.mark.parametrize("family", FAMILIES)
def test_config_of_the_checkpoint_gives_fp8_blocks(checkpoints, family):
    from moetune.ir.config import block_from_config, load_config

    assert block_from_config(load_config(checkpoints[family][0])).weight_format == FP8_128


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_from_pretrained_dequantises_and_compiles(checkpoints, family, capsys):
    """Without a GPU transformers loads the FP8 checkpoint as bf16 experts (with a warning); moetune captures
    them as bf16 blocks, explain says why, and the compiled model's logits match the uncompiled model's."""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate installed")
    if torch.cuda.is_available():
        pytest.skip("with a GPU transformers keeps the checkpoint's FP8 experts (the GPU test's path)")
    import transformers

    folder = checkpoints[family][0]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    found = capture(model)
    assert found and all(c.ok and c.block.weight_format == WeightFormat("bfloat16") for c in found)
    moetune.explain(model)
    out = capsys.readouterr().out
    assert "is FP8" in out and "dequantized it to bfloat16 on load" in out
    ids = input_ids()
    with torch.inference_mode():
        want = model(input_ids=ids, use_cache=False).logits.float()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            moetune.compile(model)
        assert len(plans(model)) == len(found)
        got = model(input_ids=ids, use_cache=False).logits.float()
    assert ((got - want).abs().max() / want.abs().max()).item() <= 2e-2
    moetune.uncompile(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8experts_from_the_checkpoint_captured_compiled_and_checked(checkpoints, family):
    """transformers' FP8Experts, built from the checkpoint's real config and holding its FP8 tensors merged
    as transformers' loading merges them, is captured as fp8_block 128x128; compiled with the torch backend
    its output matches the float32 reference on the dequantised weights and transformers' bf16 experts on
    the same dequantised weights (bf16 tolerance), and transformers' own FP8 forward where that runs."""
    import transformers

    folder = checkpoints[family][0]
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.quantization_config["quant_method"] == "fp8"
    torch.manual_seed(0)
    bf16 = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16).eval()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.load_state_dict(bf16.state_dict())
    fp8.load_experts(model, folder)
    merged = fp8.checkpoint_experts(folder)
    with torch.no_grad():  # bf16 experts holding the dequantised checkpoint
        for path, t in merged.items():
            ex = bf16.get_submodule(path).experts
            ex.gate_up_proj.copy_(dequantize_blocks(t["gate_up_proj"], t["gate_up_proj_scale_inv"], (128, 128)))
            ex.down_proj.copy_(dequantize_blocks(t["down_proj"], t["down_proj_scale_inv"], (128, 128)))
    found = capture(model)
    assert [c.path for c in found] == sorted(merged) and all(c.ok for c in found), [c.reason for c in found]
    assert all(c.block.weight_format == FP8_128 and type(c.experts).__mro__[1].__name__ == "FP8Experts"
               for c in found)
    experts = {c.path: c.experts for c in found}
    g = torch.Generator().manual_seed(1)
    cases = []
    for c in found:
        b = c.block
        for T in (1, 5, 33):
            x = torch.randn(T, b.D, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(b.E, generator=g)[: b.k] for _ in range(T)])
            w = torch.softmax(torch.randn(T, b.k, generator=g), -1).to(getattr(torch, b.routing_weight_dtype))
            cases.append((c.path, b, x, ids, w))
    theirs = []
    for path, _, x, ids, w in cases:
        try:
            with torch.no_grad():
                theirs.append(experts[path](x, ids, w))  # transformers' own FP8 experts (its grouped_mm)
        except ImportError:  # the finegrained-fp8 kernel of the `kernels` hub package: not on CPU
            theirs.append(None)
    moetune.compile(model, backend="torch")
    assert len(plans(model)) == len(found)
    for (path, b, x, ids, w), tf in zip(cases, theirs, strict=True):
        out = experts[path](x, ids, w)
        assert worst_error(out, experts_reference(b, x, ids, w, ExpertTensors.of(experts[path]))) <= 1
        with torch.no_grad():
            assert worst_error(out, bf16.get_submodule(path).experts(x, ids, w).float()) <= 1
        if tf is not None:
            assert worst_error(out, tf.float(), a8=True) <= 1
    moetune.uncompile(model)


def block_from_config_of(folder):
    from moetune.ir.config import block_from_config, load_config

    return block_from_config(load_config(folder))


gpu = pytest.mark.skipif(
    not os.environ.get("MOETUNE_TEST_GPU") or not torch.cuda.is_available(),
    reason="loads the FP8 checkpoint into FP8Experts on CUDA: MOETUNE_TEST_GPU=1 on a GPU machine",
)


@gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_from_pretrained_fp8experts_compiled_with_triton(checkpoints, family, record_property):
    """On a GPU the checkpoint loads into FP8Experts (the checkpoint with only the experts FP8, so the rest of
    the model needs no FP8 linear kernel); moetune compiles it with the triton backend and the shipped
    table; a forward runs, matches the float32 reference on the dequantised weights and, where its
    finegrained-fp8 kernel loads, transformers' own FP8 experts (grouped_mm). Whether the table had entries
    for the FP8 block (a DispatchWarning when not) is recorded, not asserted.

        MOETUNE_TEST_GPU=1 python -m pytest tests/runtime/test_fp8_checkpoint.py -k gpu
    """
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate installed")
    import transformers

    from moetune.codegen.backend import get
    from moetune.runtime import DispatchWarning

    folder = checkpoints[family][1]
    why = get("triton").kinds(block_from_config_of(folder))
    if all(why.values()):
        pytest.skip(f"no triton kernel reads fp8_block weights in this tree: {why}")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="cuda", dtype=torch.bfloat16,
                                                              experts_implementation="grouped_mm").eval()
    found = capture(model)
    assert found and all(c.ok and c.block.weight_format == FP8_128 for c in found), [c.reason for c in found]
    ids = input_ids(device="cuda")
    c = found[-1]
    b, ex = c.block, c.experts
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(9, b.D, device="cuda", generator=g).bfloat16()
    sel = torch.stack([torch.randperm(b.E, device="cuda", generator=g)[: b.k] for _ in range(9)])
    w = torch.softmax(torch.randn(9, b.k, device="cuda", generator=g), -1).to(getattr(torch, b.routing_weight_dtype))
    try:
        with torch.inference_mode():
            theirs = ex(x, sel, w).float()
    except ImportError as e:  # the finegrained-fp8 kernel comes from the `kernels` hub: maybe not installed
        theirs = None
        record_property("transformers_fp8_experts", f"not run: {e}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moetune.compile(model, cache="cache/h200.sqlite", backend="triton")
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits
            out = ex(x, sel, w)
    record_property("dispatch_warnings", [str(m.message) for m in caught if issubclass(m.category, DispatchWarning)])
    assert len(plans(model)) == len(found) and torch.isfinite(logits).all()
    assert worst_error(out, experts_reference(b, x, sel, w, ExpertTensors.of(ex))) <= 1
    if theirs is not None:
        assert worst_error(out, theirs, a8=True) <= 1
    moetune.uncompile(model)
