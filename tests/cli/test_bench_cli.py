"""`moetune bench`: each kind's time against T, beside the floor, the compiled choice and transformers."""

from __future__ import annotations

import json

import pytest

from moetune.cli import main
from moetune.cli.bench import crossovers


def test_the_json_rows_time_every_kind_and_name_the_fastest(capsys):
    assert main(["bench", "--tiny", "qwen3_moe", "--tokens", "1,8", "--cases", "2", "--routing", "hot",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in rows] == [1, 8]
    for r in rows:
        assert r["routing"] == "hot" and r["floor_us"] > 0 and r["backend"] == "torch"
        timed = {k: v["time_us"] for k, v in r["kinds"].items() if "time_us" in v}
        assert {"stream_gemv", "grouped_gemm"} <= set(timed)
        assert all(t > 0 for t in timed.values())
        assert r["fastest"] == min(timed, key=timed.get)
        assert r["compiled_us"] > 0 and r["baseline_us"] > 0 and r["baseline"].startswith("transformers:")
    assert rows[1]["distinct"] <= 8 * 4  # hot: one expert in half of the 8 tokens' top-4


def test_the_table_and_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "x.png"
    assert main(["bench", "--tiny", "qwen3_moe", "--tokens", "1,2", "--cases", "2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["T", "floor"] and len(out) >= 5
    assert "routing uniform" in out[4] and "baseline: transformers:grouped_mm" in out[4]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,msg", [
    (["--tokens", "0,4"], "moetune bench: --tokens '0,4': expected token counts ≥ 1 separated by commas"),
    (["--routing", "zipf"], "moetune bench: --routing 'zipf': expected uniform, zipf:S"),
    (["--cases", "0"], "moetune bench: --cases 0: expected at least 1"),
])
def test_a_user_error_is_one_line_and_exit_2(argv, msg, capsys):
    assert main(["bench", "--tiny", "qwen3_moe", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(msg) and err.count("\n") == 1


def test_crossovers_are_where_the_fastest_kind_changes():
    rows = [dict(tokens=t, fastest=f) for t, f in ((1, "stream_gemv"), (2, "stream_gemv"), (4, None),
                                                   (8, "grouped_gemm"), (16, "grouped_gemm"), (32, "hybrid"))]
    assert crossovers(rows) == [(16, 32, "grouped_gemm", "hybrid")]
    rows[2]["fastest"] = "stream_gemv"
    assert crossovers(rows) == [(4, 8, "stream_gemv", "grouped_gemm"), (16, 32, "grouped_gemm", "hybrid")]
