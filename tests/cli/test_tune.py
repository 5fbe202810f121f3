"""`moetune tune` end to end on CPU: a tiny model's block tuned with the torch backend into a table that
`moetune show` lists and that a compiled tiny model uses, with the same logits as the original."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from moetune.cli import main as cli_main
from moetune.cli.common import parse_duration, parse_tokens, tiny_block
from moetune.runtime.table import CacheWarning, DispatchTable, load_entries

FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    path = tmp_path_factory.mktemp("tune") / "cpu-tiny.sqlite"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(["tune", "--tiny", FAMILY, "--tokens", "1-8", "--budget", "12s", "--cache", str(path)])
    return rc, out.getvalue(), path


def test_tune_prints_a_line_per_bucket_and_the_final_table(tuned):
    rc, out, path = tuned
    assert rc == 0, out
    assert out.splitlines()[-1].startswith("exit status 0: the tune ran; ")
    block = tiny_block(FAMILY)
    assert block.signature_hash() in out and "cpu:" in out  # the block and the device are named
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.strip().startswith("bucket"))
    rows = [ln for ln in lines[header + 2:] if ln.strip().startswith("[")]
    progress = [ln for ln in lines[:header] if "] bucket [" in ln]
    assert len(rows) == len(progress) >= 3
    for ln in rows:
        assert "%" in ln and "×" in ln
    assert "device: cpu:" in out and "transformers:grouped_mm" in out
    # each bucket's final round: the winner (with its times at the bucket's edges) and the others re-timed
    winners = [ln for ln in lines if ln.strip().startswith("winner ")]
    assert winners and all(" µs" in ln and ("grouped_gemm" in ln or "stream_gemv" in ln or "hybrid" in ln)
                           for ln in winners)
    assert any(" at T=" in ln for ln in winners)


def _buckets(out: str) -> dict[tuple[int, int], bool]:
    """Each bucket of the progress lines, and whether its default was kept (its winner within the spread)."""
    import re

    found = {}
    for ln in out.splitlines():
        m = re.search(r"\] bucket \[(\d+),(\d+)\]", ln)
        if m:
            found[(int(m[1]), int(m[2]))] = "kept the default" in ln
    return found


def test_the_table_holds_every_bucket_and_the_runtime_reads_it(tuned):
    """Every bucket has its entry: its winner, which beat the default by more than the spread, or the default
    itself, which the bucket kept (its line says so, with the numbers): together they cover the range,
    without a gap or an overlap."""
    _, out, path = tuned
    block = tiny_block(FAMILY)
    with DispatchTable(path, create=False) as t:
        rows = t.entries("cpu", "torch", block.signature_hash())
    spans = [(e.bucket_lo, e.bucket_hi) for e in rows]
    buckets = _buckets(out)
    assert spans == sorted(buckets)
    every = sorted(buckets)
    assert every[0][0] == 1 and every[-1][1] == 8
    assert all(b[0] == a[1] + 1 for a, b in zip(every, every[1:], strict=False))  # no gap, no overlap
    for e in rows:
        assert e.time_us > 0 and e.floor_us > 0 and e.default_time_us > 0 and e.baseline_time_us > 0
        assert e.pct_of_floor == pytest.approx(100 * e.floor_us / e.time_us)
        assert e.timer.startswith("cpu:") and e.versions.device.startswith("cpu:")
        if buckets[(e.bucket_lo, e.bucket_hi)]:  # the default kept: its own entry
            assert e.time_us == e.default_time_us
        else:
            assert e.spread_us is not None and e.default_time_us - e.time_us > e.spread_us
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        got = load_entries(path, block, "cpu", "torch")
    assert [(lo, hi) for lo, hi, _ in got] == spans


def test_resume_keeps_every_current_bucket(tuned, capsys, tmp_path):
    import shutil

    rc, _, tuned_path = tuned
    path = tmp_path / "copy.sqlite"  # the re-tune of a bucket left to the default may write it
    shutil.copy(tuned_path, path)
    with DispatchTable(path, create=False) as t:
        stored = {e.bucket for e in t.entries()}
    assert cli_main(["tune", "--tiny", FAMILY, "--tokens", "1-8", "--budget", "12s", "--cache", str(path),
                     "--resume", "--time-limit", "1m"]) == 0
    out = capsys.readouterr().out
    progress = [ln for ln in out.splitlines() if "] bucket [" in ln]
    assert progress and stored
    for (lo, hi), ln in zip(sorted(_buckets(out)), progress, strict=True):  # every bucket has its entry: kept
        assert ("kept: current table entry" in ln) == ((lo, hi) in stored)
    assert stored == set(_buckets(out))


def test_at_tokens_retunes_only_the_buckets_holding_them(tuned, capsys, tmp_path):
    import shutil

    _, tuned_out, path = tuned
    copy = tmp_path / "copy.sqlite"
    shutil.copy(path, copy)
    hit = next(b for b in _buckets(tuned_out) if b[0] <= 5 <= b[1])  # its entry's, or its default's
    assert cli_main(["tune", "--tiny", FAMILY, "--tokens", "1-8", "--budget", "6s", "--cache", str(copy),
                     "--at-tokens", "5"]) == 0
    out = capsys.readouterr().out
    progress = [ln for ln in out.splitlines() if "] bucket [" in ln]
    assert len(progress) == 1 and f"bucket [{hit[0]},{hit[1]}]" in progress[0]  # current, yet re-tuned
    assert "kept:" not in progress[0]


def test_show_lists_the_tuned_table_with_every_parameter_whole(tuned, capsys):
    _, _, path = tuned
    assert cli_main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "target cpu  backend torch" in out and "% floor" in out
    with DispatchTable(path, create=False) as t:
        entries = t.entries()
    lines = out.splitlines()
    for e in entries:
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(f"[{e.bucket_lo},{e.bucket_hi}]"))
        assert e.kind in lines[i]
        params = json.loads(e.params)
        assert lines[i + 1].strip() == ", ".join(f"{k}={v}" for k, v in params.items())


def test_the_final_table_prints_every_winner_parameter_whole(tuned):
    _, out, _ = tuned
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.strip().startswith("bucket"))
    rows = [i for i, ln in enumerate(lines) if i > header and ln.strip().startswith("[")]
    winners = [ln.split(": ", 1)[1] for ln in lines if ln.strip().startswith("winner ")]
    params = [lines[i + 1].strip() for i in rows]
    assert all(p and "=" in p and not p.startswith("[") for p in params)
    for w in winners:  # the progress lines' full schedules: each one's parameters appear whole in the table
        assert w.split(" [", 1)[1].rstrip("]") in params


def test_a_compiled_tiny_model_with_the_tuned_table_gives_the_same_logits(tuned):
    _, _, path = tuned
    from moetune.runtime import compile as mt_compile
    from moetune.runtime import uncompile
    from moetune.testing import build

    model = build(FAMILY)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model(input_ids=ids, use_cache=False).logits.float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # buckets above the tuned range fall back to the default, once
        mt_compile(model, cache=str(path), backend="torch", T_max=8)
    try:
        from moetune.runtime import plans

        ps = plans(model)
        assert ps, "no block was compiled"
        with DispatchTable(path, create=False) as t:
            stored = {e.bucket for e in t.entries()}
        for p in ps:  # every bucket with an entry runs the table's schedule, the others the default
            tuned = {(r.lo, r.hi): r.source for r in p.dispatcher.routes if r.hi <= 8}
            assert tuned and all((s == "table") == (b in stored) for b, s in tuned.items())
        with torch.inference_mode():
            got = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        uncompile(model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tune_from_a_skewed_trace(tmp_path, capsys):
    from moetune.ir.trace import synthetic_trace

    block = tiny_block(FAMILY)
    trace = synthetic_trace(block.E, block.k, tokens=512, zipf=1.5).save(tmp_path / "skewed")
    path = tmp_path / "t.sqlite"
    rc = cli_main(["tune", "--tiny", FAMILY, "--tokens", "1-4", "--budget", "4s", "--cache", str(path),
                   "--trace", str(trace)])
    assert rc == 0
    buckets = _buckets(capsys.readouterr().out)  # the trace's buckets up to T = 4: the table's, or the default's
    assert max(hi for _, hi in buckets) == 4
    with DispatchTable(path, create=False) as t:
        assert [e.bucket for e in t.entries()] == sorted(buckets)  # a winner's entry, or the kept default's


def test_tune_from_a_config_file(tmp_path, capsys):
    import json

    cfg = {"model_type": "qwen3_moe", "hidden_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 24, "norm_topk_prob": True, "hidden_act": "silu", "dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    path = tmp_path / "t.sqlite"
    rc = cli_main(["tune", "--config", str(tmp_path / "config.json"), "--tokens", "1-2", "--budget", "4s",
                   "--cache", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "E=8 k=2 D=48 F=24" in out
    with DispatchTable(path, create=False) as t:
        assert {e.signature_text for e in t.entries()} == {next(ln.strip() for ln in out.splitlines()
                                                                 if ln.strip().startswith("moe/v1"))}


def test_a_foreign_trace_is_an_error_naming_it(tmp_path, capsys):
    from moetune.ir.trace import synthetic_trace

    trace = synthetic_trace(8, 2, tokens=64).save(tmp_path / "other")  # another E and k
    rc = cli_main(["tune", "--tiny", FAMILY, "--tokens", "1-2", "--budget", "2s", "--cache",
                   str(tmp_path / "t.sqlite"), "--trace", str(trace)])
    assert rc == 2 and "E=8" in capsys.readouterr().err


PARSE_CASES = [("1-1024", (1, 1024)), ("8", (8, 8)), (" 2 - 16 ", (2, 16))]


@pytest.mark.parametrize("text,want", PARSE_CASES)
def test_parse_tokens(text, want):
    assert parse_tokens(text) == want


@pytest.mark.parametrize("text,want", [("90s", 90), ("10m", 600), ("1.5h", 5400), ("45", 45), ("2min", 120)])
def test_parse_duration(text, want):
    assert parse_duration(text, "--budget") == want
