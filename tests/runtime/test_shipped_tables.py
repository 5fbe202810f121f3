"""The tables shipped in cache/ open cleanly, and every GPU entry still matches the tree, checked on a CPU:
same kernel sources (so the runtime uses it instead of falling back), parameters its backend can rebuild,
and (with the Triton the digests were made with) the same sm_90 code as the recorded digests; and every GPU
entry serves both the versions it records and those the package pins (pyproject.toml), the latter with one
note per block that its entries are to be re-timed.

A source edit that leaves every stored winner's sm_90 code unchanged keeps the table current with one
command, `python -m tests.codegen.relabel cache/<target>.sqlite` (tests/codegen/relabel.py). Each GPU
target's table (`cache/h200.sqlite`, `cache/h100.sqlite`) is held to the same rules."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from moetune import __version__
from moetune.ir.block import signature_scheme
from moetune.ir.presets import PRESETS, preset
from moetune.runtime.schema import TABLE
from moetune.runtime.table import DispatchTable, load_entries
from moetune.runtime.versions import (
    Versions,
    backend_version,
    judge,
    kernel_source_hash,
    serves,
    stale_on,
)

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "cache"
SHIPPED = sorted(CACHE.glob("*.sqlite"))
GPU_TABLES = [t for t in ("h200", "h100") if (CACHE / f"{t}.sqlite").exists()]  # each with its digests file
H200 = CACHE / "h200.sqlite"


def _table(target: str) -> Path:
    return CACHE / f"{target}.sqlite"


def _digests_file(target: str) -> Path:
    return CACHE / f"{target}.digests.json"


def _relabel_cmd(target: str) -> str:
    return f"python -m tests.codegen.relabel cache/{target}.sqlite"


def _retune(target: str) -> str:
    return (f"re-tune them on the {target.upper()} (`moetune tune --resume` re-tunes only the stale buckets; "
            f"python -m bench tune shows the command), then record their digests: {_relabel_cmd(target)} --record")


def _compiled(*args: str) -> subprocess.CompletedProcess:
    """Run a command of the sm_90 tools with Triton compiling (TRITON_INTERPRET unset), from the root."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def _digests_of(table: Path) -> dict[str, str]:
    res = _compiled(str(ROOT / "tests" / "codegen" / "triton_sm90.py"), "--digests", str(table))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


_TREES: dict[str, dict[str, str]] = {}


def _recorded(target: str) -> dict:
    """The committed digests of a shipped GPU table, where this machine's Triton is the one that made them."""
    pytest.importorskip("triton")
    path = _digests_file(target)
    data = json.loads(path.read_text())
    if data["triton"] != backend_version("triton"):
        pytest.skip(f"{path.name} was made with {data['triton']}, this is {backend_version('triton')}")
    return data


def _tree(target: str) -> dict[str, str]:
    """The digests of a shipped GPU table's winners compiled on this tree (once per test run)."""
    _recorded(target)
    if target not in _TREES:
        _TREES[target] = _digests_of(_table(target))
    return _TREES[target]


@pytest.fixture(scope="session")
def recorded() -> dict:
    return _recorded("h200")


@pytest.fixture(scope="session")
def tree(recorded) -> dict[str, str]:
    return _tree("h200")


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_table_opens(path):
    with DispatchTable(path, create=False) as t:
        assert t.foreign_version is None and t.source == TABLE, f"{path.name}: holds {t.source}"
        assert t.entries(), f"{path.name}: no entries"


@pytest.mark.parametrize("target", GPU_TABLES)
def test_gpu_table_is_current_and_rebuilds(target):
    pytest.importorskip("triton")  # the backend that declares the kernel sources
    table, digests = _table(target), _digests_file(target)
    blocks = {b.signature_hash(): b for b in (preset(n) for n in PRESETS)}
    with DispatchTable(table, create=False) as t:
        rows = t.entries(target=target, backend="triton")
    assert rows
    current = kernel_source_hash("triton")
    stale = sorted({(e.kind, signature_scheme(e.signature_text)) for e in rows if stale_on(e, current)})
    if stale:
        try:  # the fix depends on whether the winners' code changed
            same = _tree(target) == json.loads(digests.read_text())["digests"]
        except pytest.skip.Exception:
            same = None
        fix = {True: f"every stored winner's sm_90 code is unchanged: run `{_relabel_cmd(target)}`",
               False: f"their sm_90 code changed (test_gpu_digests_are_the_trees names it): {_retune(target)}",
               None: f"on a machine with the Triton of {digests.name}, `{_relabel_cmd(target)}` moves them if their "
                     f"sm_90 code is unchanged; else {_retune(target)}"}[same]
        pytest.fail(f"{table.name} has entries tuned with other Triton kernel sources {stale}, the tree's are "
                    f"{current}: {fix}")
    for e in rows:
        block = blocks.get(e.signature)
        assert block is not None, f"{table.name}: entry of an unknown block {e.signature_text}"
        s = e.schedule(block)
        assert s.backend == "triton" and s.params is not None


