"""moetune.compile(model, cache=PATH): a real SQLite dispatch table drives the buckets' kernels."""

from __future__ import annotations

import warnings

import pytest
import torch

import moetune
from moetune.codegen.torch import GatheredParams, GroupedGemmParams, HybridParams
from moetune.ir import Schedule
from moetune.runtime import DispatchWarning, plans
from moetune.runtime.entry import DispatchEntry
from moetune.runtime.table import CacheWarning, DispatchTable
from moetune.runtime.versions import Versions
from moetune.testing import FAMILIES, UNHOOKED, VOCAB, build

# every kind once: T = 2 → gathered GEMV, T = 14 → hybrid, T = 80 → grouped_mm;
# [101, 4096] is left to the default
ENTRIES = [
    ((1, 2), Schedule("stream_gemv", backend="torch", params=GatheredParams(4))),
    ((3, 20), Schedule("hybrid", row_threshold=2, backend="torch", params=HybridParams("grouped_mm", 4))),
    (
        (21, 100),
        Schedule("grouped_gemm", backend="torch", params=GroupedGemmParams("grouped_mm", "unsort_sum")),
    ),
]


def write_table(path, model, versions=None) -> None:
    versions = versions or Versions.current("torch", "cpu")
    with DispatchTable(path) as table:
        for c in moetune.capture(model):
            if c.block is None:
                continue
            for bucket, sch in ENTRIES:
                table.put(
                    DispatchEntry.of(
                        target="cpu",
                        block=c.block,
                        bucket=bucket,
                        schedule=sch,
                        time_us=1.0,
                        versions=versions,
                    )
                )


def logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in UNHOOKED])
def test_table_entries_run_and_match(family, tmp_path):
    path = tmp_path / "cpu.sqlite"
    model = build(family)
    write_table(path, model)
    inputs = [torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(S)) for S in (1, 7, 40)]
    refs = [logits(model, ids) for ids in inputs]
    with pytest.warns(DispatchWarning) as rec:
        moetune.compile(model, cache=path)
    assert len(rec) == 1 and "[101," in str(rec[0].message)  # one warning per block signature
    d = plans(model)[0].dispatcher
    for ids, ref, (_, sch) in zip(inputs, refs, ENTRIES, strict=True):
        route = d.route(ids.numel())
        assert route.source == "table" and route.schedule == sch
        out = logits(model, ids)
        assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    moetune.uncompile(model)


def test_foreign_table_falls_back_to_defaults(tmp_path):
    path = tmp_path / "other.sqlite"
    model = build("qwen3_moe")
    v = Versions.current("torch", "cpu")
    write_table(
        path,
        model,
        versions=Versions(v.moetune, v.kernel_hash, v.backend_version, v.torch, "NVIDIA H200", "sm_90"),
    )
    ids = torch.randint(0, VOCAB, (2, 5))
    ref = logits(model, ids)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        moetune.compile(model, cache=path)
    said = [r for r in rec if issubclass(r.category, (CacheWarning, DispatchWarning))]
    assert len(said) == 1, [str(r.message) for r in said]  # one warning, naming why and which buckets
    assert "NVIDIA H200" in str(said[0].message) and "default" in str(said[0].message)
    assert all(r.source.startswith("default") for r in plans(model)[0].dispatcher.routes)
    torch.testing.assert_close(logits(model, ids), ref, rtol=1e-5, atol=1e-5)
    moetune.uncompile(model)


def test_corrupt_table_names_the_file(tmp_path):
    from moetune.ir import CacheError

    path = tmp_path / "bad.sqlite"
    path.write_bytes(b"not a database" * 100)
    model = build("mixtral")
    with pytest.raises(CacheError, match="bad.sqlite"):
        moetune.compile(model, cache=path)
    assert not plans(model) and model.get_experts_implementation()[""] == "grouped_mm"
