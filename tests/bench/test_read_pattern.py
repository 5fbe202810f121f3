"""bench/proto_read_pattern.py on the CPU (interpreted): every read pattern's kernel writes the sums torch takes of
the same elements (token, expert and linear patterns, a partial last chunk), so its H200 timings are of real reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import proto_read_pattern as R  # noqa: E402


def test_every_pattern_matches_torch(tmp_path):
    assert R.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "read_pattern.json").read_text())
    assert {r["variant"].split("-")[1] for r in rows} == {"token", "expert", "linear"}
    assert all(r["rel_err"] < 1e-4 and "error" not in r for r in rows)


def test_a_kernel_reading_another_expert_fails_the_check():
    """The check can fail: the expert kernel run on another expert's rows does not match the reference."""
    w = torch.randn(4, 16, 32).to(torch.bfloat16)
    ids = torch.tensor([[0, 2]])
    opts = dict(BN=8, BK=16, STAGES=2, num_warps=4)
    right = R.distinct_padded(ids, 2)
    wrong = torch.tensor([0, 3], dtype=torch.int32)
    ref = R.reference(w, "expert", opts, ids, right)
    for uniq, ok in ((right, True), (wrong, False)):
        out = R.build(w, "expert", 2, opts, {ids.data_ptr(): uniq})(None, ids, None, None)
        assert (((out - ref).norm() / ref.norm()) < 1e-4) == ok
