"""The torch kernel tests' tables: every variant as a Schedule, the cases of routing, sizes, layouts and
dtypes, the problem maker and the check against the float32 reference."""

from __future__ import annotations

import torch

from moetune.codegen.backend import get
from moetune.codegen.common import ExpertTensors
from moetune.codegen.torch import GatheredParams, GroupedGemmParams, HybridParams, experts_reference, worst_error
from moetune.ir import Activation, MoEBlock, Schedule, WeightLayout

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


def make_block(E=8, k=2, D=64, F=40, dtype="float32", act=None, layout=None, apply="output") -> MoEBlock:
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


def make_tensors(block: MoEBlock, seed: int = 0) -> ExpertTensors:
    g = torch.Generator().manual_seed(seed)
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


def run_case(block: MoEBlock, schedule: Schedule, T: int, route: str, seed: int = 0):
    w = make_tensors(block, seed)
    dt = getattr(torch, block.weight_dtype)
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
