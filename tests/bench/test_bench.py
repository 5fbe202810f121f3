"""The benchmark harness on the CPU: `python -m bench` lists its suites and refuses a bad one in one line; the
kernels suite's candidates of a cell are points of the tuner's spaces; the committed table is what the suite
renders from the JSON beside it, and its footer's figures are computed from the records."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "nvidia-h200-kernels.json"
SUITES = ("kernels", "decode", "host", "dense", "tune", "jax", "readfloor", "router", "cpu")


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


def test_help_lists_every_suite_on_one_line_each():
    out = bench("--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for s in SUITES:
        assert sum(1 for line in lines if line.split()[:1] == [s]) == 1, out.stdout


def test_a_bad_suite_or_option_is_one_line_and_exit_2():
    out = bench("nope")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "nope" in out.stderr
    out = bench("kernels", "--no-such-option")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--no-such-option" in out.stderr


@pytest.mark.parametrize("suite", SUITES)
def test_every_suite_imports_and_has_help(suite):
    out = bench(suite, "--help")
    assert out.returncode == 0 and f"python -m bench {suite}" in out.stdout, out.stderr[-2000:]


def _h200_versions():
    """The versions the shipped H200 table's rows record, on this tree's kernel sources (as on the H200)."""
    from moetune.runtime.table import DispatchTable
    from moetune.runtime.versions import kernel_source_hash

    with DispatchTable(ROOT / "cache" / "h200.sqlite", create=False) as t:
        rows = t.entries(target="h200", backend="triton")
    return replace(rows[0].versions, kernel_hash=kernel_source_hash("triton"))


@pytest.mark.parametrize("shape,T", [("qwen3-30b-a3b", 1), ("mixtral-8x7b", 512)])
def test_the_kernels_candidates_of_a_cell_are_in_the_tuners_space(shape, T):
    pytest.importorskip("triton")
    pytest.importorskip("optuna")
    from bench import cells
    from bench import kernels as K

    block = cells.bench_block(shape)
    named = K.candidates(block, T, table=str(ROOT / "cache" / "h200.sqlite"), samples=3,
                         versions=_h200_versions())
    tags = [t for t, _ in named]
    assert tags[0] == "table" and tags.count("table") == 1, tags  # the shipped table covers every cell
    assert sum(t.startswith("space-") for t in tags) == 3, tags
    assert len({repr(s) for _, s in named}) == len(named)  # no schedule twice
    for tag, s in named:
        assert K.in_space(block, s) is None, (tag, K.in_space(block, s))


def test_with_a_knob_each_candidate_that_has_it_is_timed_again_with_it_set():
    """--with pdl=true: the FP8 GEMV and grouped GEMM candidates again with pdl on (tag TAG+pdl=True), each in
    the tuner's space; a kind without the knob (the hybrid), an expert-mode GEMV (refused) and a candidate that has it
    set already add none."""
    pytest.importorskip("triton")
    from bench import cells
    from bench import kernels as K

    block = cells.bench_block("qwen3-30b-a3b", "fp8")
    knobs = K.parse_with(["pdl=true"])
    assert knobs == [(("pdl", True),)] and K.parse_with(["down_nb=2", "down_mode=expert,pdl=false"]) == [
        (("down_nb", 2),), (("down_mode", "expert"), ("pdl", False))]
    for T in (1, 64):
        named = K.candidates(block, T, table=str(ROOT / "cache" / "h200.sqlite"), knobs=knobs,
                             versions=_h200_versions())
        plain = {(s.kind, t): s for t, s in named if "+" not in t}  # (a tag such as kind-default: one per kind)
        flipped = {(s.kind, t): s for t, s in named if "+" in t}
        for (kind, tag), s in flipped.items():
            base = plain[kind, tag.removesuffix("+pdl=True")]
            assert s.params.pdl and s.params == replace(base.params, pdl=True), tag
            assert K.in_space(block, s) is None, (tag, K.in_space(block, s))
        has = [(k, t) for (k, t), s in plain.items() if hasattr(s.params, "pdl") and not s.params.pdl
               and not (k == "stream_gemv" and s.params.down_mode != "token")]  # (refused: expert mode)
        assert sorted(flipped) == sorted((k, f"{t}+pdl=True") for k, t in has), (T, sorted(flipped))
        table_kind = "stream_gemv" if T == 1 else "grouped_gemm"  # (the GEMV's T = 64 default: expert mode)
        assert {k for k, _ in flipped} == {"stream_gemv", "grouped_gemm", "fused_gemv"} - (
            {"stream_gemv"} if T == 64 else set())
        table_pdl = plain[table_kind, "table"].params.pdl  # (whatever the shipped entry holds: set, no twin)
        assert ((table_kind, "table+pdl=True") in flipped) == (not table_pdl), sorted(flipped)
    with pytest.raises(ValueError, match="KNOB=VALUE"):
        K.parse_with(["pdl"])
    with pytest.raises(ValueError, match="KNOB=VALUE"):
        K.parse_with(["pdl=true,"])


@pytest.mark.parametrize("stem", ["nvidia-h200-kernels", "nvidia-h200-kernels-fp8"])
def test_each_committed_markdown_is_rendered_from_its_json(tmp_path, stem):
    """bf16 and FP8 runs alike: the committed .md is `--render` of the committed JSON (the FP8 one with its FP8
    targets and the committed bf16 times beside it)."""
    from bench import kernels_report

    src = RESULTS.with_name(f"{stem}.json")
    copy = tmp_path / src.name
    copy.write_text(src.read_text())
    assert kernels_report.render(str(copy)) == src.with_suffix(".md").read_text()
    if stem.endswith("fp8"):
        assert "65 % at T = 1, 85 % at T = 2–64, 70 % above" in src.with_suffix(".md").read_text()
        assert "against moetune's bf16 kernels" in src.with_suffix(".md").read_text()


def test_a_baseline_is_shown_with_its_error_and_how_it_was_timed():
    """The seeds' headline cell with transformers' FP8 grouped_mm timed: its column and the headline line carry
    its time, its error where it lies over the bound, and `host` where a CUDA graph could not hold it; the
    source of its kernel heads the table."""
    from bench import kernels_report

    d = json.loads(RESULTS.with_name("nvidia-h200-kernels-fp8.json").read_text())
    cell = [r for r in d["records"] if r["shape"] == "qwen3.5-397b-a17b" and r["tokens"] == 1]
    mine = min(r["time_us"] for r in cell if r["impl"].startswith("moetune") and "time_us" in r)
    base = dict(cell[0], impl="grouped_mm", variant="", schedule=None, time_us=4 * mine, mode="host",
                graph_error="RuntimeError: capture", rel_err=0.083, over_bound=True)
    base.pop("error", None)
    md = kernels_report.table([r for r in cell if r["impl"] != "grouped_mm"] + [base], d["ceilings"], "x", "fp8",
                 {"sha256": "0123456789abcdef", "version": 4})
    assert "local copy of its source (hub version 4, files sha256 0123456789abcdef)" in md
    row = next(line for line in md.splitlines() if line.startswith("| qwen3.5-397b-a17b | 1 |"))
    assert f"| {4 * mine:.1f} (rel_err 8.3e-02, host) |" in row
    assert (f"transformers' FP8 grouped_mm {4 * mine:.1f} µs (host-launched (RuntimeError: capture), rel_err "
            "8.3e-02): 4.00× faster.") in md


def test_the_footer_figures():
    from bench import kernels_report

    records = json.loads(RESULTS.read_text())
    best: dict = {}
    for r in records["records"]:
        if r["impl"].startswith("moetune") and "time_us" in r:
            k = (r["shape"], r["tokens"])
            if k not in best or r["time_us"] < best[k]["time_us"]:
                best[k] = r
    sp = [r["best_open_us"] / r["time_us"] for r in best.values()]
    gm = math.exp(sum(map(math.log, sp)) / len(sp))
    under = sum(1 for (s, t), r in best.items() if 100 * r["floor_us"] / r["time_us"] < kernels_report.target_pct(t))
    md = kernels_report.table(records["records"], records["ceilings"], "x")
    assert f"{len(best)} cells: speedup over the best open-source figure, geometric mean {gm:.3f}×" in md
    assert f"; {under} cells under their target" in md
    assert [kernels_report.target_pct(t) for t in (1, 2, 64, 128, 1024)] == [80.0, 85.0, 85.0, 75.0, 75.0]


def test_a_missing_or_corrupt_table_costs_the_table_candidate_only(tmp_path, capsys):
    import warnings

    from bench import cells
    from bench import kernels as K
    from moetune.runtime.table import CacheWarning

    assert K.table_choice("", cells.bench_block("mixtral-8x7b"), 512) == []
    with pytest.warns(CacheWarning, match="no such file"):
        assert K.table_choice(str(tmp_path / "none.sqlite"), cells.bench_block("mixtral-8x7b"), 512) == []
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"not a sqlite file" * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert K.table_choice(str(bad), cells.bench_block("mixtral-8x7b"), 512) == []
    assert "bad.sqlite" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_suite_runs_a_tiny_model_both_ways(tmp_path, dtype):
    """moetune's step against transformers' experts on the same weights. float32: the two agree to
    accumulation order. bfloat16: moetune's step is closer to transformers' than transformers' is to float32."""
    import argparse

    from bench import decode, decode_step

    ap = argparse.ArgumentParser()
    decode.add_arguments(ap)
    args = ap.parse_args(["--family", "qwen3_moe", "--tokens", "1,2", "--reps", "2", "--dtype", dtype,
                          "--out", str(tmp_path)])
    rows = decode_step.steps(args)
    assert [r["tokens"] for r in rows] == [1, 2]
    for r in rows:
        assert r["transformers_us"] > 0 and r["moetune_us"] > 0
        if dtype == "float32":
            assert r["logits_rel_err"] < 1e-5, r
        else:
            assert r["logits_rel_err"] <= r["transformers_rel_err_fp32"], r
    assert (tmp_path / "decode-step.json").exists()


