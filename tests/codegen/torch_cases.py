"""The torch kernel tests' tables: every variant as a Schedule, the cases of routing, sizes, layouts and
dtypes, the problem maker and the check against the float32 reference."""

from __future__ import annotations

import torch

from moetune.codegen.backend import get
from moetune.codegen.quant import quantize_blocks, quantize_gate_up
from moetune.codegen.tensors import ExpertTensors
from moetune.codegen.torch import GatheredParams, GroupedGemmParams, HybridParams, experts_reference, worst_error
from moetune.ir import Activation, MoEBlock, Schedule, WeightFormat, WeightLayout

BACKEND = get("torch")

# every variant, as a Schedule (hybrid's R = 2 so both halves run on the small cases)
VARIANTS = {
    "sorted_gemm/unsort": Schedule(
        "grouped_gemm", backend="torch", params=GroupedGemmParams("sorted_gemm", "unsort_sum")
    ),
    "sorted_gemm/index_add": Schedule(
        "grouped_gemm", backend="torch", params=GroupedGemmParams("sorted_gemm", "index_add")
    ),
    "grouped_mm/unsort": Schedule(
        "grouped_gemm", backend="torch", params=GroupedGemmParams("grouped_mm", "unsort_sum")
    ),
    "grouped_mm/index_add": Schedule(
        "grouped_gemm", backend="torch", params=GroupedGemmParams("grouped_mm", "index_add")
    ),
    "stream_gemv/4": Schedule("stream_gemv", backend="torch", params=GatheredParams(4)),
    "stream_gemv/256": Schedule("stream_gemv", backend="torch", params=GatheredParams(256)),
    "hybrid/sorted": Schedule(
        "hybrid", row_threshold=2, backend="torch", params=HybridParams("sorted_gemm", 4)
    ),
    "hybrid/grouped_mm": Schedule(
        "hybrid", row_threshold=3, backend="torch", params=HybridParams("grouped_mm", 16)
    ),
}

GPT_OSS_ACT = Activation("clamped_swiglu", alpha=1.702, limit=7.0)
GPT_OSS_LAYOUT = WeightLayout(transposed=True, interleaved=True, has_bias=True)


def make_block(E=8, k=2, D=64, F=40, dtype="float32", act=None, layout=None, apply="output",
               fp8=None) -> MoEBlock:
    """A block of the cases; `fp8=(block, scale_dtype)` stores its weights fp8_block (`dtype` computes)."""
    block = _block(E, k, D, F, dtype, act, layout, apply)
    return block if fp8 is None else block.with_weight_format(WeightFormat.fp8_block(fp8[0], fp8[1], dtype))


def _block(E, k, D, F, dtype, act, layout, apply) -> MoEBlock:
    return MoEBlock(
        E=E,
        k=k,
        D=D,
        F=F,
        activation=act or Activation(),
        layout=layout or WeightLayout(),
        weight_dtype=dtype,
        routing_weight_dtype=dtype,
        weight_application=apply,
        name="case",
    )


def make_tensors(block: MoEBlock, seed: int = 0, edit=None) -> ExpertTensors:
    """Random weights in the block's layout and format (fp8_block: quantised by moetune.codegen.quant, then
    `edit(gate_up_q, down_q)` may set FP8 values in place)."""
    g = torch.Generator().manual_seed(seed)
    fmt = block.weight_format
    if fmt.quantized:
        gu = torch.randn(block.E, 2 * block.F, block.D, generator=g) * block.D**-0.5
        dn = torch.randn(block.E, block.D, block.F, generator=g) * block.F**-0.5
        (gq, gs), (dq, ds) = quantize_gate_up(gu, fmt.block, fmt.scale_dtype), quantize_blocks(dn, fmt.block,
                                                                                              fmt.scale_dtype)
        if edit is not None:
            edit(gq, dq)
        return ExpertTensors(gq, dq, gate_up_scale=gs, down_scale=ds)
    dt = getattr(torch, block.weight_dtype)
    lay = block.layout

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    gu = rnd(*lay.gate_up_shape(block.E, block.D, block.F), scale=block.D**-0.5)
    dn = rnd(*lay.down_shape(block.E, block.D, block.F), scale=block.F**-0.5)
    if not lay.has_bias:
        return ExpertTensors(gu, dn)
    return ExpertTensors(gu, dn, rnd(block.E, 2 * block.F, scale=0.1), rnd(block.E, block.D, scale=0.1))


