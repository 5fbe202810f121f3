"""bench/decode_step.py: every preset builds as its real model class with the asked number of MoE layers
(on the meta device: no memory), and a tiny model's step runs both ways with matching logits, in float32
and in bfloat16."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import decode_step  # noqa: E402

from moetune.ir.presets import PRESETS  # noqa: E402


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_with_its_moe_layers(name):
    model = decode_step.build_preset(name, layers=2, vocab=256, device="meta")
    experts = [m for n, m in model.named_modules() if n.endswith(".experts")]
    assert len(experts) == 2 and model.config.vocab_size == 256
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tiny_model_step_runs_both_ways(tmp_path, dtype):
    """moetune's step against transformers' experts on the same weights. float32: the two agree to
    accumulation order (experts off by 1 % fail). bfloat16: the weights run in float32 are the
    reference (transformers' bf16 step is measurably off it); moetune's step must be closer to
    transformers' than transformers' is to float32, and no further from float32 than transformers'
    plus a quarter (experts off by 5 % fail)."""
    rows = decode_step.main(["--family", "qwen3_moe", "--tokens", "1,2,8", "--reps", "2", "--dtype", dtype,
                             "--out", str(tmp_path)])
    assert [r["tokens"] for r in rows] == [1, 2, 8]
    for r in rows:
        assert r["transformers_us"] > 0 and r["moetune_us"] > 0
        if dtype == "float32":
            assert r["logits_rel_err"] < 1e-5, r
            continue
        bf16_vs_fp32 = r["transformers_rel_err_fp32"]
        assert bf16_vs_fp32 > 1e-4, r  # bf16 rounding shows: the reference is not the step itself
        assert r["logits_rel_err"] <= bf16_vs_fp32, r
        assert r["moetune_rel_err_fp32"] <= 1.25 * bf16_vs_fp32, r
    assert (tmp_path / "decode-step.json").exists()