@pytest.mark.parametrize("target", GPU_TABLES)
def test_gpu_digests_are_the_trees(target):
    """The recorded digests are those of the stored winners compiled on this tree: a source edit that changed
    a winner's code (its timing no longer holds) is named here."""
    old, tree = _recorded(target)["digests"], _tree(target)
    differ = sorted(k for k in old.keys() | tree.keys() if old.get(k) != tree.get(k))
    assert not differ, (f"{len(differ)} kernels of {_table(target).name}'s winners differ from "
                        f"{_digests_file(target).name}: {differ[:8]}{' …' if len(differ) > 8 else ''}; if the code "
                        f"was meant to change, {_retune(target)}")


def _relabel(table: Path, digests: Path, *more: str) -> subprocess.CompletedProcess:
    return _compiled("-m", "tests.codegen.relabel", str(table), "--digests", str(digests), *more)


def test_relabel_moves_rows_only_when_every_digest_is_equal(recorded, tree, tmp_path, monkeypatch):
    """The relabel command on one stored winner marked with older kernel sources: a digest that differs writes
    nothing and names it, and so do another Triton's digests; equal digests move the row to the tree's hash,
    after which (not before) its digests may be recorded."""
    monkeypatch.syspath_prepend(str(ROOT))
    from tests.codegen import relabel

    table, digests = tmp_path / "t.sqlite", tmp_path / "t.digests.json"
    shutil.copy(H200, table)
    old_hash = "grouped_gemm=0;hybrid=0;stream_gemv=0"
    con = sqlite3.connect(table)
    with con:
        keep = con.execute(f"SELECT rowid FROM {TABLE} WHERE kind = 'stream_gemv' LIMIT 1").fetchone()[0]
        con.execute(f"DELETE FROM {TABLE} WHERE rowid != ?", (keep,))
        con.execute(f"UPDATE {TABLE} SET kernel_hash = ?", (old_hash,))
        sig, lo, hi = con.execute(f"SELECT signature, bucket_lo, bucket_hi FROM {TABLE}").fetchone()
    con.close()

    def hashes() -> set[str]:
        with DispatchTable(table, create=False) as t:
            return {e.versions.kernel_hash for e in t.entries()}

    with pytest.raises(relabel.RelabelError, match="other kernel sources"):
        relabel.record(table, digests)
    assert not digests.exists()
    name = next(b.name for b in map(preset, PRESETS) if b.signature_hash() == sig)
    now = {k: v for k, v in tree.items() if k.startswith(f"{name} [{lo},{hi}] ")}
    assert len(now) >= 2
    digests.write_text(json.dumps(dict(recorded, triton="triton 0.0", digests=now)))
    with pytest.raises(relabel.RelabelError, match="triton 0.0"):
        relabel.relabel(table, digests)
    changed = sorted(now)[0]
    digests.write_text(json.dumps(dict(recorded, digests=dict(now, **{changed: "0" * 16}))))
    res = _relabel(table, digests)
    assert res.returncode == 1 and changed in res.stdout and "nothing written" in res.stdout, res.stdout
    assert hashes() == {old_hash}

    digests.write_text(json.dumps(dict(recorded, digests=now)))
    res = _relabel(table, digests)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert hashes() == {kernel_source_hash("triton")}
    digests.unlink()
    assert _relabel(table, digests, "--record").returncode == 0
    assert json.loads(digests.read_text())["digests"] == now


