"""The jittable expert block: moetune's schedule for the routed experts of one MoE block, on JAX arrays.

    y = experts(x [T, D], topk_ids [T, k], topk_weights [T, k], gate_up, down, block=…)   # [T, D], x's dtype

The weights are read in place, in the block's layout (transformers': gate_up [E, 2F, D], down [E, D, F];
transposed: [E, D, 2F], [E, F, D]), float8_e4m3fn with their block scales for an fp8_block weight format
(gate_up_scale [E, 2F/r, D/c], down_scale [E, D/r, F/c]), biases for a layout with them. T is the static
shape of x, so the bucket, its schedule and its kernel are chosen while tracing (moetune.jax.dispatch): a
jitted caller retraced at another T runs that T's bucket, and nothing is looked up when the program runs.
Ids outside [0, E) contribute nothing.

The call is wrapped in the named scopes `moetune_experts/<backend>.<kind>` (`moetune_experts/reference` for
the reference): the lowered program's debug information (`jax.jit(f).lower(...).as_text(debug_info=True)`)
names them, which is how a caller sees that moetune's schedule is in a program and which one.
"""

from __future__ import annotations

from ..codegen.pallas_tpu._common import JaxExperts
from ..ir import DTYPES, IRError, MoEBlock, MoetuneError, UnsupportedSchedule
from ..ir.presets import preset
from ..runtime.dispatch import DispatchWarning
from .dispatch import REFERENCE, reference_fn, routes

SCOPE = "moetune_experts"


def as_block(block: MoEBlock | str, x_dtype: str | None = None) -> MoEBlock:
    """`block`, or the preset it names (activations in `x_dtype` where that is a model dtype)."""
    if isinstance(block, MoEBlock):
        return block
    if isinstance(block, str):
        return preset(block, dtype=x_dtype if x_dtype in DTYPES else None)
    raise IRError("moetune.jax.experts", "block", type(block).__name__, "need a MoEBlock or a preset name")


def check(block: MoEBlock, x, ids, weights, w: JaxExperts) -> None:
    """Shapes and dtypes of the call against the block; IRError names the array and both values."""
    import jax.numpy as jnp

    node = f"moetune.jax.experts({block.name or block.signature_hash()})"
    E, k, D, F, lay, fmt = block.E, block.k, block.D, block.F, block.layout, block.weight_format
    if x.ndim != 2 or x.shape[1] != D:
        raise IRError(node, "x", tuple(x.shape), f"need [T, D = {D}]")
    T = x.shape[0]
    if tuple(ids.shape) != (T, k) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise IRError(node, "topk_ids", (tuple(ids.shape), str(ids.dtype)), f"need integer [T = {T}, k = {k}]")
    if tuple(weights.shape) != (T, k):
        raise IRError(node, "topk_weights", tuple(weights.shape), f"need [T = {T}, k = {k}]")
    if str(x.dtype) != fmt.compute_dtype:
        raise IRError(node, "x.dtype", str(x.dtype), f"the block computes in {fmt.compute_dtype}")
    want = {"gate_up": lay.gate_up_shape(E, D, F), "down": lay.down_shape(E, D, F)}
    if lay.has_bias:
        want.update(gate_up_bias=(E, 2 * F), down_bias=(E, D))
    if fmt.quantized:
        r, c = fmt.block
        want.update(gate_up_scale=(E, -(-2 * F // r), -(-D // c)), down_scale=(E, -(-D // r), -(-F // c)))
    for name, shape in want.items():
        a = getattr(w, name)
        if a is None or tuple(a.shape) != shape:
            raise IRError(node, name, None if a is None else tuple(a.shape), f"layout {lay} needs {shape}")
    for name in ("gate_up", "down"):
        if str(getattr(w, name).dtype) != fmt.dtype:
            raise IRError(node, f"{name}.dtype", str(getattr(w, name).dtype), f"the block's weights are {fmt}")
    for name in ("gate_up_bias", "down_bias", "gate_up_scale", "down_scale"):
        if name not in want and getattr(w, name) is not None:
            raise IRError(node, name, tuple(getattr(w, name).shape), f"block {fmt}, layout {lay} has none")


def experts(x, topk_ids, topk_weights, gate_up, down, *, block: MoEBlock | str, table=None,
            backend: str | None = None, target: str | None = None, gate_up_scale=None, down_scale=None,
            gate_up_bias=None, down_bias=None):
    """The routed experts of `block` (module doc): [T, D] in x's dtype.

    block     a MoEBlock, or a preset name (moetune.ir.presets; activations in x's dtype)
    table     a dispatch-table file or an opened moetune.runtime.table.DispatchTable; None: default schedules
    backend   "reference" | "pallas_tpu" | "pallas_gpu" | "triton" | "torch" | None: pallas_tpu on a TPU,
              the GPU default on a GPU, else the reference (moetune.jax.dispatch)
    target    the table's target name; None: the backend's own target (pallas_tpu: its TPU description)
    """
    import jax
    import jax.numpy as jnp

    block = as_block(block, str(x.dtype))
    w = JaxExperts(gate_up, down, gate_up_bias, down_bias, gate_up_scale, down_scale)
    check(block, x, topk_ids, topk_weights, w)
    T = x.shape[0]
    if T == 0:
        return jnp.zeros((0, block.D), x.dtype)
    r = routes(block, table=table, backend=backend, target=target).at(T)
    ids = topk_ids.astype(jnp.int32)
    tag = REFERENCE if r.schedule is None else f"{r.schedule.backend}.{r.schedule.kind}"
    with jax.named_scope(SCOPE):
        try:
            with jax.named_scope(tag):
                return r.fn(x, ids, topk_weights, w)
        except UnsupportedSchedule as e:  # the call's arrays rule the kernel out: the reference, said once
            if r.schedule is None:
                raise
            _refused(block, r, e)
            with jax.named_scope(REFERENCE):
                return reference_fn(block)(x, ids, topk_weights, w)


_SAID: set[tuple] = set()


def _refused(block: MoEBlock, r, err: MoetuneError) -> None:
    import warnings

    key = (block, r.lo, r.schedule)
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(f"{block.name or block.signature_hash()}: bucket {r.label}: {r.schedule.describe()} refused "
                      f"a call: {err}; it runs {REFERENCE}", DispatchWarning, stacklevel=3)
