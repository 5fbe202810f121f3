"""The H200 scripts in bench/ are spent on scarce device time: check here that each parses as bash, and
that every option it passes to `moetune tune`, bench/kernels.py or bench/grid_vs_tpe.py
exists in that command's --help."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "bench").glob("*.sh"))
COMMANDS = {  # how a script calls it → the argv that prints its options
    "moetune.cli tune": [sys.executable, "-m", "moetune.cli", "tune", "--help"],
    "moetune.cli show": [sys.executable, "-m", "moetune.cli", "show", "--help"],
    "bench/kernels.py": [sys.executable, "bench/kernels.py", "--help"],
    "bench/grid_vs_tpe.py": [sys.executable, "bench/grid_vs_tpe.py", "--help"],
    "bench/host_overhead.py": [sys.executable, "bench/host_overhead.py", "--help"],
    "bench/proto_gluon_gemm.py": [sys.executable, "bench/proto_gluon_gemm.py", "--help"],
    "bench/proto_read_pattern.py": [sys.executable, "bench/proto_read_pattern.py", "--help"],
}


def _calls(text: str) -> list[tuple[str, set[str]]]:
    """(command, options) of each call in a script; continued lines joined."""
    text = text.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        for cmd in COMMANDS:
            if cmd in line:
                rest = line.split(cmd, 1)[1].split(">", 1)[0].split("|", 1)[0]
                out.append((cmd, set(re.findall(r"(?<![\w-])--[a-z][\w-]*", rest))))
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_parses_and_its_options_exist(script):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    calls = _calls(script.read_text())
    for cmd, opts in calls:
        helptext = subprocess.run(COMMANDS[cmd], capture_output=True, text=True, cwd=ROOT, timeout=300).stdout
        missing = sorted(o for o in opts if o not in helptext)
        assert not missing, f"{script.name}: {cmd} has no option {missing}"


def test_the_scripts_call_something():
    assert sum(len(_calls(s.read_text())) for s in SCRIPTS) >= 6
