"""The command lives in moetune/cli/ alone: no argparse or `run(args)` in the layers below it, none of them
imports it, ir imports nothing from passes, and `moetune presets` pulls in neither Optuna nor Triton."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "moetune"
LAYERS = ("ir", "passes", "codegen", "runtime", "search")


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (PKG / f).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_no_command_line_code_below_the_cli(layer):
    for path in sources(layer):
        text = path.read_text()
        assert not re.search(r"^\s*(import argparse|from argparse)", text, re.M), path
        assert not re.search(r"^def run\(args", text, re.M), path
        assert not re.search(r"^\s*(from|import) (moetune\.cli|\.+cli)\b", text, re.M), path
        assert not re.search(r"^\s*from \.+ import [^\n]*\bcli\b", text, re.M), path


def test_ir_imports_nothing_from_passes():
    for path in sources("ir"):
        assert not re.search(r"(from|import) (moetune\.passes|\.\.passes)", path.read_text()), path


def test_the_targets_table_imports_only_the_ir():
    text = (PKG / "targets.py").read_text()
    imports = re.findall(r"^\s*from (\.+\w*|moetune\.\w+)", text, re.M)
    assert imports and all(m in (".ir", "moetune.ir") for m in imports), imports


def test_one_module_per_subcommand():
    from moetune.cli import COMMANDS, build_parser

    names = {m.__name__.rsplit(".", 1)[1] for m in COMMANDS}
    assert names == {"demo", "presets", "explain", "record", "tune", "bench", "show", "merge"}
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == names


def test_the_script_entry_is_the_cli_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"moetune": "moetune.cli:main"}
    from moetune.cli import main

    assert callable(main)


def test_presets_in_a_fresh_process_imports_neither_optuna_nor_triton():
    code = ("import sys; from moetune.cli import main; rc = main(['presets']); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('optuna', 'triton') "
            "or m.startswith('moetune.search')]; assert rc == 0 and not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr


def test_python_m_moetune_cli_runs():
    res = subprocess.run([sys.executable, "-m", "moetune.cli", "presets"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0 and "qwen3-30b-a3b" in res.stdout, res.stderr
