"""`moetune.tune`: a tiny real model, a MoEBlock or a preset name in, per-bucket results out, winners in
the table that `moetune.compile` reads."""

from __future__ import annotations

import time

import pytest
import torch

import moetune
from moetune.ir import ConfigError, MoEBlock
from moetune.runtime.table import DispatchTable
from moetune.search import TuneOptions


def test_tune_a_tiny_model_writes_the_table_compile_reads(tmp_path):
    from moetune.testing import build

    model = build("qwen3_moe", dtype=torch.float32)
    t0 = time.monotonic()
    rs = moetune.tune(model, tokens=(1, 8), budget_s=4.0, cache=tmp_path / "t.sqlite", display=False,
                      options=TuneOptions(device="cpu", build_workers=1))
    assert time.monotonic() - t0 <= 4.4
    assert rs and rs[0].bucket[0] == 1 and rs[-1].bucket[1] == 8
    with DispatchTable(tmp_path / "t.sqlite") as t:
        rows = t.entries()
    assert {e.target for e in rows} == {"cpu"} and {e.backend for e in rows} == {"torch"}
    assert sorted(e.bucket for e in rows) == sorted(r.bucket for r in rs if r.written)


def test_compile_reads_the_target_s_table_of_a_folder(tmp_path):
    """A folder of tables (one per target, as a deployment ships them): compile reads <target>.sqlite, here
    cpu.sqlite; a folder without one leaves every bucket on its default, with the folder's tables named."""
    import warnings

    from moetune.runtime import plans
    from moetune.testing import build

    model = build("qwen3_moe", dtype=torch.float32)
    rs = moetune.tune(model, tokens=(1, 8), budget_s=4.0, cache=tmp_path / "cpu.sqlite", display=False,
                      options=TuneOptions(device="cpu", build_workers=1))
    tuned = sorted(r.bucket for r in rs if r.written)
    assert tuned
    moetune.compile(model, cache=tmp_path)
    routes = plans(model)[0].dispatcher.routes
    assert sorted((r.lo, r.hi) for r in routes if r.source == "table") == tuned
    other = tmp_path / "elsewhere"
    other.mkdir()
    (tmp_path / "cpu.sqlite").rename(other / "h100.sqlite")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moetune.compile(model, cache=other)
    said = " ".join(str(w.message) for w in caught)
    assert "cpu.sqlite: no such file (the folder holds h100.sqlite)" in said
    assert all(r.source.startswith("default") for r in plans(model)[0].dispatcher.routes)


def test_tune_a_block_without_a_table_writes_nothing():
    block = MoEBlock(E=4, k=2, D=32, F=16, weight_dtype="float32", routing_weight_dtype="float32", T_max=4)
    rs = moetune.tune(block, backend="torch", tokens=(1, 4), budget_s=2.0, display=False,
                      options=TuneOptions(device="cpu", build_workers=1))
    assert rs and not any(r.written for r in rs) and any(r.winner is not None for r in rs)


def test_tune_refuses_a_model_with_no_moe_block():
    with pytest.raises(ConfigError, match="no MoE block captured in Linear"):
        moetune.tune(torch.nn.Linear(4, 4), backend="torch", budget_s=1.0)


def test_tune_an_fp8_model_on_cpu_writes_the_table_its_compile_reads(tmp_path):
    """FP8 experts (FP8Experts, 8x8 blocks) are tuned with the torch kernels on FP8 random weights, and
    the compiled FP8 model reads the winners under its FP8 block's key."""
    from moetune.runtime import plans
    from moetune.testing import build, fp8

    model = fp8.to_fp8(build("qwen3_moe", dtype=torch.bfloat16), (8, 8))
    rs = moetune.tune(model, tokens=(1, 8), budget_s=4.0, cache=tmp_path / "t.sqlite", display=False,
                      options=TuneOptions(device="cpu", build_workers=1))
    assert rs and any(r.winner is not None for r in rs)
    with DispatchTable(tmp_path / "t.sqlite") as t:
        rows = t.entries()
    assert rows and all("fp8_block:8x8" in e.signature_text for e in rows)
    moetune.compile(model, cache=tmp_path / "t.sqlite")
    block = plans(model)[0].block
    assert {e.signature for e in rows} == {block.signature_hash()}
