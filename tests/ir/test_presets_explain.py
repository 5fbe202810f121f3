"""Presets, `moetune.explain` and the `explain` / `presets` commands."""

import json

import pytest

import moetune
from moetune import testing as tm
from moetune.cli import main
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


def test_preset_names():
    assert set(PRESETS) == set(PUBLISHED)


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


def test_cli_presets(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name, (E, k, D, F, kind, _) in PUBLISHED.items():
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert line.split()[1:5] == [str(E), str(k), str(D), str(F)] and kind in line
    assert "MiB" in out


def test_cli_explain_preset(capsys):
    assert main(["explain", "--preset", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(str(preset("qwen3-30b-a3b")))
    assert "MoE layers: 48 of 48 (0-47)" in out
    assert main(["explain", "--preset", "deepseek-v3"]) == 0
    assert "MoE layers: 58 of 61 (3-60)" in capsys.readouterr().out
    assert main(["explain", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_cli_explain_config_and_model_dir(tiny, tmp_path, capsys):
    model = tiny("deepseek_v3", "bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    assert main(["explain", "--config", str(tmp_path / "config.json"), "--tokens", "1-256"]) == 0
    out = capsys.readouterr().out
    assert "E=16 k=4 D=64 F=40  T∈[1,256]" in out and "sigmoid_grouped_topk" in out
    assert main(["explain", "--model-dir", str(tmp_path)]) == 0
    assert "E=16 k=4 D=64 F=40" in capsys.readouterr().out
    assert main(["explain", "--model-dir", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_explain_bad_config(tmp_path, capsys):
    cfg = json.loads(json.dumps(tm.config("qwen3_moe").to_dict()))
    cfg["hidden_act"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["explain", "--config", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "hidden_act" in err and "relu" in err


def test_cli_explain_passes(capsys):
    assert main(["explain", "--preset", "olmoe-1b-7b", "--passes", "--tokens", "1-64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(str(preset("olmoe-1b-7b").replace(T_max=64)))
    assert "== after" in out or "not part of this build yet" in out
    assert "ScheduledBlock(" not in out  # pass results are formatted, not dumped as reprs


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


def test_cli_explain_notes_quantized_checkpoint(tmp_path, capsys):
    from moetune.ir.presets import PRESETS

    cfg = {**PRESETS["deepseek-v3"], "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["explain", "--model-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "quantized (quant_method 'fp8')" in out and "bfloat16 block" in out
