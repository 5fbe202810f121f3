"""The tables shipped in cache/ open cleanly, and every GPU entry still matches the tree: same kernel
sources (so the runtime uses it instead of falling back) and parameters its backend can rebuild."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.ir.presets import PRESETS, preset
from moetune.runtime.table import DispatchTable, kernel_hash_part, kernel_source_hash

CACHE = Path(__file__).resolve().parents[2] / "cache"
SHIPPED = sorted(CACHE.glob("*.sqlite"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_table_opens(path):
    with DispatchTable(path, create=False) as t:
        assert t.foreign_version is None
        assert t.entries(), f"{path.name}: no entries"


def test_h200_table_is_current_and_rebuilds():
    path = CACHE / "h200.sqlite"
    blocks = {b.signature_hash(): b for b in (preset(n) for n in PRESETS)}
    with DispatchTable(path, create=False) as t:
        rows = t.entries(target="h200", backend="triton")
    assert rows
    current = kernel_source_hash("triton")
    stale = sorted({(e.kind, kernel_hash_part(e.versions.kernel_hash, e.kind)) for e in rows
                    if kernel_hash_part(e.versions.kernel_hash, e.kind) != kernel_hash_part(current, e.kind)})
    assert not stale, (f"{path.name} has entries tuned with other Triton kernel sources {stale}, the tree's "
                       f"are {current}: re-tune them on the H200 (`moetune tune --resume` re-tunes only "
                       "those; bash bench/tune_presets_h200.sh) or drop them")
    for e in rows:
        block = blocks.get(e.signature)
        assert block is not None, f"{path.name}: entry of an unknown block {e.signature_text}"
        s = e.schedule(block)
        assert s.backend == "triton" and s.params is not None