def _pins() -> dict[str, str]:
    """The versions pyproject.toml pins, by package name: {"torch": "2.13.0", "triton": "3.7.1", …}."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {name.strip(): version.strip() for name, sep, version in (r.partition("==") for r in reqs) if sep}


@pytest.mark.parametrize("target", GPU_TABLES)
def test_gpu_table_serves_its_own_versions_and_the_package_pins(target):
    """Every row of a shipped GPU table is used on its GPU running this tree, whether it has the libraries
    the rows record (the tuning machine's) or those the package installs: the latter says, once per block,
    that the entries were timed with another Triton."""
    pytest.importorskip("triton")  # the backend that declares the kernel sources
    pins = _pins()
    tree = kernel_source_hash("triton")
    table = _table(target)
    with DispatchTable(table, create=False) as t:
        rows = t.entries(target=target, backend="triton")
    assert rows
    installed = Versions(__version__, tree, f"triton {pins['triton']}", pins["torch"], rows[0].versions.device,
                         rows[0].versions.capability)
    kept = {replace(e.versions, moetune=__version__, kernel_hash=tree) for e in rows}  # the tuning machine's
    assert len(kept) == 1, f"{table.name}: the rows record {len(kept)} sets of versions: {kept}"
    recorded = kept.pop()
    assert recorded.backend_version != installed.backend_version, \
        "the rows record the pinned Triton: this test no longer sees another library version"
    retime = (f"retime: same kernel sources, timed with other libraries ({recorded.backend_version} → "
              f"{installed.backend_version}; torch {recorded.torch} → torch {installed.torch})")
    for e in rows:
        where = f"{table.name} [{e.bucket_lo},{e.bucket_hi}] {e.signature_text}"
        assert judge(e, recorded) is None, where
        why = judge(e, installed)
        assert serves(why) and why == retime, f"{where}: {why}"

    blocks = {b.signature_hash(): b for b in map(preset, PRESETS)}
    assert {e.signature for e in rows} <= blocks.keys()
    for sig in sorted({e.signature for e in rows}):
        block, want = blocks[sig], sorted((e.bucket_lo, e.bucket_hi) for e in rows if e.signature == sig)
        notes: list[str] = []
        got = load_entries(table, block, target, "triton", versions=recorded, notes=notes)
        assert [(lo, hi) for lo, hi, _ in got] == want and notes == [], f"{block.name}: {notes}"
        got = load_entries(table, block, target, "triton", versions=installed, notes=notes)
        assert [(lo, hi) for lo, hi, _ in got] == want, f"{block.name} with {installed.backend_version}: {notes}"
        assert len(notes) == 1 and "not used" not in notes[0], f"{block.name}: {notes}"
        assert f"{len(want)} {'entry' if len(want) == 1 else 'entries'} used, to be re-timed" in notes[0], notes


COVERED = {  # bench preset: the T_max up to which each shipped GPU table has an entry for every token count
    "qwen3-30b-a3b": 4096, "deepseek-v3": 4096, "qwen3.5-397b-a17b": 4096, "mixtral-8x7b": 4096,
    "qwen3-30b-a3b-fp8": 4096, "deepseek-v3-fp8": 4096, "qwen3.5-397b-a17b-fp8": 4096, "mixtral-8x7b-fp8": 4096,
}
SHORT = {("h100", "qwen3.5-397b-a17b-fp8"): 1946}  # (target, preset): a lower T_max where the tune's budget ended


@pytest.mark.parametrize("target", GPU_TABLES)
@pytest.mark.parametrize("name", COVERED)
def test_a_compiled_bench_preset_finds_an_entry_for_every_token_count(name, target):
    """Each shipped GPU table covers T = 1 … T_max for the bench's presets (4096, a compiled model's default, bf16
    and FP8): the dispatcher its GPU builds from it routes every bucket to a table entry and warns of nothing."""
    import warnings

    pytest.importorskip("triton")
    from moetune.codegen.triton import BACKEND
    from moetune.runtime.dispatch import Dispatcher

    block = preset(name).replace(T_max=SHORT.get((target, name), COVERED[name]))
    table = _table(target)
    with DispatchTable(table, create=False) as t:
        rows = t.entries(target=target, backend="triton", signature=block.signature_hash())
    here = replace(rows[0].versions, kernel_hash=kernel_source_hash("triton"))
    entries = load_entries(table, block, target, "triton", versions=here)
    spans = sorted((lo, hi) for lo, hi, _ in entries)
    assert spans[0][0] == 1 and spans[-1][1] >= block.T_max
    assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:], strict=False)), spans  # no gap
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Dispatcher.from_entries(block, BACKEND, entries, target=target, where=table.name)
