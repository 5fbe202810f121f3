"""`moetune tune`'s user errors: each is one line on stderr naming the flag, its value and what was expected,
exit 2, and all of them are found before any tuning starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetune.cli import main

FAMILY = "qwen3_moe"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_tuning(monkeypatch):
    """Every case here must be refused before tune_block is called."""
    import moetune.search as study

    def refuse(*a, **k):
        raise AssertionError("tune_block was called")

    monkeypatch.setattr(study, "tune_block", refuse)


def refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "moetune tune: " not in out  # the header of a run that starts tuning
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


def tune(*extra: str, cache: Path | None = None) -> list[str]:
    return ["tune", "--tiny", FAMILY, "--tokens", "1-8", "--budget", "5s",
            *(["--cache", str(cache)] if cache else []), *extra]


def test_a_negative_time_limit_names_the_time_limit(tmp_path, capsys):
    err = refused(tune("--time-limit", "-1", cache=tmp_path / "t.sqlite"), capsys)
    assert err == "moetune tune: --time-limit '-1': expected a positive duration such as 90s, 10m"
    assert "--budget" not in err


@pytest.mark.parametrize("flag,value", [("--budget", "soon"), ("--budget", "0s"), ("--time-limit", "0"),
                                        ("--time-limit", "ten minutes")])
def test_bad_durations(flag, value, tmp_path, capsys):
    assert refused(tune(flag, value, cache=tmp_path / "t.sqlite"), capsys) == (
        f"moetune tune: {flag} '{value}': expected a positive duration such as 90s, 10m")


@pytest.mark.parametrize("value,why", [
    ("9", "expected every count inside --tokens 1-8 (outside: 9)"),
    ("3,0,12", "expected every count inside --tokens 1-8 (outside: 0, 12)"),
    ("five", "expected token counts separated by commas, such as 256,512"),
    ("4;5", "expected token counts separated by commas, such as 256,512"),
    (",", "expected at least one token count, such as 256,512"),
])
def test_every_at_tokens_error_exits_2(value, why, tmp_path, capsys):
    assert refused(tune("--at-tokens", value, cache=tmp_path / "t.sqlite"), capsys) == (
        f"moetune tune: --at-tokens '{value}': {why}")


@pytest.mark.parametrize("value,why", [("8-1", "expected 1 ≤ LO ≤ HI"), ("0-4", "expected 1 ≤ LO ≤ HI"),
                                       ("all", "expected a token range LO-HI such as 1-1024, or one count")])
def test_bad_token_ranges(value, why, tmp_path, capsys):
    argv = ["tune", "--tiny", FAMILY, "--tokens", value, "--cache", str(tmp_path / "t.sqlite")]
    assert refused(argv, capsys) == f"moetune tune: --tokens '{value}': {why}"


def test_an_unwritable_cache_is_refused_before_tuning(tmp_path, capsys):
    cache = "/proc/moetune-none/t.sqlite"
    err = refused(tune(cache=Path(cache)), capsys)
    assert err.startswith(f"moetune tune: --cache '{cache}': cannot be written (")
    assert err.endswith("expected a file in a writable folder")
    from moetune.runtime.versions import target_of

    # a folder names its <target>.sqlite (as moetune.compile reads it); here that is a folder too
    held = tmp_path / f"{target_of('cuda' if torch.cuda.is_available() else 'cpu')}.sqlite"
    held.mkdir()
    err = refused(tune(cache=tmp_path), capsys)
    assert err == f"moetune tune: --cache '{held}': is a folder; expected a file to write"
    assert os.listdir(tmp_path) == [held.name] and os.listdir(held) == []  # the check leaves nothing behind


def test_a_read_only_cache_file_is_refused_before_tuning(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes read-only files")
    cache = tmp_path / "t.sqlite"
    cache.write_bytes(b"")
    cache.chmod(0o444)
    assert refused(tune(cache=cache), capsys).startswith(f"moetune tune: --cache '{cache}': cannot be written")


def test_triton_without_a_gpu_is_unavailable_not_a_traceback(monkeypatch, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: triton is usable here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the check a user's machine runs
    err = refused(tune("--backend", "triton", cache=tmp_path / "t.sqlite"), capsys)
    assert err.startswith("moetune tune: --backend 'triton': ") and err.endswith("expected --backend torch on "
                                                                                 "this machine")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # interpreted kernels run, but tuning times them on a GPU
    err = refused(tune("--backend", "triton", cache=tmp_path / "t.sqlite"), capsys)
    assert "needs" in err or "CUDA" in err


def test_triton_without_a_gpu_in_a_fresh_process(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: triton is usable here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-m", "moetune.cli", *tune("--backend", "triton",
                                                                      cache=tmp_path / "t.sqlite")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("moetune tune: --backend 'triton': ")
    assert "Traceback" not in res.stderr and res.stdout == ""


@pytest.mark.parametrize("flag,value,why", [
    ("--backend", "pallas9", "unknown; expected torch or triton"),
    ("--target", "tpu9", "unknown; expected one of"),
    ("--space-cap", "0", "expected a whole number ≥ 1"),
    ("--trace", "/nonexistent/t.npz", "no such file; expected a routing trace from `moetune record`"),
])
def test_other_bad_values(flag, value, why, tmp_path, capsys):
    err = refused(tune(flag, value, cache=tmp_path / "t.sqlite"), capsys)
    assert err.startswith(f"moetune tune: {flag} '{value}': {why}")


def test_a_missing_config_names_the_flag(tmp_path, capsys):
    err = refused(["tune", "--config", str(tmp_path / "c.json"), "--cache", str(tmp_path / "t.sqlite")], capsys)
    assert err == f"moetune tune: --config '{tmp_path / 'c.json'}': no such file; expected a HuggingFace config.json"


def test_an_unknown_tiny_family(tmp_path, capsys):
    err = refused(["tune", "--tiny", "nope", "--cache", str(tmp_path / "t.sqlite")], capsys)
    assert err.startswith("moetune tune: --tiny 'nope': unknown tiny family; expected one of ")


@pytest.mark.parametrize("argv,want", [
    (["tune"], "moetune: tune: one of the arguments --preset --config --model-dir --tiny is required"),
    (["tune", "--tiny", FAMILY, "--preset", "qwen3-30b-a3b"],
     "moetune: tune: argument --preset: not allowed with argument --tiny"),
    (["tune", "--tiny", FAMILY, "--dtype", "int8"], "moetune: tune: argument --dtype: invalid choice: 'int8'"),
    (["tune", "--tiny", FAMILY, "--seed", "x"], "moetune: tune: argument --seed: invalid int value: 'x'"),
    (["tune", "--tiny", FAMILY, "--bogus"], "moetune: tune: unrecognized arguments: --bogus"),
    (["retune"], "moetune: argument COMMAND: invalid choice: 'retune'"),
    ([], "moetune: the following arguments are required: COMMAND"),
])
def test_argparse_errors_are_one_line_and_exit_2(argv, want, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(want), err


def test_help_still_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", "--help"])
    assert e.value.code == 0 and "--time-limit" in capsys.readouterr().out


@pytest.mark.parametrize("value,why", [("0,0", "a device is named twice"),
                                       ("gpu0", "expected device indices, e.g. 0,1"),
                                       ("", "expected device indices, e.g. 0,1")])
def test_bad_devices(value, why, tmp_path, capsys):
    assert refused(tune("--devices", value, cache=tmp_path / "t.sqlite"), capsys) == (
        f"moetune tune: --devices '{value}': {why}")


def test_a_bad_routing_or_one_with_a_trace_exits_2(tmp_path, capsys):
    assert refused(tune("--routing", "zipf:-1", cache=tmp_path / "t.sqlite"), capsys) == (
        "moetune tune: --routing 'zipf:-1': expected uniform, zipf:S (S > 0, e.g. zipf:1.0), hot (one expert in "
        "half the tokens) or trace:FILE")
    trace = tmp_path / "r.npz"
    trace.write_bytes(b"")
    assert refused(tune("--routing", "hot", "--trace", str(trace), cache=tmp_path / "t.sqlite"), capsys) == (
        "moetune tune: --routing 'hot': not with --trace (--routing trace:FILE is --trace FILE)")
