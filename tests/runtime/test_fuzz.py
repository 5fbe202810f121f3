"""Fuzz targets of the two file readers: a valid dispatch table and a valid routing trace, mutated byte by byte
and value by value. The reader either reads the file or raises the package's own error naming it (CacheError,
TraceError): never another exception. MOETUNE_FUZZ_EXAMPLES sets each target's example count (CI: the
defaults below)."""

from __future__ import annotations

import io
import os
import sqlite3
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_table import BLOCK, HERE, entry

from moetune.ir import CacheError
from moetune.ir.trace import Trace, TraceError, synthetic_trace
from moetune.runtime.schema import COLUMNS, TABLE
from moetune.runtime.table import DispatchTable, load_entries


def examples(default: int) -> int:
    return int(os.environ.get("MOETUNE_FUZZ_EXAMPLES", default))


def fuzz(default: int):
    return settings(max_examples=examples(default), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


_DIR = Path(tempfile.mkdtemp(prefix="moetune-fuzz-"))


def _valid_table() -> bytes:
    path = _DIR / "valid.sqlite"
    with DispatchTable(path) as t:
        t.put_all([entry(1, 1, 2.0), entry(2, 7, 3.0, kind="grouped_gemm"), entry(8, 64, 5.0, kind="hybrid")])
    return path.read_bytes()


TABLE_BYTES = _valid_table()
TRACE_PATH = synthetic_trace(16, 4, tokens=40, layers=2, step=8).save(_DIR / "valid.npz")
TRACE_BYTES = TRACE_PATH.read_bytes()


def _mutate(data: bytes, edits) -> bytes:
    """Apply (kind, offset, bytes) edits: overwrite, insert, or cut the file there."""
    out = bytearray(data)
    for kind, at, chunk in edits:
        at %= max(1, len(out))
        if kind == "overwrite":
            out[at:at + len(chunk)] = chunk
        elif kind == "insert":
            out[at:at] = chunk
        else:
            del out[at:]
    return bytes(out)


EDITS = st.lists(st.tuples(st.sampled_from(["overwrite", "overwrite", "insert", "truncate"]),
                           st.integers(0, 1 << 20), st.binary(min_size=1, max_size=16)), min_size=1, max_size=4)


def _read_table(path: Path) -> None:
    """Both readers of the runtime; either reads or raises CacheError naming `path`."""
    for read in (lambda: load_entries(path, BLOCK, "cpu", "torch", versions=HERE, notes=[]),
                 lambda: DispatchTable(path, create=False).close()):
        try:
            read()
        except CacheError as e:
            assert str(path) in str(e), e


def _fresh(name: str, data: bytes) -> Path:
    path = _DIR / name
    for side in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{side}").unlink(missing_ok=True)
    path.write_bytes(data)
    return path


@fuzz(300)
@given(edits=EDITS)
def test_table_reader_on_mutated_bytes(edits):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _read_table(_fresh("bytes.sqlite", _mutate(TABLE_BYTES, edits)))


VALUES = st.one_of(st.none(), st.integers(-(1 << 63), (1 << 63) - 1), st.floats(allow_nan=True),
                   st.text(max_size=40), st.binary(max_size=16),
                   st.sampled_from(['{"block_m": 16}', "[]", "{", '{"no_such": 1}', "null", "1e999"]))


@fuzz(200)
@given(changes=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(sorted(COLUMNS)), VALUES), min_size=1,
                        max_size=4))
def test_table_reader_on_mutated_rows(changes):
    """Rows with any column set to any SQLite value (typed columns do not stop a foreign writer)."""
    path = _fresh("rows.sqlite", TABLE_BYTES)
    conn = sqlite3.connect(path)
    with conn:
        rowids = [r for (r,) in conn.execute(f"SELECT rowid FROM {TABLE} ORDER BY rowid")]
        for i, col, value in changes:
            try:
                conn.execute(f"UPDATE {TABLE} SET [{col}] = ? WHERE rowid = ?", (value, rowids[i]))
            except sqlite3.Error:
                pass  # NOT NULL, the primary key: the file keeps the row as it was
    conn.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _read_table(path)


def _read_trace(path: Path) -> None:
    try:
        Trace.load(path)
    except TraceError as e:
        assert str(path) in str(e), e


@fuzz(300)
@given(edits=EDITS)
def test_trace_reader_on_mutated_bytes(edits):
    _read_trace(_fresh("bytes.npz", _mutate(TRACE_BYTES, edits)))


with np.load(TRACE_PATH) as _z:
    TRACE_ARRAYS = {n: _z[n] for n in _z.files}

ARRAYS = st.one_of(
    st.builds(np.array, st.one_of(st.integers(-(1 << 31), 1 << 31), st.floats(), st.text(max_size=20),
                                  st.booleans())),
    st.builds(lambda xs, dt: np.array(xs, np.int64).astype(dt), st.lists(st.integers(-5, 70), max_size=24),
              st.sampled_from(["int8", "int16", "int32", "int64", "float32", "uint8"])),
    st.builds(lambda xs, shape: np.resize(np.array(xs, np.int64), shape), st.lists(st.integers(-3, 20), min_size=1),
              st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(0, 5))),
    st.builds(lambda xs: np.array(xs, dtype=str), st.lists(st.text(max_size=8), max_size=3)),
)


@fuzz(300)
@given(changes=st.dictionaries(st.sampled_from(sorted(TRACE_ARRAYS)), st.one_of(st.none(), ARRAYS), min_size=1,
                               max_size=3))
def test_trace_reader_on_mutated_arrays(changes):
    """Arrays dropped (None) or replaced by any dtype and shape."""
    arrays = {n: a for n, a in {**TRACE_ARRAYS, **changes}.items() if a is not None}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    _read_trace(_fresh("arrays.npz", buf.getvalue()))


@pytest.mark.parametrize("name", ["valid.sqlite", "valid.npz"])
def test_the_unmutated_files_read(name):
    """The targets start from files the readers take."""
    if name.endswith(".sqlite"):
        assert len(load_entries(_fresh(name, TABLE_BYTES), BLOCK, "cpu", "torch", versions=HERE)) == 3
    else:
        assert Trace.load(_fresh(name, TRACE_BYTES)).tokens == 40
