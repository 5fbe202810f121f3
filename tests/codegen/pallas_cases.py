"""The Pallas kernel tests' shared pieces: problems checked against the float32 torch reference (routing
patterns and blocks from torch_cases), and the abstract inputs that lower a kernel for TPU on CPU."""

from __future__ import annotations

import torch
from torch_cases import GPT_OSS_ACT, make_block, make_tensors, routing

from moetune.codegen.backend import get
from moetune.codegen.quant import gate_up_scale_shape, scale_shape
from moetune.codegen.torch import experts_reference, worst_error
from moetune.ir import MoEBlock, Schedule, WeightLayout

BACKEND = get("pallas_tpu")
LOWERED_PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "qwen3.5-397b-a17b", "mixtral-8x7b")
FP8_PRESETS = tuple(f"{n}-fp8" for n in LOWERED_PRESETS)
TARGETS = ("tpu-v5e", "tpu-v6e", "tpu-v7")

# name, block kwargs (torch_cases.make_block; D = F = 256 unless given), T, routing pattern
CASES = [
    ("bf16 uniform odd T", dict(dtype="bfloat16"), 13, "uniform"),
    ("fp32 uniform odd T", dict(), 5, "uniform"),
    ("zero-row experts, k=1", dict(k=1), 5, "uniform"),
    ("one hot expert takes all", dict(dtype="bfloat16"), 13, "hot"),
    ("one row per expert", dict(k=2), 4, "one_row"),
    ("sentinel ids", dict(dtype="bfloat16"), 13, "sentinels"),
    ("transposed", dict(layout=WeightLayout(transposed=True)), 5, "uniform"),
    ("interleaved + bias, clamped swiglu", dict(layout=WeightLayout(interleaved=True, has_bias=True),
                                                act=GPT_OSS_ACT, dtype="bfloat16"), 5, "uniform"),
    ("gpt-oss layout, weight on the input", dict(layout=WeightLayout(transposed=True, interleaved=True,
                                                                     has_bias=True),
                                                 act=GPT_OSS_ACT, apply="input"), 5, "hot"),
    ("bias, weight on the input, bf16", dict(layout=WeightLayout(has_bias=True), apply="input",
                                             dtype="bfloat16"), 5, "uniform"),
]


def case_block(kw: dict) -> MoEBlock:
    return make_block(**{"E": 8, "k": 2, "D": 256, "F": 256, **kw})


def check(block: MoEBlock, schedule: Schedule, T: int, route: str, seed: int = 0, ids=None) -> torch.Tensor:
    """Run `schedule` through the backend's build (the torch bridge of build_jax) on fresh random inputs;
    assert dtype, shape and the dtype's bound against the float32 reference. Returns the output."""
    w = make_tensors(block, seed)
    dt = getattr(torch, block.weight_format.compute_dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, block.D, generator=g).to(dt)
    if ids is None:
        ids = routing(route, T, block.E, block.k, seed)
    weights = torch.softmax(torch.randn(T, block.k, generator=g), -1).to(dt)
    out = BACKEND.build(block, schedule)(x, ids, weights, w)
    ref = experts_reference(block, x, ids, weights, w)
    assert out.dtype == dt and out.shape == (T, block.D)
    err = worst_error(out, ref)
    assert err <= 1.0, f"{schedule.describe()}: worst error {err:.3g} of the {dt} bound"
    return out


def abstract_inputs(block: MoEBlock, T: int):
    """ShapeDtypeStructs of (x, ids, weights, JaxExperts) at the block's real shapes."""
    import jax
    import jax.numpy as jnp

    from moetune.codegen.pallas_tpu._common import JaxExperts

    lay, fmt = block.layout, block.weight_format
    dt, wt = jnp.dtype(fmt.compute_dtype), jnp.dtype(block.weight_dtype)

    def s(*shape, d=dt):
        return jax.ShapeDtypeStruct(shape, d)

    E, D, F = block.E, block.D, block.F
    scales = ((s(E, *gate_up_scale_shape(F, D, fmt.block), d=jnp.float32),
               s(E, *scale_shape(D, F, fmt.block), d=jnp.float32)) if fmt.quantized else (None, None))
    w = JaxExperts(s(*lay.gate_up_shape(E, D, F), d=wt), s(*lay.down_shape(E, D, F), d=wt),
                   s(E, 2 * F) if lay.has_bias else None, s(E, D) if lay.has_bias else None, *scales)
    return s(T, D), s(T, block.k, d=jnp.int32), s(T, block.k), w


def lower_for_tpu(fn, block: MoEBlock, T: int) -> str:
    """The TPU lowering of a JaxExpertsFn built with interpret off (Mosaic's block-shape rules checked)."""
    import jax

    return jax.jit(fn).trace(*abstract_inputs(block, T)).lower(lowering_platforms=("tpu",)).as_text()
