"""The committed H200 results: the markdown table is what bench/kernels.py renders from the JSON beside it,
and its footer's figures are computed from the records (recomputed here independently)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "nvidia-h200-kernels.json"

pytest.importorskip("triton")  # bench/kernels.py defines a Triton kernel at import
sys.path.insert(0, str(ROOT / "bench"))
import kernels as B  # noqa: E402


@pytest.fixture(scope="module")
def records():
    if not RESULTS.exists():
        pytest.skip("no committed H200 results")
    return json.loads(RESULTS.read_text())


def test_the_committed_markdown_is_rendered_from_the_committed_json(records, tmp_path):
    copy = tmp_path / RESULTS.name
    copy.write_text(json.dumps(records))
    md = B.render(str(copy))
    assert md == RESULTS.with_name("nvidia-h200-kernels.md").read_text()


def test_the_footer_figures(records):
    best: dict = {}
    for r in records["records"]:
        if r["impl"].startswith("moetune") and "time_us" in r:
            k = (r["shape"], r["tokens"])
            if k not in best or r["time_us"] < best[k]["time_us"]:
                best[k] = r
    sp = [r["best_open_us"] / r["time_us"] for r in best.values()]
    gm = math.exp(sum(map(math.log, sp)) / len(sp))
    under = sum(1 for (s, t), r in best.items() if 100 * r["floor_us"] / r["time_us"] < B.target_pct(t))
    md = B.table(records["records"], records["ceilings"], "x")
    assert f"{len(best)} cells: speedup over the best open-source figure, geometric mean {gm:.3f}×" in md
    assert f"; {under} cells under their target" in md
    assert [B.target_pct(t) for t in (1, 2, 64, 128, 1024)] == [80.0, 85.0, 85.0, 75.0, 75.0]


def test_table_variant_survives_a_missing_or_corrupt_table(tmp_path, capsys):
    import warnings

    from moetune.runtime.table import CacheWarning

    assert B.table_variant("", "mixtral-8x7b", 512) == []  # left out on request
    with pytest.warns(CacheWarning, match="no such file"):
        assert B.table_variant(str(tmp_path / "none.sqlite"), "mixtral-8x7b", 512) == []
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"not a sqlite file" * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert B.table_variant(str(bad), "mixtral-8x7b", 512) == []
    assert "bad.sqlite" in capsys.readouterr().out  # the file is named


def test_routing_mean_is_the_mean_of_each_routings_median():
    """Replay i ran routing i mod n: routing 0 took 10, 11, 100 µs (one outlier), routing 1 20, 21, 22."""
    times = [10.0, 20.0, 11.0, 21.0, 100.0, 22.0]
    assert B.routing_mean(times, 2) == pytest.approx((11.0 + 21.0) / 2)
    assert B.routing_mean(times, 1) == pytest.approx(20.5)  # one routing: the plain median


def test_nb_twins_only_where_down_nb_runs():
    """bench --nb-twins: `-n2` / `-n4` of the token-mode GEMV and pointer-path GEMM candidates, and every twin
    builds (the TMA path and the expert-mode GEMV refuse down_nb, so they get none)."""
    named = B.variants(128, 8, 2048, 768, 1) + B.variants(128, 8, 2048, 768, 16) + B.variants(8, 2, 4096, 14336, 64)
    twins = dict(B.nb_twins(named))
    assert twins and all(t.endswith(("-n2", "-n4")) for t in twins)
    by_tag = dict(named)
    for tag, s in twins.items():
        base = by_tag[tag.rsplit("-", 1)[0]]
        assert s.params.down_nb == int(tag[-1])
        assert s.params == dataclasses.replace(base.params, down_nb=s.params.down_nb)
        assert not getattr(s.params, "tma", False) and getattr(s.params, "down_mode", "token") == "token"
    assert {"ga-n4", "m16-n2"} <= set(twins) and not any(t.startswith(("m16-t-", "m64n64-t1-")) for t in twins)
