"""Lowering Pallas kernels for TPU on CPU: interpret off inside for_tpu(), the grid of every pallas_call read
from the traced program (parallel leading axes, scans), Mosaic's refusals as LoweringRefused, the abstract
arguments in every layout and format, and the backend's own kernels lowered for each TPU target."""

from __future__ import annotations

import functools

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from moetune.codegen.backend import for_target  # noqa: E402
from moetune.codegen.pallas_tpu import _common  # noqa: E402
from moetune.codegen.pallas_tpu.lowering import (  # noqa: E402
    GridCall,
    LoweringRefused,
    TraceFailed,
    abstract_args,
    lower,
    lower_fn,
)
from moetune.ir import MoEBlock, UnsupportedSchedule, WeightFormat, WeightLayout  # noqa: E402


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def doubled(x, *, bn: int, semantics: tuple[str, str]):
    """A real two-axis pallas_call over [8, bn] blocks of x."""
    return pl.pallas_call(
        _double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8, x.shape[1] // bn),
        in_specs=[pl.BlockSpec((8, bn), lambda i, j: (i, j))], out_specs=pl.BlockSpec((8, bn), lambda i, j: (i, j)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics), interpret=_common.interpret())(x)


def test_for_tpu_turns_interpret_off_and_restores_it(monkeypatch):
    monkeypatch.setenv(_common.INTERPRET_ENV, "1")
    assert _common.interpret() is not False
    with _common.for_tpu():
        assert _common.interpret() is False
    assert _common.interpret() is not False


def test_the_grid_of_every_pallas_call_including_a_scan_body():
    def program(x):
        y = doubled(x, bn=128, semantics=("parallel", "arbitrary"))  # grid (8, 4)

        def body(c, _):
            return doubled(c, bn=256, semantics=("arbitrary", "arbitrary")), None  # grid (8, 2), 3 times

        return jax.lax.scan(body, y, None, length=3)[0]

    with _common.for_tpu():
        low = lower_fn(program, (jax.ShapeDtypeStruct((64, 512), jnp.float32),), "program")
    par, seq = low.calls
    assert (par.grid, par.parallel, par.times) == ((8, 4), True, 1)
    assert (seq.grid, seq.parallel, seq.times) == ((8, 2), False, 3)
    assert par.steps_per_core(2) == 4 * 4 and par.steps_per_core(1) == 32  # the leading axis over 2 cores
    assert seq.steps_per_core(2) == 3 * 16  # not parallel: one core runs it all, 3 times
    assert low.text_bytes > 0


def test_a_block_shape_off_the_tpu_tiles_is_refused_by_the_lowering_not_by_interpret_mode(monkeypatch):
    monkeypatch.setenv(_common.INTERPRET_ENV, "1")
    fn = functools.partial(doubled, bn=100, semantics=("parallel", "arbitrary"))
    x = jnp.ones((16, 200), jnp.float32)
    assert bool((jax.jit(fn)(x) == 2).all())  # TPU interpret mode runs it
    with _common.for_tpu(), pytest.raises(LoweringRefused, match="TPU lowering refused"):
        lower_fn(fn, (jax.ShapeDtypeStruct((16, 200), jnp.float32),), "bn=100")


def test_a_kernel_that_raises_while_traced_is_a_trace_failure_and_no_pallas_call_is_refused():
    def broken(x):
        raise KeyError("a bug in the kernel's Python")

    with pytest.raises(TraceFailed, match="KeyError"):
        lower_fn(broken, (jax.ShapeDtypeStruct((8, 128), jnp.float32),), "broken")
    with pytest.raises(UnsupportedSchedule, match="no pallas_call"):
        lower_fn(lambda x: x * 2, (jax.ShapeDtypeStruct((8, 128), jnp.float32),), "plain jax")


@pytest.mark.parametrize("block", [
    MoEBlock(E=8, k=2, D=256, F=128, weight_dtype="bfloat16"),
    MoEBlock(E=8, k=2, D=256, F=128, layout=WeightLayout(transposed=True, interleaved=True, has_bias=True),
             weight_dtype="float32", routing_weight_dtype="float32"),
    MoEBlock(E=4, k=2, D=256, F=384, weight_format=WeightFormat.fp8_block(), weight_dtype="float8_e4m3fn"),
], ids=["bf16", "gpt-oss layout fp32", "fp8 block"])
def test_abstract_args_have_the_shapes_and_dtypes_of_the_expert_tensors(block):
    from moetune.search.objective import expert_tensors

    x, ids, wts, w = abstract_args(block, 5)
    real = expert_tensors(block)
    assert x.shape == (5, block.D) and ids.shape == (5, block.k) and ids.dtype == jnp.int32
    assert wts.shape == (5, block.k) and str(wts.dtype) == block.routing_weight_dtype
    for name in ("gate_up", "down", "gate_up_bias", "down_bias", "gate_up_scale", "down_scale"):
        t, a = getattr(real, name), getattr(w, name)
        assert (t is None) == (a is None), name
        if t is not None:
            assert tuple(t.shape) == a.shape and str(t.dtype).removeprefix("torch.") == str(a.dtype), name


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e", "tpu-v7"])
def test_the_backends_kernels_lower_for_every_tpu_target(target):
    block = MoEBlock(E=8, k=2, D=256, F=256, weight_dtype="bfloat16")
    be = for_target("pallas_tpu", target)
    assert be.target.name == target
    kinds = [k for k, why in be.kinds(block).items() if why is None]
    assert kinds
    for kind in kinds:
        low = lower(be, block, be.default(block, kind, 16), 16)
        assert low.calls and all(isinstance(c, GridCall) and c.grid for c in low.calls)


def test_a_dynamic_grid_axis_is_counted_at_the_length_of_its_first_scalar_prefetch_array():
    """A grid whose tile axis is a traced count (the real tiles of a routing) is counted at its bound: the
    per-step metadata the kernel walks, its first scalar-prefetch operand."""

    def kernel(tiles_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] + tiles_ref[pl.program_id(0)].astype(x_ref.dtype)

    def program(tiles, x):
        n = jnp.sum(tiles >= 0).astype(jnp.int32)  # traced: a dynamic grid
        spec = pl.BlockSpec((8, 128), lambda i, t: (t[i], 0))
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(n,), in_specs=[spec],
                                                   out_specs=spec),
            interpret=_common.interpret())(tiles, x)

    with _common.for_tpu():
        low = lower_fn(program, (jax.ShapeDtypeStruct((6,), jnp.int32), jax.ShapeDtypeStruct((48, 128), jnp.float32)),
                       "dynamic grid")
    (call,) = low.calls
    assert call.grid == (6,) and call.steps_per_core(1) == 6
