"""The pallas_gpu grouped GEMM's tile plan (moetune.codegen.pallas_gpu.routing) in Pallas' interpreter, entry by
entry against a plan built here in plain Python from its definition: expert e's pairs in pair order from row
tile_begin[e]·BM, ⌈c_e/BM⌉ tiles each, zeros on the padding rows. Routings of one program and of several (the
two-launch form), with sentinel ids on both sides of [0, E), a hot expert, experts without rows, E not a power
of two and BM above the rows of most experts."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from moetune.codegen.pallas_gpu import routing  # noqa: E402
from moetune.codegen.pallas_gpu._common import INTERPRET_ENV  # noqa: E402


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "1")


def expected(ids: np.ndarray, w: np.ndarray, E: int, k: int, bm: int) -> tuple[list[np.ndarray], int, int]:
    """(tile_expert, tile_rows, row_pair, row_tok, row_weight), the tiles and the rows they cover."""
    L = routing.layout(len(ids), E, bm)
    nto = L.GT * L.TPP
    counts = [int(np.sum(ids == e)) for e in range(E)]
    tile_expert, tile_rows, first = [], [], []
    for e, c in enumerate(counts):
        first.append(len(tile_rows) * bm)
        for j in range(-(-c // bm)):
            tile_expert.append(e)
            tile_rows.append(min(bm, c - j * bm))
    pad = nto - len(tile_rows)
    tile_expert, tile_rows = tile_expert + [E - 1] * pad, tile_rows + [0] * pad
    rows = nto * bm
    pair, tok, weight = np.zeros(rows, np.int64), np.zeros(rows, np.int64), np.zeros(rows, np.float32)
    placed = [0] * E
    for p, e in enumerate(ids):
        if 0 <= e < E:
            r = first[e] + placed[e]
            placed[e] += 1
            pair[r], tok[r], weight[r] = p, p // k, w[p]
    return [np.array(tile_expert), np.array(tile_rows), pair, tok, weight], nto, rows


def routed(T: int, k: int, E: int, case: str, rng: np.random.Generator) -> np.ndarray:
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    if case == "hot":  # expert 3 in every token: one expert of many tiles
        others = np.array([e for e in range(E) if e != 3])
        ids = np.stack([np.concatenate([[3], rng.permutation(others)[:k - 1]]) for _ in range(T)])
    if case == "few":  # experts past k get no row
        ids = np.stack([rng.permutation(k) for _ in range(T)])
    ids = ids.reshape(-1)
    ids[::7], ids[3::11], ids[5::13] = E, -1, E + 9  # sentinels below 0, at E and beyond
    return ids


CASES = [  # T, k, E, BM, case: one program places the pairs (P ≤ one chunk), then two launches
    (1, 1, 8, 16, "uniform"),
    (7, 2, 8, 16, "few"),
    (13, 3, 40, 16, "hot"),
    (20, 3, 128, 16, "uniform"),  # one placing program, three writing tiles
    (200, 2, 8, 16, "hot"),
    (300, 4, 40, 32, "uniform"),
    (130, 8, 128, 16, "few"),
    (33, 10, 512, 16, "hot"),
]


@pytest.mark.parametrize("T,k,E,bm,case", CASES, ids=[f"T{c[0]}-k{c[1]}-E{c[2]}-bm{c[3]}-{c[4]}" for c in CASES])
def test_the_plan_is_the_stable_counting_sort_into_tiles(T, k, E, bm, case):
    rng = np.random.default_rng(T * 1000 + E)
    ids = routed(T, k, E, case, rng)
    w = rng.random(T * k).astype(np.float32)
    jnp = jax.numpy
    got = jax.jit(lambda i, v: routing.plan(i, v, E, k, bm))(jnp.asarray(ids, jnp.int32), jnp.asarray(w))
    want, nto, rows = expected(ids, w, E, k, bm)
    L = routing.layout(T * k, E, bm)
    assert (L.G > 1) == (T * k > L.C) and L.GT >= L.G
    assert routing.num_tiles(T * k, E, bm) <= nto
    for name, g, x in zip(routing.Plan._fields, got, want, strict=True):
        g = np.asarray(g)
        n = nto if name.startswith("tile") else rows
        np.testing.assert_array_equal(g[:n], x, err_msg=name)
