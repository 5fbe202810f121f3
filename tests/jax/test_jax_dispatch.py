"""The JAX path's dispatch: a real SQLite dispatch table's entries picked per token count at trace time, the
defaults where the table has no usable entry (one DispatchWarning, as in the torch runtime), and entries
of backends the JAX path does not run left alone. The kernels are those of a registered test backend with
JAX kernels (jax_kernels.py), whose named scopes say in the lowered program which schedule ran."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

jax = pytest.importorskip("jax")

import jax_kernels as jk  # noqa: E402

import moetune.jax as mj  # noqa: E402
from moetune.codegen.pallas_tpu._common import to_jax  # noqa: E402
from moetune.codegen.torch import experts_reference  # noqa: E402
from moetune.codegen.torch.tolerance import worst_error  # noqa: E402
from moetune.ir import CacheError, MoEBlock, Schedule, UnsupportedSchedule  # noqa: E402
from moetune.runtime.dispatch import DispatchWarning  # noqa: E402
from moetune.runtime.entry import DispatchEntry  # noqa: E402
from moetune.runtime.table import DispatchTable  # noqa: E402
from moetune.runtime.versions import Versions  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402

BACKEND = jk.registered()
BLOCK = MoEBlock(E=8, k=2, D=16, F=8, weight_dtype="float32", routing_weight_dtype="float32", T_max=64,
                 name="jax-dispatch")
GEMV = Schedule("stream_gemv", backend=jk.NAME, params=jk.TileParams(8))
GEMM = Schedule("grouped_gemm", backend=jk.NAME, params=jk.TileParams(16))


def _entry(bucket, schedule, backend=jk.NAME, **versions):
    v = Versions.current(backend, "cpu")
    return DispatchEntry.of(target="cpu", block=BLOCK, bucket=bucket, time_us=1.0,
                            schedule=dataclasses.replace(schedule, backend=backend),
                            versions=dataclasses.replace(v, **versions))


def _table(path, *entries):
    with DispatchTable(path) as t:
        t.put_all(entries)
    return path


def _inputs(T: int):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, BLOCK.D, generator=g)
    ids = torch.randint(0, BLOCK.E, (T, BLOCK.k), generator=g, dtype=torch.int32)
    wts = torch.rand(T, BLOCK.k, generator=g)
    return x, ids, wts


W = expert_tensors(BLOCK, seed=5)


def _fn(**kw):
    return jax.jit(lambda x, i, t, gu, dn: mj.experts(x, i, t, gu, dn, block=BLOCK, backend=jk.NAME, **kw))


def _lowered(fn, T: int) -> str:
    x, ids, wts = _inputs(T)
    return fn.lower(*(to_jax(a) for a in (x, ids, wts, W.gate_up, W.down))).as_text(debug_info=True)


def test_each_trace_runs_the_entry_of_its_token_count(tmp_path):
    path = _table(tmp_path / "t.sqlite", _entry((1, 4), GEMV), _entry((5, 64), GEMM))
    fn = _fn(table=str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)  # every bucket has its entry: nothing to say
        for T, kind, tile in ((3, "stream_gemv", 8), (20, "grouped_gemm", 16), (100, "grouped_gemm", 16)):
            text = _lowered(fn, T)  # T = 100 is above T_max: the last bucket
            assert f"{mj.SCOPE}/{jk.NAME}.{kind}/{jk.scope(kind, tile)}" in text, T
            x, ids, wts = _inputs(T)
            out = fn(*(to_jax(a) for a in (x, ids, wts, W.gate_up, W.down)))
            assert worst_error(torch.from_dlpack(out), experts_reference(BLOCK, x, ids, wts, W)) <= 1.0
    assert mj.route(BLOCK, 3, table=str(path), backend=jk.NAME).schedule == GEMV
    assert mj.route(BLOCK, 5, table=str(path), backend=jk.NAME).source == "table"


def test_an_opened_table_serves_too(tmp_path):
    path = _table(tmp_path / "t.sqlite", _entry((1, 64), GEMM))
    with DispatchTable(path, create=False) as t:
        r = mj.route(BLOCK, 7, table=t, backend=jk.NAME)
    assert (r.schedule, r.source) == (GEMM, "table")


def test_uncovered_token_counts_run_the_default_and_say_so_once(tmp_path):
    path = _table(tmp_path / "t.sqlite", _entry((1, 4), GEMV))
    fn = _fn(table=str(path))
    with pytest.warns(DispatchWarning, match=r"no usable entry.*bucket\(s\) \[5,") as said:
        for T in (2, 9, 33):
            _lowered(fn, T)
    assert len([w for w in said if issubclass(w.category, DispatchWarning)]) == 1
    r = mj.route(BLOCK, 9, table=str(path), backend=jk.NAME)
    assert r.source == "default (no entry)" and r.schedule.backend == jk.NAME
    assert f"{mj.SCOPE}/{jk.NAME}.{r.schedule.kind}" in _lowered(fn, 9)


def test_entries_of_backends_the_jax_path_does_not_run_are_left_alone(tmp_path):
    path = _table(tmp_path / "torch.sqlite", _entry((1, 64), Schedule("stream_gemv"), backend="torch"))
    with pytest.warns(DispatchWarning, match=r"for backend\(s\) torch, none for jax_test.*no usable entry"):
        r = mj.route(BLOCK, 2, table=str(path), backend=jk.NAME)
    assert r.source == "default (no entry)" and r.schedule.backend == jk.NAME


def test_stale_entries_run_the_default_with_the_reason(tmp_path):
    path = _table(tmp_path / "stale.sqlite", _entry((1, 64), GEMV, kernel_hash="stream_gemv=0000"))
    with pytest.warns(DispatchWarning, match=r"1 entry not used: \[1,64\] stale"):
        r = mj.route(BLOCK, 2, table=str(path), backend=jk.NAME)
    assert r.source == "default (no entry)"


def test_no_table_runs_the_defaults_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)
        routes = mj.routes(BLOCK, backend=jk.NAME)
    assert all(r.source == "default" for r in routes.routes)
    assert routes.routes[0].lo == 1 and routes.routes[-1].hi == BLOCK.T_max


def test_the_reference_reads_no_table(tmp_path):
    path = _table(tmp_path / "t.sqlite", _entry((1, 64), GEMV))
    with pytest.warns(DispatchWarning, match="runs no schedule; dispatch table .* not read"):
        r = mj.route(BLOCK, 2, table=str(path), backend="reference")
    assert r.schedule is None and r.source == "reference"


def test_a_corrupt_table_is_reported_with_its_path(tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"not a database" * 100)
    with pytest.raises(CacheError, match="bad.sqlite"):
        mj.route(BLOCK, 2, table=str(bad), backend=jk.NAME)


def test_a_block_the_backend_runs_no_kernel_of_is_refused_with_the_reason():
    odd = BLOCK.replace(D=12, name="odd")
    with pytest.raises(UnsupportedSchedule, match=r"jax_test runs none of its kernels on odd.*D = 12 is not a "
                                                  r"multiple of the tile rows 8"):
        mj.route(odd, 2, backend=jk.NAME)
