"""`compile(fn)`: a JAX function with its expert FFN replaced by moetune's schedule; `explain(fn, *args)`: why.

    moe = moetune.jax.compile(layer)        # layer(params, x) written with ragged_dot or w[ids] + einsum
    y = jax.jit(moe)(params, x)             # the same result; the experts run moetune.jax.experts

On each new argument structure and shape, `fn` is traced (jax.make_jaxpr), its equations flattened
(moetune.jax.graph), the expert FFNs found (moetune.jax.capture) and the function re-evaluated equation by
equation with each matched FFN's output computed by moetune.jax.experts from the FFN's own inputs (x, ids,
routing weights, the expert weights as they are) and its equations skipped. Everything else runs as traced.
The block of each FFN is read off its shapes, dtypes and activation constants. A function with no recognised
FFN runs unchanged, with one warning; `explain` names every candidate and why it was or was not replaced.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from .capture import Finding, Match, find
from .experts import experts
from .graph import Graph, Replacement, evaluate, flatten

NOTHING = ("no ragged_dot and no einsum of gathered expert weights: no expert FFN to replace (dense layers "
           "are left as they are)")


@dataclass(frozen=True, eq=False)
class Traced:
    """One trace of a function: its graph, what was found in it, the output structure, the replacements."""

    graph: Graph
    findings: tuple[Finding, ...]
    out_tree: object
    replaced: dict[int, Replacement]
    run: Callable  # run(flat arguments) -> flat outputs


def _call(match: Match, options: dict):
    """fn(x, ids, weights, *expert weights) → the FFN's output through moetune.jax.experts."""
    import jax.numpy as jnp

    block = match.block

    def run(x, ids, wts, *ws):
        *gu, dn = ws
        if len(gu) == 2:  # gate and up apart: [E, D, F] x2 → [E, D, 2F] (or [E, F, D] x2 → [E, 2F, D])
            gu = [jnp.concatenate(gu, axis=2 if block.layout.transposed else 1)]
        return experts(x, ids, wts, gu[0], dn, block=block, **options)

    return run


def trace(fn, args: tuple, kwargs: dict, options: dict | None = None) -> Traced:
    """Trace `fn(*args, **kwargs)` and find its expert FFNs (module doc)."""
    import jax

    closed, shape = jax.make_jaxpr(lambda a, kw: fn(*a, **kw), return_shape=True)(args, kwargs)
    g = flatten(closed)
    findings = tuple(find(g, name=getattr(fn, "__name__", "")))
    replaced = {f.match.out: Replacement(_call(f.match, options or {}), f.match.inputs)
                for f in findings if f.match is not None}
    # One program per trace: called eagerly it compiles once, inside an outer jit it is inlined. The trace's
    # constants (weights a closure captured) are its arguments, not constants of the program.
    program = jax.jit(lambda consts, leaves: evaluate(g, leaves, replaced, consts))
    consts = list(g.consts.values())
    return Traced(g, findings, jax.tree.structure(shape), replaced, lambda leaves: program(consts, list(leaves)))


def _key(leaves) -> tuple:
    import numpy as np

    return tuple((np.shape(x), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


def compile(fn, *, table=None, backend: str | None = None, target: str | None = None):  # noqa: A001
    """`fn` with each recognised expert FFN run by moetune.jax.experts (module doc); `table`, `backend` and
    `target` are moetune.jax.experts'. The result is jittable; it traces `fn` once per argument shape."""
    import jax

    options = {"table": table, "backend": backend, "target": target}
    traces: dict[tuple, Traced] = {}

    @functools.wraps(fn)
    def compiled(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        key = (tree, _key(leaves))
        t = traces.get(key)
        if t is None:
            t = traces[key] = trace(fn, args, kwargs, options)
            if not t.replaced:
                warnings.warn(f"moetune.jax.compile: no expert FFN found in {getattr(fn, '__name__', fn)}; it runs "
                              f"unchanged (moetune.jax.explain(fn, *args) gives the reasons)", stacklevel=2)
        return jax.tree.unflatten(t.out_tree, t.run(leaves))

    return compiled


def explain(fn, *args, print_: bool = True, **kwargs) -> list[Finding]:
    """Every expert-FFN candidate of `fn(*args, **kwargs)`: replaced (with its block) or left, and why."""
    t = trace(fn, args, kwargs)
    name = getattr(fn, "__name__", repr(fn))
    findings = list(t.findings) or [Finding(name, None, NOTHING)]
    lines = [f"{name}: {len(t.replaced)} expert FFN(s) replaced by moetune.jax.experts", *(f"  {f}" for f in findings)]
    if print_:
        print("\n".join(lines))
    return findings
