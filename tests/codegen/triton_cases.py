"""The Triton kernel tests' tables: CI-sized schedules of every kernel path, cases of routing, sizes, layouts
and dtypes, the problem maker and the check against the float32 reference (CPU: TRITON_INTERPRET=1).

Every allocation torch.empty makes during a kernel call is poisoned (NaN for floats, a huge index for
ints: the `poisoned` fixture), so an output element or a workspace row that no kernel wrote fails the check.
"""

from __future__ import annotations

import os

import pytest
import torch

from moetune.codegen.tensors import ExpertTensors
from moetune.codegen.torch.reference import experts_reference
from moetune.codegen.torch.tolerance import worst_error
from moetune.codegen.triton import BACKEND, FusedGemvParams, GemmParams, GemvParams, HybridParams
from moetune.ir import Activation, MoEBlock, Schedule, UnsupportedSchedule, WeightLayout

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEV = "cuda" if ON_GPU else "cpu"


def within(out, ref) -> bool:
    """The one tolerance (moetune.codegen.torch.tolerance): on the GPU a float32 tl.dot runs in TF32."""
    return worst_error(out, ref, tf32=ON_GPU) <= 1


# Schedules with CI-sized tiles: every kernel path (fused / routed GEMV, rows 1 / 2 / 16 per weight read,
# token / expert down with split K, grouped GEMM, hybrid with its GEMV rows path RP = 1 and 4).
SCHEDULES = {
    "gemv_fused_token": Schedule("stream_gemv", backend="triton", params=GemvParams(
        block_n=16, block_k=64, down_block_n=16, down_block_k=32)),
    "gemv_routed_expert_split": Schedule("stream_gemv", backend="triton", params=GemvParams(
        block_n=16, block_k=64, down_block_n=32, down_block_k=32, down_mode="expert", split_k=2,
        fused_route=False)),
    "gemv_rows2": Schedule("stream_gemv", backend="triton", params=GemvParams(
        rows=2, block_n=16, block_k=64, down_block_n=32, down_block_k=64, down_mode="expert")),
    "gemv_rows16_dot": Schedule("stream_gemv", backend="triton", params=GemvParams(
        rows=16, block_n=32, block_k=64, down_block_n=64, down_block_k=64, down_mode="expert",
        fused_route=False)),
    "gemm_m16": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=16, block_n=32, block_k=64, group_m=2, down_block_n=64, down_block_k=64)),
    "gemm_m32": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=32, block_n=64, block_k=64, group_m=1, down_block_n=64, down_block_k=64)),
    "gemm_m32_one_dot": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=32, block_n=32, block_k=64, group_m=4, down_block_n=64, down_block_k=64, one_dot=True)),
    "gemm_m16_split2": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=16, block_n=32, block_k=64, group_m=2, down_block_n=32, down_block_k=16, split_k=2)),
    "gemm_m16_tma": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=16, block_n=32, block_k=32, group_m=2, down_block_n=32, down_block_k=32, tma=True)),
    "gemm_m32_tma_split2": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=32, block_n=16, block_k=64, group_m=1, down_block_n=64, down_block_k=16, split_k=2, tma=True)),
    "gemm_m32_tma_one_dot": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=32, block_n=16, block_k=32, group_m=2, down_block_n=32, down_block_k=32, tma=True, one_dot=True)),
    "gemm_m16_y_half": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=16, block_n=32, block_k=64, group_m=2, down_block_n=32, down_block_k=16, split_k=2, y_half=True)),
    "gemm_m32_tma_y_half": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=32, block_n=16, block_k=64, group_m=1, down_block_n=64, down_block_k=16, tma=True, y_half=True)),
    # down_nb: D-blocks per down program in one flattened loop (the last program's blocks partly past D at
    # D = 200, the last K chunk partial at F = 48 / 72)
    "gemv_fused_token_nb2": Schedule("stream_gemv", backend="triton", params=GemvParams(
        block_n=16, block_k=64, down_block_n=16, down_block_k=32, down_nb=2)),
    "gemm_m16_nb2": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=16, block_n=32, block_k=64, group_m=2, down_block_n=16, down_block_k=32, down_nb=2)),
    "gemm_m16_split2_nb4": Schedule("grouped_gemm", backend="triton", params=GemmParams(
        block_m=16, block_n=32, block_k=32, group_m=2, down_block_n=16, down_block_k=16, split_k=2, down_nb=4)),
    "hybrid_r2": Schedule("hybrid", row_threshold=2, backend="triton", params=HybridParams(
        block_m=16, block_n=32, block_k=64, gemv_block_n=16, gemv_block_k=64, down_block_n=64,
        down_block_k=64, down_gemv_block_n=32, down_gemv_block_k=64)),
    "hybrid_r5": Schedule("hybrid", row_threshold=5, backend="triton", params=HybridParams(
        block_m=16, block_n=32, block_k=64, gemv_block_n=16, gemv_block_k=64, down_block_n=64,
        down_block_k=64, down_gemv_block_n=32, down_gemv_block_k=64)),
    # one launch: gate/up items of 16 F rows, down items of 16 D rows (the last partly past D = 200, F = 72),
    # the down's L2 requests on; and small items with them off and a programmatic launch
    "fused_gemv": Schedule("fused_gemv", backend="triton", params=FusedGemvParams(
        block_f=16, block_k=64, block_d=16, down_block_k=32, prefetch=True)),
    "fused_gemv_small": Schedule("fused_gemv", backend="triton", params=FusedGemvParams(
        block_f=8, block_k=32, block_d=4, down_block_k=16, num_warps=2, prefetch=False, pdl=True)),
}


