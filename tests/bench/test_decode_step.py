"""bench/decode_step.py: every preset builds as its real model class with the asked number of MoE layers
(on the meta device: no memory), and a tiny model's step runs both ways with matching logits."""

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


def test_a_tiny_model_step_runs_both_ways(tmp_path):
    rows = decode_step.main(["--family", "qwen3_moe", "--tokens", "1,2", "--reps", "2", "--out", str(tmp_path)])
    assert [r["tokens"] for r in rows] == [1, 2]
    for r in rows:
        assert r["transformers_us"] > 0 and r["moetune_us"] > 0 and r["logits_rel_err"] < 1e-5
        # a float32 model: its float32 reference is itself, and moetune's step matches it
        assert r["transformers_rel_err_fp32"] == 0 and r["moetune_rel_err_fp32"] < 1e-5
    assert (tmp_path / "decode-step.json").exists()
