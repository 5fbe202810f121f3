"""`moetune show` and `moetune merge`: every entry with its parameters whole and its spread, or (`--json`) every
row with every column; bad files are one line, exit 2."""

from __future__ import annotations

import json

import pytest

from moetune.cli import main
from moetune.codegen.backend import get
from moetune.ir import MoEBlock
from moetune.runtime.entry import DispatchEntry
from moetune.runtime.table import DispatchTable
from moetune.runtime.versions import Versions

BLOCK = MoEBlock(E=16, k=4, D=64, F=40, weight_dtype="float32", routing_weight_dtype="float32", name="t")


def entry(lo: int, hi: int, time_us: float, kind: str, backend: str = "triton",
          spread_us: float | None = None) -> DispatchEntry:
    return DispatchEntry.of(target="h200", block=BLOCK, bucket=(lo, hi), schedule=get(backend).default(BLOCK, kind, hi),
                            time_us=time_us, versions=Versions.current("torch", "cpu"), floor_us=2.0,
                            default_time_us=20.0, baseline_time_us=30.0, baseline="transformers:batched_mm",
                            timer="cpu", trials=7, spread_us=spread_us)


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "a.sqlite"
    with DispatchTable(path) as t:
        for e in (entry(1, 1, 4.0, "stream_gemv", spread_us=0.37), entry(2, 7, 8.0, "hybrid"),
                  entry(8, 64, 10.0, "grouped_gemm", spread_us=1.25)):
            t.put(e)
    return path


def test_show_prints_each_winner_and_its_parameters_whole(table, capsys):
    assert main(["show", str(table)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{table}: 3 entries in dispatch_v2"
    with DispatchTable(table, create=False) as t:
        entries = t.entries()
    for e in entries:
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(f"[{e.bucket_lo},{e.bucket_hi}]"))
        row, params = lines[i], lines[i + 1].strip()
        assert row.split()[1] == e.kind + (f"(R={e.row_threshold})" if e.row_threshold is not None else "")
        assert "50.0%" in row or "20.0%" in row or "25.0%" in row
        want = ", ".join(f"{k}={v}" for k, v in json.loads(e.params).items())
        assert params == want and len(want) > 44  # the whole params, not cut to a column's width
        assert row.split()[7] == ("–" if e.spread_us is None else f"{e.spread_us:.2f}")  # after vs default
    header = next(ln for ln in lines if "vs default" in ln).split()
    i = header.index("spread")
    assert header[i - 2:i + 2] == ["vs", "default", "spread", "µs"]


def test_show_json_is_every_row_with_every_column(table, capsys):
    from moetune.runtime.schema import COLUMNS

    assert main(["show", "--json", str(table)]) == 0
    rows = json.loads(capsys.readouterr().out)
    with DispatchTable(table, create=False) as t:
        entries = t.entries()
    assert isinstance(rows, list) and len(rows) == len(entries) == 3
    for r, e in zip(rows, entries, strict=True):
        assert list(r) == list(COLUMNS)
        assert DispatchEntry.from_row(r) == e  # nothing lost: the rows rebuild the entries
    assert [r["spread_us"] for r in rows] == [0.37, None, 1.25]
    assert json.loads(rows[1]["params"]) == json.loads(entries[1].params)


def test_merge_writes_the_faster_entries_and_shows_them(table, tmp_path, capsys):
    b = tmp_path / "b.sqlite"
    with DispatchTable(b) as t:
        t.put(entry(1, 1, 3.0, "stream_gemv"))
    out = tmp_path / "sub" / "c.sqlite"
    assert main(["merge", str(table), str(b), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"merged 2 table(s) into {out}: 4 entries read, it holds 3; of those read, 1 replaced "
                           "by a faster entry of their bucket")
    with DispatchTable(out, create=False) as t:
        assert {e.bucket: e.time_us for e in t.entries()} == {(1, 1): 3.0, (2, 7): 8.0, (8, 64): 10.0}


def test_bad_table_files_are_one_line(table, tmp_path, capsys):
    missing = tmp_path / "none.sqlite"
    assert main(["show", str(missing)]) == 2
    assert capsys.readouterr().err == (f"moetune show: TABLE '{missing}': no such file; "
                                       "expected a dispatch table written by `moetune tune`\n")
    junk = tmp_path / "junk.sqlite"
    junk.write_text("not sqlite at all " * 100)
    assert main(["show", str(junk)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(junk) in err
    assert main(["merge", str(table), str(missing), "-o", str(tmp_path / "c.sqlite")]) == 2
    assert str(missing) in capsys.readouterr().err
    assert main(["merge", str(table), "-o", "/proc/moetune-none/c.sqlite"]) == 2
    assert capsys.readouterr().err.startswith("moetune merge: -o '/proc/moetune-none/c.sqlite': cannot be written")
    assert main(["merge", str(table)]) == 2
    assert capsys.readouterr().err == "moetune: merge: the following arguments are required: -o/--output\n"
