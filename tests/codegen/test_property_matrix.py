"""One property suite over every backend × schedule kind × weight format (property_cases.py): random E, k, D, F,
T under hostile routings (every token to one expert, every expert exactly once, k = E, an id repeated within a
token's top-k, T = 0, ids at E − 1, sentinel ids), non-contiguous inputs and a NaN or an infinity in x or in an
expert's weights: each example's output has NaN and ±inf where the float32 reference has them and is within the
package's tolerance of it elsewhere. The JAX routes (moetune.jax.experts) the same way. Cells a backend does not
offer are refused by the package with the reason.

Each cell runs its own deterministic stream of examples (no example database); the counts of the cells are
reported at the session's end (tests/conftest.py) and written to .pytest-property-counts.json. On CPU the
Triton kernels run interpreted and the Pallas ones in their interpret modes; with MOETUNE_TEST_GPU=1 on a GPU the
Triton cells run the compiled kernels, many more examples each; MOETUNE_PROPERTY_EXAMPLES multiplies every count.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from property_cases import (
    DTYPES,
    NON_FINITE,
    Problem,
    a8,
    cell_seed,
    check,
    examples,
    group_of,
    interpreted_e4m3_nan,
    jax_cells,
    kernel_cells,
    problems,
    representative,
    run_kernel,
    schedules,
)
from triton_cases import DEV, ON_GPU

from moetune.codegen.backend import get
from moetune.ir import Schedule, UnsupportedSchedule

INTERPRET = ("MOETUNE_PALLAS_INTERPRET", "MOETUNE_PALLAS_GPU_INTERPRET")  # the Pallas backends' interpret switches


@contextlib.contextmanager
def _interpreted() -> Iterator[None]:
    old = {k: os.environ.get(k) for k in INTERPRET}
    for k in INTERPRET:
        os.environ.setdefault(k, "1")
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)


with _interpreted():  # the cells of every backend usable here, the Pallas ones in their interpret modes
    OFFERED, UNOFFERED = kernel_cells()
    JAX = jax_cells()


@pytest.fixture
def interpreted(monkeypatch):
    for k in INTERPRET:
        if not os.environ.get(k):
            monkeypatch.setenv(k, "1")


SETTINGS = settings(database=None, deadline=None, derandomize=False, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def _record(counts: dict, p: Problem, refused: bool = False) -> None:
    def bump(name):
        counts[name] = counts.get(name, 0) + 1

    if refused:
        bump("refused")
        return
    bump("examples")
    bump(f"routing:{p.routing}")
    if p.non_finite:
        bump("non_finite")
    if p.view != "contiguous":
        bump("non_contiguous")
    if p.x.shape[0] == 0:
        bump("empty")


@pytest.mark.parametrize(("backend", "kind", "fmt"), OFFERED, ids=["/".join(c) for c in OFFERED])
def test_kernels_match_the_reference(backend, kind, fmt, interpreted, property_counts):
    cell = f"{backend}/{kind}/{fmt}"
    counts = property_counts.setdefault(cell, {})
    be = get(backend)
    on_device = backend == "triton"  # the Triton kernels run where triton_cases says (interpreted, or on the GPU)

    def accepts(block):
        return be.kinds(block)[kind]

    non_finite = NON_FINITE if fmt in DTYPES or interpreted_e4m3_nan(backend, kind) else tuple(
        n for n in NON_FINITE if n != "nan_weight")

    @seed(cell_seed(cell))
    @settings(SETTINGS, max_examples=examples(backend))
    @given(data=st.data())
    def run(data):
        p = data.draw(problems(backend, fmt, device=DEV if on_device else "cpu", accepts=accepts,
                               non_finite=non_finite), label="problem")
        why = be.kinds(p.block)[kind]
        if why:  # a block of the shape rule the kind refuses (rare): refused at build with the reason
            with pytest.raises(UnsupportedSchedule):
                be.build(p.block, Schedule(kind, row_threshold=2 if kind == "hybrid" else None, backend=backend))
            _record(counts, p, refused=True)
            return
        s = data.draw(schedules(backend, kind, fmt, p.block, p.x.shape[0], sample_space=not ON_GPU),
                      label="schedule")
        try:
            out = run_kernel(backend, s, p)
        except UnsupportedSchedule as e:  # a kernel that reads x's hidden dimension contiguous refuses a view
            if p.view == "contiguous" or "contiguous" not in str(e):
                raise
            _record(counts, p, refused=True)
            return
        check(out, p, group_of(s), tf32=ON_GPU and on_device)
        _record(counts, p)

    run()
    assert counts.get("examples", 0) > 0, f"{cell}: no example ran"


@functools.lru_cache(maxsize=64)
def _jitted(block, backend: str):
    import jax

    import moetune.jax as mj

    def f(x, ids, weights, gu, dn, gus, dns, gub, dnb):
        return mj.experts(x, ids, weights, gu, dn, block=block, backend=backend, gate_up_scale=gus, down_scale=dns,
                          gate_up_bias=gub, down_bias=dnb)

    return jax.jit(f)


@pytest.mark.parametrize(("route", "fmt"), JAX, ids=["/".join(c) for c in JAX])
def test_jax_routes_match_the_reference(route, fmt, interpreted, property_counts):
    import moetune.jax as mj
    from moetune.codegen.pallas_tpu._common import to_jax

    cell = f"{route}/route/{fmt}"
    counts = property_counts.setdefault(cell, {})
    name = route.split("/", 1)[1]
    be = None if name == "reference" else get(name)
    device = DEV if name == "triton" else "cpu"

    def accepts(block):  # the route runs the block where one of its backend's kinds does
        if be is None:
            return None
        kinds = be.kinds(block)
        return None if any(v is None for v in kinds.values()) else "; ".join(kinds.values())

    @seed(cell_seed(cell))
    @settings(SETTINGS, max_examples=examples(route))
    @given(data=st.data())
    def run(data):
        p = data.draw(problems(route, fmt, views=("contiguous",), device=device, accepts=accepts), label="problem")
        T = p.x.shape[0]
        sch = mj.route(p.block, T, backend=name).schedule if T else None
        w = p.w
        args = (p.x, p.ids.to(torch.int32), p.weights, w.gate_up, w.down, w.gate_up_scale, w.down_scale,
                w.gate_up_bias, w.down_bias)
        out = _jitted(p.block, name)(*(to_jax(a) for a in args))
        check(torch.from_dlpack(out), p, group_of(sch), tf32=ON_GPU and name == "triton")
        _record(counts, p)

    run()
    assert counts.get("examples", 0) > 0, f"{cell}: no example ran"


@pytest.mark.parametrize(("backend", "kind", "fmt", "why"), UNOFFERED, ids=["/".join(c[:3]) for c in UNOFFERED])
def test_unoffered_cells_are_refused(backend, kind, fmt, why, interpreted):
    """A cell the matrix leaves out is one the package refuses, saying why: the kind's refusal of the format (its
    scheme, its scale dtype), or, where the format quantises activations and the kind's parameters have no
    activation rule, a schedule with one is refused by the parameter type."""
    be = get(backend)
    block = representative(backend, fmt)
    assert why
    if a8(fmt) and be.kinds(block)[kind] is None:
        from moetune.codegen.triton.grouped_gemm_fp8 import Fp8GemmParams

        group = block.weight_format.block[1]
        w8a8 = Fp8GemmParams(block_n=max(group, 64), act_quant=f"fp8_1x{group}")
        with pytest.raises(UnsupportedSchedule):
            be.build(block, Schedule(kind, row_threshold=2 if kind == "hybrid" else None, backend=backend,
                                     params=w8a8))
        return
    assert be.kinds(block)[kind] == why
    scheme_or_scales = (block.weight_format.scheme, block.weight_format.scale_dtype or "", fmt)
    assert any(s and s in why for s in scheme_or_scales) or "fp8" in why, why
    with pytest.raises(UnsupportedSchedule):
        be.build(block, Schedule(kind, row_threshold=2 if kind == "hybrid" else None, backend=backend))


def test_the_matrix_covers_every_backend_kind_and_format():
    """Every backend usable here is in the matrix with each of its kinds, every format is offered by some kernel,
    and w8a8 by the Triton grouped GEMM; nothing is both offered and refused."""
    offered = {(b, k, f) for b, k, f in OFFERED}
    refused = {(b, k, f) for b, k, f, _ in UNOFFERED}
    assert not offered & refused
    for b, k in {(b, k) for b, k, _ in offered | refused}:
        assert all((b, k, f) in offered | refused for f in {f for _, _, f in offered})
    assert {f for _, _, f in offered} >= {"bf16", "fp16", "f32", "fp8/w8a16/f32", "fp8/w8a16/ue8m0"}
    if any(b == "triton" for b, _, _ in offered):
        assert ("triton", "grouped_gemm", "fp8/w8a8/f32") in offered
        assert {k for b, k, _ in offered if b == "triton"} == {"grouped_gemm", "stream_gemv", "hybrid", "fused_gemv"}
    assert {b for b, _, _ in offered} >= {"torch"}