def make_ids(kind: str, T: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """ids [T, k]: distinct experts per token, routed per `kind`."""
    if kind == "uniform":
        return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    if kind == "zero_rows":  # only the first k + 1 experts ever chosen: the rest have m_e = 0
        return torch.stack([torch.randperm(k + 1, generator=gen)[:k] for _ in range(T)])
    if kind == "one_hot_expert":  # expert 3 in every token: one expert takes T rows
        rest = [torch.randperm(E - 1, generator=gen)[: k - 1] for _ in range(T)]
        return torch.stack([torch.cat([torch.tensor([3]), r + (r >= 3).long()]) for r in rest])
    if kind == "one_row_per_expert":  # T·k = E: each expert exactly one row
        return torch.randperm(E, generator=gen)[: T * k].view(T, k)
    if kind == "sentinel":  # expert-parallel sentinels outside [0, E) contribute nothing
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        ids[0, 0] = E
        ids[-1, -1] = -1
        return ids
    raise ValueError(kind)


CASES = [  # name, E, k, D, F, T, routing, dtype, block overrides
    ("uniform_fp32", 8, 2, 64, 48, 5, "uniform", torch.float32, {}),
    ("zero_row_experts", 8, 2, 64, 48, 6, "zero_rows", torch.float32, {}),
    ("one_expert_every_row", 6, 2, 64, 48, 7, "one_hot_expert", torch.float32, {}),
    ("one_row_per_expert", 8, 2, 64, 48, 4, "one_row_per_expert", torch.float32, {}),
    ("k1", 4, 1, 64, 48, 6, "uniform", torch.float32, {}),
    ("odd_sizes", 5, 2, 200, 72, 3, "uniform", torch.float32, {}),
    ("fp16", 8, 2, 64, 48, 5, "uniform", torch.float16, {}),
    ("sentinel_ids", 8, 2, 64, 48, 4, "sentinel", torch.float32, {}),
    ("gpt_oss_layout", 4, 2, 64, 48, 4, "uniform", torch.float32, dict(
        layout=WeightLayout(transposed=True, interleaved=True, has_bias=True),
        activation=Activation("clamped_swiglu", alpha=1.702, limit=7.0))),
    ("weight_on_input", 6, 2, 64, 48, 4, "uniform", torch.float32, dict(weight_application="input")),
]


def make_problem(E, k, D, F, T, kind, dtype, overrides, seed=0):
    gen = torch.Generator().manual_seed(seed)
    wdt = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    block = MoEBlock(E=E, k=k, D=D, F=F, weight_dtype=wdt, routing_weight_dtype=wdt, **overrides)
    lay = block.layout

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)

    bias = lay.has_bias
    w = ExpertTensors(rnd(*lay.gate_up_shape(E, D, F), scale=D**-0.5),
                      rnd(*lay.down_shape(E, D, F), scale=F**-0.5),
                      rnd(E, 2 * F, scale=0.1) if bias else None, rnd(E, D, scale=0.1) if bias else None)
    x = rnd(T, D, scale=1.0)
    ids = make_ids(kind, T, E, k, gen).to(DEV)
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1).to(dtype).to(DEV)
    return block, x, ids, weights, w


def of_kind(kind: str) -> list[str]:
    """The names of the SCHEDULES of one kind."""
    return [n for n, s in SCHEDULES.items() if s.kind == kind]


def check_against_reference(case, sched: str, poisoned: list) -> None:
    """One case of CASES under one of SCHEDULES: the output matches the float32 reference, every element
    is written (torch.empty poisoned, conftest.py) and the workspace stays O(T·k·(F + D) + E)."""
    name, E, k, D, F, T, kind, dtype, overrides = case
    block, x, ids, weights, w = make_problem(E, k, D, F, T, kind, dtype, overrides)
    tma = getattr(SCHEDULES[sched].params, "tma", False)
    if tma and block.layout.transposed:
        with pytest.raises(UnsupportedSchedule, match="standard layout only"):
            BACKEND.build(block, SCHEDULES[sched])
        return
    fn = BACKEND.build(block, SCHEDULES[sched])
    out = fn(x, ids, weights, w)
    ref = experts_reference(block, x, ids, weights, w)
    assert out.shape == (T, D) and out.dtype == x.dtype
    assert torch.isfinite(out).all(), f"{name}/{sched}: unwritten (NaN) output elements"
    assert within(out, ref), f"{name}/{sched}: worst error {worst_error(out, ref, tf32=ON_GPU):.2f}× the tolerance"
    # workspace O(T·k·(F + D) + E): h [P, F], y [S ≤ 2, P, D] fp32, (tma: xs [P, D]), counts, order,
    # histograms
    P = T * k
    bound = 4 * (P * F + (3 if tma else 2) * P * D + T * D + 2 * P) + 4 * 64 * max(16, E) + 4 * E
    assert sum(poisoned) <= bound, f"{name}/{sched}: {sum(poisoned)} bytes allocated, bound {bound}"