def routing(kind: str, T: int, E: int, k: int, seed: int = 0) -> torch.Tensor:
    """ids [T, k] (distinct per token where possible) for a named routing pattern."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return (
            torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            if T
            else torch.zeros(0, k, dtype=torch.long)
        )
    if (
        kind == "hot"
    ):  # expert 3 takes every token; the other k-1 slots also fixed: experts 0..E-1 mostly idle
        return torch.tensor([[3] + [(3 + j) % E for j in range(1, k)] for _ in range(T)], dtype=torch.long)
    if kind == "one_row":  # every (token, slot) a different expert: one row per active expert (T·k ≤ E)
        return torch.arange(T * k, dtype=torch.long).view(T, k) % E
    if kind == "sentinels":  # expert-parallel style ids outside [0, E)
        ids = routing("uniform", T, E, k, seed)
        ids[::2, 0] = E + 1
        ids[1::3, -1] = -1
        return ids
    raise ValueError(kind)


def run_case(block: MoEBlock, schedule: Schedule, T: int, route: str, seed: int = 0, edit=None):
    w = make_tensors(block, seed, edit)
    w.check(block)
    dt = getattr(torch, block.weight_format.compute_dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, block.D, generator=g).to(dt)
    ids = routing(route, T, block.E, block.k, seed)
    weights = torch.softmax(torch.randn(T, block.k, generator=g), -1).to(dt)
    fn = BACKEND.build(block, schedule)
    out = fn(x, ids, weights, w)
    ref = experts_reference(block, x, ids, weights, w)
    return out, ref


CASES = [
    # name, block kwargs, T, routing
    ("fp32 uniform", dict(), 13, "uniform"),
    ("zero-row experts (k=1, T=3, E=16)", dict(E=16, k=1), 3, "uniform"),
    ("one hot expert takes all", dict(E=8, k=2), 17, "hot"),
    ("one row per expert", dict(E=16, k=4), 4, "one_row"),
    ("k=1", dict(E=4, k=1), 9, "uniform"),
    ("odd sizes D=200 F=72", dict(E=6, k=2, D=200, F=72), 7, "uniform"),
    ("bf16", dict(dtype="bfloat16"), 11, "uniform"),
    ("fp16", dict(dtype="float16"), 11, "uniform"),
    ("gpt-oss layout, clamped swiglu fp32", dict(act=GPT_OSS_ACT, layout=GPT_OSS_LAYOUT), 10, "uniform"),
    (
        "gpt-oss layout, clamped swiglu bf16",
        dict(act=GPT_OSS_ACT, layout=GPT_OSS_LAYOUT, dtype="bfloat16"),
        10,
        "hot",
    ),
    ("transposed only", dict(layout=WeightLayout(transposed=True)), 6, "uniform"),
    (
        "interleaved + bias, standard",
        dict(layout=WeightLayout(interleaved=True, has_bias=True)),
        6,
        "uniform",
    ),
    ("weight on the input", dict(apply="input"), 8, "uniform"),
    ("sentinel ids", dict(), 12, "sentinels"),
    ("T=1", dict(E=16, k=4), 1, "uniform"),
]


def _e4m3_edges(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """e4m3's extremes in experts 3 and 0: ±448, the smallest subnormals (±2^-9), the largest subnormal."""
    edges = torch.tensor([448.0, -448.0, 2.0**-9, -(2.0**-9), 7 * 2.0**-9, 0.0, -0.0, 240.0])
    gate_up[3, :, : edges.numel()] = edges.to(gate_up.dtype)
    down[3, : edges.numel(), 0] = edges.to(down.dtype)
    down[0, 1, :] = torch.tensor(2.0**-9).to(down.dtype)


def _nan_in_expert_5(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    gate_up[5, 7, 3] = torch.tensor(float("nan")).to(gate_up.dtype)


FP8_128 = ((128, 128), "float32")
FP8_32 = ((32, 32), "float32")
# name, block kwargs (fp8=(block, scale dtype)), T, routing, edit of the FP8 values
FP8_CASES = [
    ("fp8 128x128 odd whole blocks D=384 F=640", dict(E=6, D=384, F=640, fp8=FP8_128, dtype="bfloat16"), 9,
     "uniform", None),
    ("fp8 zero-row experts (k=1, T=3, E=16)", dict(E=16, k=1, D=64, F=96, fp8=FP8_32, dtype="bfloat16"), 3,
     "uniform", None),
    ("fp8 one hot expert takes all", dict(D=64, F=96, fp8=FP8_32, dtype="bfloat16"), 17, "hot", None),
    ("fp8 one row per expert", dict(E=16, k=4, D=64, F=96, fp8=FP8_32, dtype="bfloat16"), 4, "one_row", None),
    ("fp8 ue8m0 scales", dict(D=128, F=192, fp8=((64, 64), "ue8m0"), dtype="bfloat16"), 11, "uniform", None),
    ("fp8 non-square blocks, fp32 compute", dict(D=96, F=64, fp8=((16, 32), "float32")), 7, "uniform", None),
    ("fp8 fp16 compute", dict(D=64, F=96, fp8=FP8_32, dtype="float16"), 6, "uniform", None),
    ("fp8 weight on the input", dict(D=64, F=96, fp8=FP8_32, dtype="bfloat16", apply="input"), 8, "uniform",
     None),
    ("fp8 sentinel ids", dict(D=64, F=96, fp8=FP8_32, dtype="bfloat16"), 12, "sentinels", None),
    ("fp8 e4m3 edge values", dict(D=64, F=96, fp8=FP8_32, dtype="bfloat16"), 17, "hot", _e4m3_edges),
    ("fp8 NaN in a weight", dict(D=64, F=96, fp8=FP8_32, dtype="bfloat16"), 13, "uniform", _nan_in_expert_5),
]


def check_fp8_against_reference(case, variant: str) -> None:
    """One of FP8_CASES under one of VARIANTS: the compute dtype's shape and tolerance against the float32
    reference on the dequantised weights; NaN where (and only where) the reference has NaN."""
    _, kw, T, route, edit = case
    block = make_block(**kw)
    out, ref = run_case(block, VARIANTS[variant], T, route, edit=edit)
    assert out.dtype == getattr(torch, block.weight_format.compute_dtype) and out.shape == (T, block.D)
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    rows = ~nan.any(1)
    assert worst_error(out[rows], ref[rows]) <= 1


def of_kind(kind: str) -> list[str]:
    """The names of the VARIANTS of one kind."""
    return [n for n, s in VARIANTS.items() if s.kind == kind]


def check_against_reference(case, variant: str) -> None:
    """One case of CASES under one of VARIANTS: x's dtype and shape, within tolerances(dtype) of the reference."""
    _, kw, T, route = case
    block = make_block(**kw)
    out, ref = run_case(block, VARIANTS[variant], T, route)
    assert out.dtype == getattr(torch, block.weight_dtype) and out.shape == (T, block.D)
    assert worst_error(out, ref) <= 1
