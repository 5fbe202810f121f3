"""moetune.compile on FP8 experts (transformers' FP8Experts behind its FP8 experts hook), on CPU with the
torch kernels: the hook, the float32 reference on the dequantised weights, the tensors read in place, the
refused blocks, export, and FP8 and bf16 blocks of one shape under different table keys."""

from __future__ import annotations

import warnings

import pytest
import torch

import moetune
from moetune.codegen.quant import dequantize_blocks
from moetune.codegen.tensors import ExpertTensors
from moetune.codegen.torch import experts_reference, worst_error
from moetune.ir import WeightFormat
from moetune.runtime import PLANS, experts_forward, plans
from moetune.testing import VOCAB, build, fp8

BLOCK = (8, 8)  # divides the tiny models' D = 64 and F = 40


def input_ids(S: int, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def fp8_model(family="qwen3_moe", scale_dtype="float32", dtype=torch.bfloat16):
    return fp8.to_fp8(build(family, dtype=dtype), BLOCK, scale_dtype)


def dequantized_twin(model_fp8, family="qwen3_moe", dtype=torch.bfloat16):
    """The same model with bf16 experts holding the FP8 experts' dequantised weights (transformers' own)."""
    twin = build(family, dtype=dtype)
    fp8_mods = dict(model_fp8.named_modules())
    with torch.no_grad():
        for name, mod in twin.named_modules():
            if "experts" in mod._modules and hasattr(mod.experts, "gate_up_proj"):
                q = fp8_mods[name].experts
                mod.experts.gate_up_proj.copy_(dequantize_blocks(q.gate_up_proj, q.gate_up_proj_scale_inv, BLOCK))
                mod.experts.down_proj.copy_(dequantize_blocks(q.down_proj, q.down_proj_scale_inv, BLOCK))
    return twin


def test_moetune_is_registered_in_the_fp8_experts_interface():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_FP8_EXPERTS_FUNCTIONS["moetune"] is experts_forward is ALL_EXPERTS_FUNCTIONS["moetune"]


@pytest.mark.parametrize("scale_dtype", ["float32", "ue8m0"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_compiled_fp8_experts_match_the_reference(family, scale_dtype):
    """Every FP8Experts call goes through moetune's plan (FP8 experts hook) and matches the float32
    reference on the dequantised weights within bf16's tolerance, at decode and prefill sizes."""
    model = fp8_model(family, scale_dtype)
    moetune.compile(model)
    ps = plans(model)
    assert ps and all(p.block.weight_format == WeightFormat.fp8_block(BLOCK, scale_dtype, "bfloat16") for p in ps)
    assert model.config._experts_implementation == "moetune"
    ex = [m for m in model.modules() if getattr(m, "_moetune_plan", None) is not None]
    g = torch.Generator().manual_seed(0)
    for T in (1, 3, 40):
        for m in ex:
            b = m._moetune_plan.block
            x = torch.randn(T, b.D, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(b.E, generator=g)[: b.k] for _ in range(T)])
            w = torch.softmax(torch.randn(T, b.k, generator=g), -1).to(getattr(torch, b.routing_weight_dtype))
            out = m(x, ids, w)
            assert out.dtype == torch.bfloat16
            assert worst_error(out, experts_reference(b, x, ids, w, ExpertTensors.of(m))) <= 1
    moetune.uncompile(model)
    assert not plans(model) and model.config._experts_implementation != "moetune"


def test_compiled_fp8_model_matches_its_dequantised_bf16_twin():
    model = fp8_model()
    twin = dequantized_twin(model)
    moetune.compile(model)
    ids = input_ids(9)
    got, want = logits(model, ids), logits(twin, ids)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 3e-2


def test_weights_read_in_place():
    """Compiling keeps the FP8 parameters as they are (same storage, float8_e4m3fn, scales beside them), and
    the kernels read them at call time: a changed scale changes the next call."""
    model = fp8_model()
    ex = model.model.layers[0].mlp.experts
    before = {n: (p.data_ptr(), p.dtype) for n, p in ex.named_parameters()}
    moetune.compile(model)
    assert {n: (p.data_ptr(), p.dtype) for n, p in ex.named_parameters()} == before
    assert ex.gate_up_proj.dtype == torch.float8_e4m3fn
    b = ex._moetune_plan.block
    x = torch.randn(4, b.D).bfloat16()
    ids = torch.tensor([[0, 1, 2, 3]] * 4)
    w = torch.full((4, 4), 0.25).bfloat16()
    y1 = ex(x, ids, w)
    with torch.no_grad():
        ex.down_proj_scale_inv.mul_(2)
    assert worst_error(ex(x, ids, w), 2 * y1.float()) <= 1


def test_refused_fp8_block_keeps_transformers_fp8_experts():
    """A block capture refuses (static activation scales) stays on transformers' FP8 grouped_mm; the other
    layer runs moetune; neither recompiles on its first call."""
    from transformers.integrations.finegrained_fp8 import fp8_grouped_mm_experts_forward

    from moetune.runtime.compiled import _transformers_grouped_mm

    model = fp8_model()
    refused = model.model.layers[0].mlp.experts
    refused.activation_scheme = "static"
    moetune.compile(model)
    assert [p.path for p in plans(model)] == ["model.layers.1.mlp"]
    assert "activation_scheme='static'" in refused._moetune_left
    assert _transformers_grouped_mm(refused) is fp8_grouped_mm_experts_forward
    moetune.uncompile(model)
    assert getattr(refused, "_moetune_left", None) is None


def test_explain_of_an_fp8_model(capsys):
    found = moetune.explain(fp8_model())
    out = capsys.readouterr().out
    assert all(c.ok for c in found) and "fp8_block:8x8/float32/bfloat16" in out


def test_export_keeps_one_op_per_fp8_layer():
    model = moetune.compile(fp8_model())
    ids = input_ids(9, B=1)
    S = torch.export.Dim("S", min=2, max=64)
    ep = torch.export.export(model, (), {"input_ids": ids, "use_cache": False},
                             dynamic_shapes={"input_ids": {1: S}, "use_cache": None})
    ops = [n for n in ep.graph.nodes if n.op == "call_function" and "moetune.experts" in str(n.target)]
    assert len(ops) == 2
    other = input_ids(5, B=1, seed=7)
    with torch.inference_mode():
        got = ep.module()(input_ids=other, use_cache=False).logits.float()
    assert torch.allclose(got, logits(model, other), rtol=1e-3, atol=1e-3)
    ids_of_plans = {p.id for p in plans(model)}
    assert ids_of_plans <= set(PLANS)


def test_fp8_and_bf16_blocks_of_one_shape_are_different_table_keys(tmp_path):
    """A table tuned for the bf16 block serves nothing to its FP8 twin (and the other way round)."""
    from moetune.codegen.torch import BACKEND as TORCH
    from moetune.runtime.entry import DispatchEntry
    from moetune.runtime.table import DispatchTable
    from moetune.runtime.versions import Versions

    bf16 = moetune.explain(build("qwen3_moe", dtype=torch.bfloat16), print_=False)[0].block
    q = moetune.explain(fp8_model(), print_=False)[0].block
    assert q.signature_hash() != bf16.signature_hash() and (q.E, q.k, q.D, q.F) == (bf16.E, bf16.k, bf16.D, bf16.F)
    here = Versions.current("torch", "cpu")
    with DispatchTable(tmp_path / "t.sqlite") as t:
        for blk, kind in ((bf16, "stream_gemv"), (q, "grouped_gemm")):
            t.put(DispatchEntry.of(target="cpu", block=blk, bucket=(1, 4096), schedule=TORCH.default(blk, kind, 4),
                                   time_us=1.0, versions=here))
        got_bf16 = t.lookup(bf16, "cpu", "torch").usable
        got_q = t.lookup(q, "cpu", "torch").usable
    assert [u[2].kind for u in got_bf16] == ["stream_gemv"] and [u[2].kind for u in got_q] == ["grouped_gemm"]


def test_a_backend_without_fp8_kernels_leaves_the_fp8_blocks_with_the_reason():
    """Compiling with a backend none of whose kernels reads fp8_block weights does not fail: those blocks
    stay on transformers' FP8 experts, each with the backend's refusals as its reason."""
    import dataclasses

    from moetune.codegen.backend import register
    from moetune.codegen.contract import KernelBackend
    from moetune.codegen.torch import TorchBackend

    class UnquantisedOnly(KernelBackend):
        name = "unquantised-only"
        library = "torch"
        KINDS = tuple(dataclasses.replace(k, formats=("none",)) for k in TorchBackend.KINDS)
        TARGET = "cpu"

    register(UnquantisedOnly())
    model = fp8_model()
    with pytest.warns(UserWarning, match="no MoE block"):
        moetune.compile(model, backend="unquantised-only")
    assert not plans(model)
    for c in model._moetune_state.captured:
        assert c.block is None and "backend unquantised-only runs none of its kernels" in c.reason
        assert "fp8_block" in c.reason and c.experts._moetune_left == c.reason
    assert "left as is" in moetune.runtime.describe(model)
    moetune.uncompile(model)
