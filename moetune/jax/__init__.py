"""moetune's JAX front end: the jittable expert block, and compiling a JAX MoE function onto it.

Importing moetune imports no JAX; importing moetune.jax does.

    import moetune.jax as mj

    y = mj.experts(x, topk_ids, topk_weights, gate_up, down, block=block)       # [T, D], x's dtype
    y = mj.experts(..., block="qwen3-30b-a3b-fp8", gate_up_scale=s1, down_scale=s2, table="cache/tpu-v7.sqlite")

    moe = mj.compile(layer)            # layer(params, x) with its expert FFN run by mj.experts
    y = jax.jit(moe)(params, x)        # same result as layer(params, x)
    mj.explain(layer, params, x)       # each candidate FFN: replaced (with its block) or left, and why

experts (moetune.jax.experts)
    x [T, D], ids [T, k] (any integer dtype; ids outside [0, E) contribute nothing), weights [T, k]; expert
    weights read in place in the block's layout (transformers': gate_up [E, 2F, D], down [E, D, F]; the
    transposed layout [E, D, 2F], [E, F, D]; biases where the layout has them), or float8_e4m3fn with block
    scales [E, 2F/r, D/c], [E, D/r, F/c] for an fp8_block weight format. `block` is a MoEBlock or a preset
    name. T is the static shape of x: the bucket and its schedule are chosen while tracing, so a jitted
    caller runs a fixed kernel per T and nothing is looked up when the program runs.

backends (moetune.jax.dispatch)
    "reference"   the float32 JAX reference (moetune.codegen.pallas_tpu.reference) cast to x's dtype; runs
                  anywhere, no schedule, reads no table
    "pallas_tpu"  the Pallas TPU kernels (`KernelKind.build_jax` of the schedule's kind) on a TPU; elsewhere in
                  TPU interpret mode when MOETUNE_PALLAS_INTERPRET is set, else refused with the reason
    "pallas_gpu"  the Pallas GPU kernels, where that backend is registered (looked up by name when asked)
    "triton"      moetune's Triton kernels (the torch runtime's, with its tuned table entries) at an XLA FFI
                  call on the program's own stream (moetune.jax.xla_call); "torch" the same way
    None          pallas_tpu where JAX sees a TPU; on a GPU the GPU default of moetune.jax.dispatch
                  (DEFAULT_ORDER); else the reference
    Any registered backend whose kinds have a `build_jax` runs its JAX kernels; any other, its torch kernels
    through the XLA FFI.

dispatch table
    `table` is a file or an opened moetune.runtime.table.DispatchTable. The entries read are those of the
    (target, backend, block) that runs: the backend's own name and, unless `target=` names another, the
    backend's target (pallas_tpu: its TPU description). They are judged as in the torch runtime (stale,
    foreign and overlapping entries left out, with the reason); token counts without a usable entry run the
    default schedule of their default bucket (moetune.runtime.default, the pass pipeline's), said in ONE
    DispatchWarning per (block, backend, table, target); entries of other backends are never used, and the
    warning names them. No table: every bucket's default, silently.

compile / explain (moetune.jax.compile, capture, graph)
    The function is traced (jax.make_jaxpr) once per argument shape, its nested jit bodies inlined, and each
    expert FFN found: the ragged_dot form (rows sorted by expert, group sizes, gate/up ragged_dot fused or
    apart, silu(gate)·up, down ragged_dot, unsorted and weighted) or the gather+einsum form (w[ids] per token,
    einsum). The FFN's block is read off the shapes and dtypes; the function is re-evaluated with the FFN's
    output computed by `experts` from the FFN's own inputs, its equations skipped. Gate and up weights given
    apart are joined into one array per call (a copy): store them fused to read them in place. What is not
    recognised (another activation, routing weights applied before the experts, extra inputs between the
    routing and the output) runs as traced; `explain` gives each reason.

marker
    `experts` runs inside the named scopes `moetune_experts/<backend>.<kind>` (`moetune_experts/reference`):
    `jax.jit(f).lower(*args).as_text(debug_info=True)` names them, so a lowered program shows that moetune's
    schedule is in it, and which. The Pallas kernels add their own pallas_call (a custom call on a TPU).
"""

try:
    import jax as _jax  # noqa: F401
except ImportError as e:  # pragma: no cover - the jax extra is not installed
    raise ImportError(f"moetune.jax needs JAX ({e}); pip install 'moetune[jax]'") from e

from .capture import Finding, Match
from .compile import compile, explain
from .dispatch import REFERENCE, jax_backend, route, routes
from .experts import SCOPE, experts

__all__ = ["REFERENCE", "SCOPE", "Finding", "Match", "compile", "experts", "explain", "jax_backend", "route",
           "routes"]