def test_the_tune_suite_tunes_a_tiny_model_into_its_scratch_table(tmp_path):
    pytest.importorskip("optuna")
    out = bench("tune", "--tiny", "qwen3_moe", "--tokens", "1-2", "--budget", "5s", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "vs default" in out.stdout and "floor µs" in out.stdout
    assert (tmp_path / "qwen3_moe.sqlite").exists()


# A finegrained_fp8 package as the hub kernel's source tree lays it out (its `_ops` module is the hub build's, not in
# the source), its three entry points moetune.testing.fp8's dequantising ones, each call recorded.
_KERNEL_SOURCE = '''
from moetune.testing import fp8

from ._ops import add_op_namespace_prefix, ops

NAMESPACE = add_op_namespace_prefix("matmul_grouped")
CALLS = []


def _recorded(name):
    def call(*args, **kwargs):
        CALLS.append(name)
        return getattr(fp8, name)(*args, **kwargs)
    return call


matmul_2d, matmul_batched, matmul_grouped = map(_recorded, ("matmul_2d", "matmul_batched", "matmul_grouped"))
'''


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_transformers_fp8_experts_run_a_local_copy_of_the_hub_kernel(tmp_path, monkeypatch, impl):
    """--hf-fp8-kernel DIR: transformers' own FP8Experts (behind its FP8 experts hook) runs the kernel package found
    in DIR in place of the hub download, through the entry point of the implementation asked for, and its output
    is the float32 reference's on the dequantised weights; the record names the source by a digest of its files
    and the version its build.toml gives."""
    import torch
    from transformers.integrations import finegrained_fp8 as f8

    from bench import baselines
    from moetune.codegen.torch.tolerance import worst_error
    from moetune.ir import MoEBlock, WeightFormat
    from moetune.search.objective import expert_tensors, make_cases, reference

    (tmp_path / "torch-ext" / "finegrained_fp8").mkdir(parents=True)
    (tmp_path / "torch-ext" / "finegrained_fp8" / "__init__.py").write_text(_KERNEL_SOURCE)
    (tmp_path / "build.toml").write_text('[general]\nname = "finegrained-fp8"\nversion = 4\n')
    monkeypatch.setattr(f8, "_FINEGRAINED_FP8", None)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for mod in ("finegrained_fp8", "finegrained_fp8._ops"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    try:
        info = baselines.use_fp8_kernel_source(str(tmp_path / "torch-ext"))
        kernel = sys.modules["finegrained_fp8"]
        assert info["version"] == 4 and len(info["sha256"]) == 16
        assert kernel.NAMESPACE == "_finegrained_fp8_local::matmul_grouped"
        assert f8.load_finegrained_fp8_kernel().grouped_matmul is kernel.matmul_grouped
        block = MoEBlock(E=4, k=2, D=256, F=128, name="tiny").with_weight_format(WeightFormat.fp8_block())
        w = expert_tensors(block, torch.device("cpu"))
        case = make_cases(block, w, 5, 1, torch.Generator().manual_seed(3))[0]
        out = baselines.hf_fp8_fn(impl, w, block)(case.x, case.ids, case.weights, w)
        assert kernel.CALLS == [{"grouped_mm": "matmul_grouped", "batched_mm": "matmul_batched"}[impl]] * 2
        assert worst_error(out, reference(block, case)) <= 1
    finally:
        for mod in ("finegrained_fp8", "finegrained_fp8._ops"):
            sys.modules.pop(mod, None)


def test_a_folder_without_the_kernel_package_is_one_line_and_exit_2(tmp_path):
    out = bench("kernels", "--weights", "fp8", "--hf-fp8-kernel", str(tmp_path))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert str(tmp_path) in out.stderr and "finegrained_fp8/__init__.py" in out.stderr
