"""Triton experts kernels against the float32 reference (CPU: TRITON_INTERPRET=1; small shapes, big tiles).

Every allocation torch.empty makes during a kernel call is poisoned (NaN for floats, a huge index for
ints), so an output element or a workspace row that no kernel wrote fails the comparison.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetune.codegen.common import ExpertTensors
from moetune.codegen.torch.reference import experts_reference
from moetune.ir import Activation, MoEBlock, Schedule, UnsupportedSchedule, WeightLayout

triton_backend = pytest.importorskip("moetune.codegen.triton")
from moetune.codegen.triton import (  # noqa: E402
    BACKEND,
    GemmParams,
    GemvParams,
    HybridParams,
    routing,  # noqa: E402
)

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEV = "cuda" if ON_GPU else "cpu"


def tolerances(dtype: torch.dtype) -> float:
    """Bound on ‖out − ref‖ / ‖ref‖ against the float32 reference. On the GPU an fp32 tl.dot runs in tf32:
    two chained tf32 products measured 2.2–2.4e-3 on the H200 (bench/results/nvidia-h200-gpu-tests.log)."""
    return {torch.float32: 5e-3 if ON_GPU else 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}[dtype]


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


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("sched", list(SCHEDULES), ids=list(SCHEDULES))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference(case, sched, poisoned):
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
    err = rel_err(out, ref)
    assert err < tolerances(dtype), f"{name}/{sched}: rel err {err:.2e}"
    # workspace O(T·k·(F + D) + E): h [P, F], y [S ≤ 2, P, D] fp32, (tma: xs [P, D]), counts, order,
    # histograms
    P = T * k
    bound = 4 * (P * F + (3 if tma else 2) * P * D + T * D + 2 * P) + 4 * 64 * max(16, E) + 4 * E
    assert sum(poisoned) <= bound, f"{name}/{sched}: {sum(poisoned)} bytes allocated, bound {bound}"


def test_down_nb_refused_where_it_does_not_run():
    """down_nb > 1: the token-mode GEMV down and the pointer GEMM down only, with the reason."""
    with pytest.raises(UnsupportedSchedule, match="pointer path only"):
        GemmParams(block_m=16, block_n=32, block_k=32, down_block_n=16, tma=True, down_nb=2)
    with pytest.raises(UnsupportedSchedule, match="down_mode='token'"):
        GemvParams(down_mode="expert", down_nb=2)
    with pytest.raises(UnsupportedSchedule, match="1, 2, 4 or 8"):
        GemvParams(down_nb=3)
    # the in-loop store's staging tile counts: 196 KiB of pipeline fits alone, not with 128 KiB more
    GemmParams(block_m=128, block_n=128, down_block_n=256, down_block_k=64, down_warps=8, down_stages=4)
    with pytest.raises(UnsupportedSchedule, match="shared memory"):
        GemmParams(block_m=128, block_n=128, down_block_n=256, down_block_k=64, down_warps=8, down_stages=4,
                   down_nb=2)


@pytest.mark.parametrize("tma", [False, True])
def test_y_half_writes_16_bit_rows(tma, poisoned):
    """GemmParams.y_half: the down GEMM's rows y are x's 16-bit dtype (S·P·D·2 bytes fewer than fp32),
    and the output still matches the float32 reference."""
    E, k, D, F, T = 8, 2, 64, 48, 7
    block, x, ids, weights, w = make_problem(E, k, D, F, T, "uniform", torch.float16, {})
    ref = experts_reference(block, x, ids, weights, w)
    p = GemmParams(block_m=16, block_n=16, block_k=64, group_m=1, down_block_n=32, down_block_k=16,
                   split_k=2, tma=tma)
    used = []
    for half in (False, True):
        poisoned.clear()
        s = Schedule("grouped_gemm", backend="triton", params=dataclasses.replace(p, y_half=half))
        out = BACKEND.build(block, s)(x, ids, weights, w)
        assert rel_err(out, ref) < tolerances(torch.float16)
        used.append(sum(poisoned))
    assert used[0] - used[1] == 2 * T * k * D * 2  # S = 2 planes of [P, D]: 4 → 2 bytes per element


@settings(max_examples=12, deadline=None)
@given(E=st.integers(2, 12), k=st.integers(1, 4), T=st.integers(1, 9), seed=st.integers(0, 2**16),
       sched=st.sampled_from(["gemv_fused_token", "gemv_routed_expert_split", "gemm_m16", "gemm_m16_tma",
                              "hybrid_r2"]))
def test_hypothesis_routing(E, k, T, seed, sched):
    k = min(k, E)
    gen = torch.Generator().manual_seed(seed)
    # skewed routing: experts drawn with random popularity, distinct per token
    pop = torch.rand(E, generator=gen) ** 3 + 1e-3
    ids = torch.stack([torch.multinomial(pop, k, replacement=False, generator=gen) for _ in range(T)])
    block, x, _, weights, w = make_problem(E, k, 64, 48, T, "uniform", torch.float32, {}, seed=seed)
    ids = ids.to(DEV)
    out = BACKEND.build(block, SCHEDULES[sched])(x, ids, weights, w)
    ref = experts_reference(block, x, ids, weights, w)
    assert rel_err(out, ref) < tolerances(torch.float32)


@pytest.mark.parametrize("E,P", [(8, 10), (16, 600), (12, 0 + 300), (512, 2000), (128, 8192)])
def test_routing_counts_and_order(E, P):
    """Device routing = torch's stable sort by expert, single- and multi-program paths."""
    gen = torch.Generator().manual_seed(P)
    ids = torch.randint(-1, E + 1, (P, 1), generator=gen).to(DEV)  # sentinels -1 and E included
    counts, order = routing.route(ids, E)
    flat = ids.view(-1).cpu()
    valid = (flat >= 0) & (flat < E)
    want_counts = torch.bincount(flat[valid], minlength=E)
    assert torch.equal(counts.cpu().long(), want_counts)
    keys = torch.where(valid, flat, E)
    want = torch.sort(keys, stable=True).indices[: int(valid.sum())]
    assert torch.equal(order[: int(valid.sum())].cpu().long(), want)


