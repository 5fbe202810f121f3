"""`moetune presets` and `moetune explain`: a preset, a config.json, a model folder, the passes, a trace."""

import json

from moetune import testing as tm
from moetune.cli import main
from moetune.ir.presets import PRESETS, preset
from moetune.ir.trace import synthetic_trace


def test_presets_lists_every_preset_with_its_shape(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        b = preset(name)
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert line.split()[1:5] == [str(b.E), str(b.k), str(b.D), str(b.F)] and b.router.kind in line
    assert "MiB" in out


def test_explain_preset(capsys):
    assert main(["explain", "--preset", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(str(preset("qwen3-30b-a3b")))
    assert "MoE layers: 48 of 48 (0-47)" in out
    assert main(["explain", "--preset", "deepseek-v3"]) == 0
    assert "MoE layers: 58 of 61 (3-60)" in capsys.readouterr().out
    assert main(["explain", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_explain_config_and_model_dir(tmp_path, capsys):
    model = tm.build("deepseek_v3")
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    assert main(["explain", "--config", str(tmp_path / "config.json"), "--tokens", "1-256"]) == 0
    out = capsys.readouterr().out
    assert "E=16 k=4 D=64 F=40  T∈[1,256]" in out and "sigmoid_grouped_topk" in out
    assert main(["explain", "--model-dir", str(tmp_path)]) == 0
    assert "E=16 k=4 D=64 F=40" in capsys.readouterr().out
    missing = tmp_path / "missing"
    assert main(["explain", "--model-dir", str(missing)]) == 2
    assert capsys.readouterr().err == (f"moetune explain: --model-dir '{missing}': does not exist; "
                                       "expected a model folder holding config.json\n")
    assert main(["explain", "--config", str(missing / "config.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moetune explain: --config '{missing / 'config.json'}': no such file")


def test_explain_bad_config_names_the_file_the_field_and_the_value(tmp_path, capsys):
    cfg = tm.config("qwen3_moe").to_dict()
    cfg["hidden_act"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["explain", "--config", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "hidden_act" in err and "relu" in err and err.count("\n") == 1


def test_explain_passes(capsys):
    assert main(["explain", "--preset", "olmoe-1b-7b", "--passes", "--tokens", "1-64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(str(preset("olmoe-1b-7b").replace(T_max=64)))
    assert "== after bucketing" in out and "== after default_schedule" in out
    assert "ScheduledBlock(" not in out  # pass results are formatted, not dumped as reprs


def test_explain_notes_a_quantized_checkpoint(tmp_path, capsys):
    cfg = {**PRESETS["gpt-oss-120b"], "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["explain", "--model-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "quantized (quant_method 'mxfp4')" in out and "bfloat16 block" in out


def test_explain_an_fp8_checkpoint(tmp_path, capsys):
    """An FP8 config gives the fp8_block block; the note says how transformers loads it, not that it is left
    as it is; the floors are quoted at the FP8 peak."""
    assert main(["explain", "--preset", "qwen3-30b-a3b-fp8"]) == 0
    out = capsys.readouterr().out
    assert "float8_e4m3fn/fp8_block:128x128/float32/bfloat16" in out
    assert "FP8Experts" in out and "dequantizes the checkpoint to bf16" in out and "left" not in out
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["deepseek-v3-fp8"]))
    assert main(["explain", "--model-dir", str(tmp_path)]) == 0
    assert "fp8_block:128x128" in capsys.readouterr().out
    assert main(["explain", "--preset", "qwen3-30b-a3b-fp8", "--passes", "--tokens", "1-64",
                 "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "== after roofline" in out and "schedule: " in out


def test_explain_passes_of_an_fp8_preset_on_the_gpu_target(capsys):
    """With the target's own backend (triton on h200): its floors, and, where no triton kernel reads FP8
    blocks, a note that a compiled model leaves the block as it is, with backend-neutral defaults."""
    from moetune.codegen.backend import get

    assert main(["explain", "--preset", "qwen3-30b-a3b-fp8", "--passes", "--tokens", "1-64"]) == 0
    out = capsys.readouterr().out
    assert "== after roofline" in out and "floor " in out and "schedule: " in out
    no_fp8 = all(get("triton").kinds(preset("qwen3-30b-a3b-fp8")).values())
    assert ("backend triton runs none of its kernels on this block" in out) == no_fp8


def test_explain_states_the_accuracy_of_each_fp8_schedule(capsys):
    """Under each schedule of an FP8 block, what its result is checked to: w8a8 schedules name the activation
    groups and the looser bound, weight-only ones the dtype's; a bf16 block has no such line."""
    from moetune.codegen.torch.tolerance import accuracy

    assert main(["explain", "--preset", "qwen3.5-397b-a17b-fp8", "--passes", "--backend", "triton"]) == 0
    out = capsys.readouterr().out.split("== after ")[-1].splitlines()
    scheds = [(line, nxt) for line, nxt in zip(out, out[1:], strict=False) if line.startswith("      schedule: ")]
    assert scheds and all(nxt.startswith("      accuracy: ") for _, nxt in scheds)
    w8a8 = [nxt for line, nxt in scheds if "act_quant=fp8_1x128" in line]
    plain = [nxt for line, nxt in scheds if "act_quant=fp8_1x128" not in line]
    assert w8a8 and plain, out
    assert all("per 1x128 group (w8a8): checked to rtol" in n for n in w8a8)
    assert all(n.endswith(accuracy(None)) for n in plain)
    assert main(["explain", "--preset", "qwen3.5-397b-a17b", "--passes", "--backend", "triton"]) == 0
    assert "accuracy: " not in capsys.readouterr().out


def test_fp8_floor_at_the_fp8_peak():
    from moetune.passes.roofline import floor
    from moetune.targets import get_target

    b, q = preset("qwen3-30b-a3b"), preset("qwen3-30b-a3b-fp8")
    h200 = get_target("h200")
    assert floor(q, "h200", 4096).peak_flops == h200.fp8_flops > floor(b, "h200", 4096).peak_flops
    assert floor(q, "h200", 1).bytes < floor(b, "h200", 1).bytes


def test_explain_reads_a_trace_and_names_a_bad_one(tmp_path, capsys):
    good = synthetic_trace(128, 8, tokens=3000, zipf=1.0).save(tmp_path / "z.npz")
    assert main(["explain", "--preset", "qwen3-30b-a3b", "--passes", "--trace", str(good),
                 "--tokens", "1-64"]) == 0
    assert f"trace:{good}" in capsys.readouterr().out
    bad = tmp_path / "cut.npz"
    bad.write_bytes(good.read_bytes()[:200])
    assert main(["explain", "--preset", "qwen3-30b-a3b", "--passes", "--trace", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
    assert main(["explain", "--preset", "qwen3-30b-a3b", "--trace", str(tmp_path / "none.npz")]) == 2
    assert "--trace" in capsys.readouterr().err


def test_explain_bad_tokens_and_target(capsys):
    assert main(["explain", "--preset", "olmoe-1b-7b", "--tokens", "64-1"]) == 2
    assert capsys.readouterr().err == "moetune explain: --tokens '64-1': expected 1 ≤ LO ≤ HI\n"
    assert main(["explain", "--preset", "olmoe-1b-7b", "--passes", "--target", "tpu9"]) == 2
    assert "tpu9" in capsys.readouterr().err
