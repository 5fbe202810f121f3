"""Presets and `moetune.explain`."""


import pytest

import moetune
from moetune.ir import CaptureError, verify
from moetune.ir.presets import PRESETS, preset

# name → (E, k, D, F, router kind, shared F) of the published models (qwen3.5: D, F assumed)
PUBLISHED = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, "softmax_topk", None),
    "qwen3-235b-a22b": (128, 8, 4096, 1536, "softmax_topk", None),
    "qwen3.5-397b-a17b": (512, 10, 4096, 1024, "softmax_topk", 1024),
    "qwen3-next-80b-a3b": (512, 10, 2048, 512, "softmax_topk", 512),
    "deepseek-v3": (256, 8, 7168, 2048, "sigmoid_grouped_topk", 2048),
    "mixtral-8x7b": (8, 2, 4096, 14336, "softmax_topk", None),
    "gpt-oss-120b": (128, 4, 2880, 2880, "topk_softmax", None),
    "olmoe-1b-7b": (64, 8, 2048, 1024, "softmax_topk", None),
}


FP8 = ("qwen3.5-397b-a17b", "deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")  # published FP8 checkpoints


def test_preset_names():
    assert set(PRESETS) == set(PUBLISHED) | {f"{n}-fp8" for n in FP8}


@pytest.mark.parametrize("name", FP8)
def test_fp8_presets_are_the_bf16_block_in_fp8_blocks(name):
    """An -fp8 preset: the bf16 preset's block, its weights float8_e4m3fn with one float32 scale per
    128×128 block, activations bf16; a different signature (another dispatch key), half the expert bytes."""
    from moetune.ir import WeightFormat

    b, q = preset(name), preset(f"{name}-fp8")
    assert q.weight_format == WeightFormat.fp8_block((128, 128), "float32", "bfloat16")
    assert q == b.with_weight_format(q.weight_format).replace(name=q.name)
    assert q.signature() != b.signature()
    assert q.routing_weight_dtype == b.routing_weight_dtype
    assert q.weight_bytes_per_expert == pytest.approx(b.weight_bytes_per_expert / 2, rel=0.01)
    assert preset(f"{name}-fp8", dtype="float16").weight_format.compute_dtype == "float16"


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_builds_and_verifies(name):
    b = preset(name)
    assert verify(b) is b and b.name == name and b.weight_dtype == "bfloat16"
    E, k, D, F, kind, shared_F = PUBLISHED[name]
    assert (b.E, b.k, b.D, b.F, b.router.kind) == (E, k, D, F, kind)
    assert (b.shared.F if b.shared else None) == shared_F
    assert b.signature() and len(b.signature_hash()) == 16
    assert preset(name, dtype="float16").weight_dtype == "float16"


def test_preset_details():
    ds = preset("deepseek-v3").router
    assert (ds.n_group, ds.topk_group, ds.scaling, ds.score_bias, ds.renormalize) == (8, 4, 2.5, True, True)
    assert preset("deepseek-v3").routing_weight_dtype == "float32"
    assert preset("mixtral-8x7b").routing_weight_dtype == "float32"
    assert preset("olmoe-1b-7b").router.renormalize is False
    gpt = preset("gpt-oss-120b")
    assert gpt.activation.kind == "clamped_swiglu" and gpt.layout.transposed and gpt.layout.has_bias


def test_unknown_preset_lists_presets():
    with pytest.raises(CaptureError) as err:
        preset("qwen9")
    assert "qwen9" in str(err.value) and all(n in str(err.value) for n in PRESETS)


def test_explain_model(tiny, capsys):
    found = moetune.explain(tiny("qwen2_moe", "float32"))
    out = capsys.readouterr().out
    assert len(found) == 2 and all(c.ok for c in found)
    assert "2 MoE block(s) found, 2 captured" in out
    for c in found:
        assert c.path in out and str(c.block) in out
    assert moetune.explain(tiny("dbrx", "float32"), print_=False)[0].reason
    assert capsys.readouterr().out == ""


def test_explain_prints_reasons(tiny, capsys):
    found = moetune.explain(tiny("llama4", "float32"))
    out = capsys.readouterr().out
    assert "NOT captured" in out and found[0].reason in out
    assert moetune.capture(tiny("llama4", "float32"))[0].reason == found[0].reason







def test_format_scheduled_block():
    from moetune.ir import Bucket, CandidateSpace, Refusal, Roofline, RoutingStats, Schedule, ScheduledBlock
    from moetune.ir.explain import format_ir

    block = preset("olmoe-1b-7b").replace(T_max=8)
    floor = Roofline("h200", 1, bytes=4.8e6, flops=1e6, bandwidth=4.8e12, peak_flops=1e15)
    sb = ScheduledBlock(block, (
        Bucket(1, 2, RoutingStats(1, 8.0, 1.0, 1.0), floor, (CandidateSpace("stream_gemv"),),
               (Refusal("grouped_gemm", "grouped_gemm", "one row per expert"),), Schedule("stream_gemv")),
        Bucket(3, 8, candidates=(CandidateSpace("hybrid", row_thresholds=(4, 8)),),
               schedule=Schedule("hybrid", row_threshold=4)),
    ))
    text = format_ir(sb)
    assert text.splitlines()[0].startswith("ScheduledBlock olmoe-1b-7b") and "2 bucket(s)" in text
    assert "floor 1.0 µs memory-bound on h200" in text and "8.0 experts active" in text
    assert "refused grouped_gemm: one row per expert" in text and "hybrid(R∈[4, 8])" in text
    assert "schedule: hybrid(R=4)" in text
    assert format_ir(block) == str(block)
