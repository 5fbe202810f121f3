"""What the README promises a newcomer runs: the main job, and the Python snippet of "Use" on a tiny model; and
the results it shows are the committed bench runs' own, cell for cell."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _block(marker: str) -> str:
    """The first fenced block after `marker`."""
    m = re.search(re.escape(marker) + r".*?```\w*\n(.*?)```", README, re.S)
    assert m, f"README has no fenced block after {marker!r}"
    return m.group(1)


def test_the_main_job_runs_and_its_logits_match(tmp_path):
    cmd = _block("<!-- ci: main command -->").strip()
    assert cmd.endswith("moetune demo"), cmd  # the job this test runs, past the install steps
    out = subprocess.run([sys.executable, "-m", "moetune.cli", "demo", "--cache", str(tmp_path / "demo.sqlite")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "logits match" in out.stdout and (tmp_path / "demo.sqlite").exists()


def test_the_use_snippet_runs_on_a_tiny_model(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from moetune import testing
    from moetune.runtime.compiled import describe

    snippet = _block("## Use")
    d = tmp_path / "tiny"
    testing.build("qwen3_moe").save_pretrained(d)
    ids = torch.randint(0, testing.VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    monkeypatch.chdir(tmp_path)  # the snippet's relative cache paths land here
    code = snippet.replace("from_pretrained(...)", "from_pretrained(d)")
    code = code.replace("budget_s=60", "budget_s=10")  # the same call, a shorter budget
    scope = {"AutoModelForCausalLM": AutoModelForCausalLM, "torch": torch, "d": d, "ids": ids}
    with torch.inference_mode(False), torch.no_grad():
        exec(compile(code, "README.md: Use", "exec"), scope)  # noqa: S102 - the README's own snippet
    model = scope["model"]
    assert "compiled by its first forward" in describe(model)
    want = AutoModelForCausalLM.from_pretrained(d)(input_ids=ids, use_cache=False).logits
    got = scope["ep"].module()(input_ids=ids, use_cache=False).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert (tmp_path / "cache" / "cpu.sqlite").exists()


@pytest.mark.parametrize("stem, weights", [("nvidia-h200-kernels", "bf16"), ("nvidia-h200-kernels-fp8", "fp8")])
def test_the_results_tables_are_the_committed_runs(stem, weights):
    """Each results table of the README is `bench.kernels_report.readme_table` of the committed run (what a
    compiled model runs per cell, its floor, the open-source figure; FP8 beside moetune's bf16), and the geometric
    mean and lowest speed-up the README quotes are that table's."""
    import json

    from bench import kernels_report

    records = json.loads((ROOT / "bench" / "results" / f"{stem}.json").read_text())["records"]
    rows = kernels_report.readme_table(records, weights)
    assert "\n".join(rows) in README, f"README's {weights} table is not the committed run's: {rows[2]} …"
    gm, low = kernels_report.table_speedups(records)
    quoted = (f"Geometric mean speed-up **{gm:.2f}×** (slowest cell {low:.3f}×)" if weights == "bf16"
              else f"**{gm:.2f}×** the strongest open-source FP8 MoE kernel on the geometric mean")
    assert quoted in " ".join(README.split()), quoted
    if weights == "fp8":
        assert f"lowest cell {low:.2f}×" in README



# the decode runs whose tokens/s table opens the README's results
DECODE_RUNS = ("nvidia-h100-80gb-hbm3-decode-qwen3-30b-a3b-fp8-full",)


def test_the_first_results_table_is_whole_models_decoding():
    """The README's first table is `bench.decode.readme_table` of the committed decode runs: tokens/s of whole
    models, before any table of one block."""
    from bench import decode

    table = decode.readme_table([ROOT / "bench" / "results" / f"{stem}.json" for stem in DECODE_RUNS])
    results = README[README.index("## Results"):]
    assert table in results, "README's decode table is not the committed runs'"
    first = next(line for line in results.splitlines() if line.startswith("|"))
    assert first == table.splitlines()[0]
