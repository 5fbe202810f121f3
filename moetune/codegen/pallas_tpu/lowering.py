"""Lowering a Pallas kernel for TPU on any machine, and the grid its traced program launches.

    abstract_args(block, T)               (x [T, D], ids [T, k], weights [T, k], JaxExperts) as
                                          jax.ShapeDtypeStruct at the block's real shape: nothing allocated
    lower(backend, block, schedule, T)    the kind's JAX function built and traced inside `for_tpu()` (Mosaic
                                          TPU kernels, interpret off) → Lowered; the grid of every pallas_call
    lower_fn(fn, args, what)              the same for any JAX function on ShapeDtypeStruct arguments
    grid_calls(traced)                    the pallas_calls of a traced program, each with its grid
    reset_interpret()                     what TPU interpret mode needs after a kernel raised inside it

`lower` runs in two stages, kept apart because they fail for different reasons: tracing (`jit(f).trace`) runs
the kernel's Python (a bug there is the kernel's), and lowering (`.lower(lowering_platforms=("tpu",))`) runs
Mosaic's checks of TPU rules that neither interpret mode applies: block shapes against the (8, 128) tiles,
the operations Mosaic supports. It needs no TPU. It does not check VMEM: the kind's space does, against the
backend's target (`KernelBackend.space(...).admit`, called by `build_jax`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ._common import JaxExperts, for_tpu

_SCALE_DTYPES = {"float32": "float32", "ue8m0": "float8_e8m0fnu"}  # as moetune.codegen.quant stores them


@dataclass(frozen=True)
class GridCall:
    """One pallas_call of a traced program: its grid, whether its leading axis is parallel (split over the
    chip's TensorCores), and how many times the program runs it (a scan around it)."""

    name: str
    grid: tuple[int, ...]
    parallel: bool
    times: int = 1

    def steps_per_core(self, cores: int) -> int:
        """Grid steps one TensorCore runs: the leading axis divided over `cores` when it is parallel."""
        if not self.grid:
            return self.times
        lead = math.ceil(self.grid[0] / cores) if self.parallel else self.grid[0]
        return self.times * lead * math.prod(self.grid[1:])


class LoweringRefused(UnsupportedSchedule):
    """Mosaic's TPU lowering refused a kernel that traced (a block shape off the TPU tiles, an unsupported
    operation): the candidate cannot run on a TPU."""


class TraceFailed(Exception):
    """The kernel's own Python raised while being traced at the real shape; carries the original error."""

    def __init__(self, error: BaseException):
        self.error = error
        super().__init__(f"{type(error).__name__}: {error}")


@dataclass(frozen=True)
class Lowered:
    calls: tuple[GridCall, ...]
    text_bytes: int  # size of the lowered module's text: that it exists is the point


def abstract_args(block: MoEBlock, tokens: int) -> tuple:
    """(x, ids, weights, JaxExperts) as jax.ShapeDtypeStruct: the block's layout and weight format, T tokens."""
    import jax
    import jax.numpy as jnp

    def sds(shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))

    fmt, lay = block.weight_format, block.layout
    act = fmt.compute_dtype
    wdt = "float8_e4m3fn" if fmt.quantized else block.weight_dtype
    gu = sds(lay.gate_up_shape(block.E, block.D, block.F), wdt)  # [E, 2F, D] or [E, D, 2F]
    dn = sds(lay.down_shape(block.E, block.D, block.F), wdt)  # [E, D, F] or [E, F, D]
    gub = sds((block.E, 2 * block.F), act) if lay.has_bias else None  # [E, 2F]
    dnb = sds((block.E, block.D), act) if lay.has_bias else None  # [E, D]
    gus = dns = None
    if fmt.quantized:
        r, c = fmt.block
        sdt = _SCALE_DTYPES[fmt.scale_dtype]
        gus = sds((block.E, -(-2 * block.F // r), -(-block.D // c)), sdt)  # [E, 2F/r, D/c]
        dns = sds((block.E, -(-block.D // r), -(-block.F // c)), sdt)  # [E, D/r, F/c]
    x = sds((tokens, block.D), act)  # [T, D]
    ids = sds((tokens, block.k), "int32")  # [T, k]
    wts = sds((tokens, block.k), block.routing_weight_dtype)  # [T, k]
    return x, ids, wts, JaxExperts(gu, dn, gub, dnb, gus, dns)


def lower(backend, block: MoEBlock, schedule: Schedule, tokens: int) -> Lowered:
    """Build `schedule`'s JAX function with `backend` (its target's limits), trace it at T = `tokens` on the
    block's real shape and lower it for TPU, interpret off. UnsupportedSchedule where the backend refuses it,
    TraceFailed where the kernel's Python raises, LoweringRefused where Mosaic refuses it."""
    with for_tpu():
        fn = backend.build_jax(block, schedule)  # UnsupportedSchedule passes through
        return lower_fn(fn, abstract_args(block, tokens), f"{schedule.describe()} at T={tokens}")


def lower_fn(fn, args: tuple, what: str) -> Lowered:
    """Trace the JAX function `fn` on `args` (ShapeDtypeStructs) and lower it for TPU (`lower`; `what` names it
    in errors)."""
    import jax

    try:
        traced = jax.jit(fn).trace(*args)
    except UnsupportedSchedule:
        raise
    except Exception as e:  # noqa: BLE001 - the kernel's bug: the caller decides (strict, keep_going)
        raise TraceFailed(e) from e
    calls = grid_calls(traced)
    try:
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
    except Exception as e:  # noqa: BLE001 - every Mosaic refusal is this candidate's, whatever its type
        first = " ".join(str(e).split())[:300]
        raise LoweringRefused(f"{what}: TPU lowering refused it ({type(e).__name__}: {first})") from e
    if not calls:
        raise UnsupportedSchedule(f"{what}: the program has no pallas_call (nothing to lower for TPU)")
    return Lowered(calls, len(text))


def grid_calls(traced) -> tuple[GridCall, ...]:
    """Every pallas_call of a traced program (`jax.jit(f).trace(...)`) with its static grid."""
    return tuple(_grid_calls(traced.jaxpr.jaxpr, 1))


def _sub_jaxprs(value):
    from jax.extend.core import ClosedJaxpr, Jaxpr

    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _sub_jaxprs(v)


def _grid_calls(jaxpr, times: int):
    """Every pallas_call under `jaxpr` (through jit, cond, scan ... bodies; a scan's body counted `length`
    times, a while loop's once) with its static grid."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield _grid_call(eqn, times)
            continue
        inner = times * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else times
        for v in eqn.params.values():
            for sub in _sub_jaxprs(v):
                yield from _grid_calls(sub, inner)


def _grid_call(eqn, times: int) -> GridCall:
    """A pallas_call's grid. A dynamic axis (its size computed at run time from the routing) is counted at its
    bound, the most steps it can take: the length of the call's first scalar-prefetch array, which by the
    convention of this package's kernels is the per-step metadata the axis walks (grouped_gemm's tile →
    expert map, sized by the bound on the real tiles)."""
    name = str(eqn.params.get("name") or "pallas_call")
    gm = eqn.params["grid_mapping"]
    grid = tuple(gm.grid)
    if any(not isinstance(g, int) for g in grid):
        ndyn = getattr(gm, "num_dynamic_grid_bounds", 0)
        index = eqn.invars[ndyn:ndyn + gm.num_index_operands]
        first = getattr(index[0].aval, "shape", ()) if index else ()
        if len(first) != 1:
            raise UnsupportedSchedule(f"pallas_call {name}: grid {grid} has a dynamic axis and no scalar-prefetch "
                                      "array of its steps leads its operands; the cost model cannot count them")
        grid = tuple(g if isinstance(g, int) else int(first[0]) for g in grid)
    cp = eqn.params.get("compiler_params")
    if isinstance(cp, dict):
        cp = next(iter(cp.values()), None)
    sem = tuple(getattr(cp, "dimension_semantics", None) or ())
    parallel = bool(sem) and "parallel" in str(sem[0]).lower()
    return GridCall(name, grid, parallel, times)


def reset_interpret() -> None:
    """TPU interpret mode keeps state across kernels; after a kernel raised inside it, it must be reset before
    the next kernel runs (jax's pallas tpu reset_tpu_interpret_mode_state)."""
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