@pytest.mark.parametrize("bad", [
    lambda: GemmParams(block_m=128, block_n=256, block_k=128, num_stages=4),
    lambda: GemvParams(rows=16, block_n=256, block_k=256, num_stages=4),
    lambda: GemvParams(block_n=24),
    lambda: GemvParams(split_k=2),
    lambda: GemvParams(block_n=64, block_k=1024, num_warps=1),
])
def test_params_refused_with_reason(bad):
    with pytest.raises(UnsupportedSchedule) as exc:
        bad()
    msg = str(exc.value)
    assert "=" in msg and any(w in msg for w in ("KiB", "power of two", "only with", "registers"))


def test_registered_on_import():
    from moetune.codegen import backend

    assert backend.get("triton") is BACKEND and BACKEND.available() is None


def test_wrong_params_type_refused():
    block = MoEBlock(E=4, k=1, D=64, F=48, weight_dtype="float32")
    with pytest.raises(UnsupportedSchedule, match="GemvParams"):
        BACKEND.build(block, Schedule("stream_gemv", backend="triton", params=GemmParams()))


@pytest.mark.parametrize("kind", ["stream_gemv", "grouped_gemm", "hybrid"])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_default_schedule_builds_and_costs(kind, tokens):
    block = MoEBlock(E=128, k=8, D=2048, F=768)
    s = BACKEND.default(block, kind, tokens)
    assert s.kind == kind and s.backend == "triton"
    flops, by = BACKEND.cost(block, s, tokens)
    distinct = 128 * (1 - (1 - 8 / 128) ** tokens)
    assert flops >= 6 * tokens * 8 * 2048 * 768 and by >= distinct * block.weight_bytes_per_expert


@pytest.mark.skipif(not ON_GPU, reason="bf16 numerics need a CUDA GPU (bf16 tl.dot is wrong interpreted)")
@pytest.mark.parametrize("sched", list(SCHEDULES), ids=list(SCHEDULES))
def test_bf16_on_gpu(sched):
    block, x, ids, weights, w = make_problem(16, 4, 256, 192, 24, "uniform", torch.bfloat16, {})
    out = BACKEND.build(block, SCHEDULES[sched])(x, ids, weights, w)
    assert rel_err(out, experts_reference(block, x, ids, weights, w)) < tolerances(torch.bfloat16)


@pytest.mark.parametrize("kind", ["stream_gemv", "grouped_gemm", "hybrid"])
@pytest.mark.parametrize("T", [1, 9])
def test_default_schedule_matches_reference(kind, T, poisoned):
    block, x, ids, weights, w = make_problem(6, 2, 64, 48, T, "uniform", torch.float32, {})
    out = BACKEND.build(block, BACKEND.default(block, kind, T))(x, ids, weights, w)
    assert rel_err(out, experts_reference(block, x, ids, weights, w)) < tolerances(torch.float32)


@pytest.mark.parametrize("sched", ["gemv_routed_expert_split", "gemv_fused_token", "gemm_m16", "hybrid_r2"])
def test_one_kernel_follows_the_weights_it_is_handed(sched):
    """A built kernel keeps per-weights host work between calls (call_args' memo): weights with other
    strides, other values or another dtype, handed to the same kernel in turn, each match the reference,
    and bad shapes are still refused after the good calls."""
    from moetune.ir import IRError

    block, x, ids, weights, w = make_problem(6, 2, 64, 48, 5, "uniform", torch.float32, {})
    fn = BACKEND.build(block, SCHEDULES[sched])

    def restride(t):  # same shape and values, gate_up/down columns strided: other strides
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    _, _, _, _, w_new = make_problem(6, 2, 64, 48, 5, "uniform", torch.float32, {}, seed=1)
    calls = [
        (x, w),
        (x, ExpertTensors(restride(w.gate_up), restride(w.down))),
        (x, w_new),
        (x, w),
        (x.half(), ExpertTensors(w.gate_up.half(), w.down.half())),
    ]
    for i, (xi, wi) in enumerate(calls):
        assert wi.gate_up.stride() == calls[0][1].gate_up.stride() or i == 1
        out = fn(xi, ids, weights.to(xi.dtype), wi)
        err = rel_err(out, experts_reference(block, xi, ids, weights.to(xi.dtype), wi))
        assert err < tolerances(xi.dtype), f"call {i}: rel err {err:.2e}"
    with pytest.raises(IRError, match="gate_up"):
        fn(x, ids, weights, ExpertTensors(w.gate_up[:, :-1], w.down))
    with pytest.raises(UnsupportedSchedule, match="ids"):
        fn(x, ids[:, :1], weights, w)
