"""The Triton backend as a whole: registered on import, its defaults build, cost and match the reference,
a built kernel follows the weights it is handed, skewed routings drawn by hypothesis (CPU: interpreted)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("moetune.codegen.triton")
from triton_cases import DEV, ON_GPU, SCHEDULES, make_problem, within  # noqa: E402

from moetune.codegen.tensors import ExpertTensors  # noqa: E402
from moetune.codegen.torch.reference import experts_reference  # noqa: E402
from moetune.codegen.triton import BACKEND, GemmParams  # noqa: E402
from moetune.ir import MoEBlock, Schedule, UnsupportedSchedule  # noqa: E402


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
    assert within(out, ref)


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
    assert within(out, experts_reference(block, x, ids, weights, w))


@pytest.mark.parametrize("kind", ["stream_gemv", "grouped_gemm", "hybrid"])
@pytest.mark.parametrize("T", [1, 9])
def test_default_schedule_matches_reference(kind, T, poisoned):
    block, x, ids, weights, w = make_problem(6, 2, 64, 48, T, "uniform", torch.float32, {})
    out = BACKEND.build(block, BACKEND.default(block, kind, T))(x, ids, weights, w)
    assert within(out, experts_reference(block, x, ids, weights, w))


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
        assert within(out, experts_reference(block, xi, ids, weights.to(xi.dtype), wi)), f"call {i}"
    with pytest.raises(IRError, match="gate_up"):
        fn(x, ids, weights, ExpertTensors(w.gate_up[:, :-1], w.down))
    with pytest.raises(UnsupportedSchedule, match="ids"):
        fn(x, ids[:, :1], weights, w)


@pytest.mark.parametrize("sched", ["gemv_fused_token", "gemv_rows16_dot", "gemv_routed_expert_split", "gemm_m16",
                                   "hybrid_r2", "fused_gemv"])
@pytest.mark.parametrize("T", [2, 5])
def test_strided_ids_and_weights_of_one_pair_per_token(sched, T):
    """ids and routing weights handed as strided views (every other row of a wider tensor) read as their values:
    at k = 1 their flattened view is strided too, and the kernels index pairs contiguously."""
    block, x, ids, weights, w = make_problem(4, 1, 64, 48, T, "uniform", torch.float32, {}, seed=T)
    want = BACKEND.build(block, SCHEDULES[sched])(x, ids, weights, w)

    def strided(t):
        buf = torch.zeros(2 * T, t.shape[1], dtype=t.dtype, device=t.device)
        buf[::2] = t
        return buf[::2]

    assert not strided(ids).reshape(-1).is_contiguous()
    got = BACKEND.build(block, SCHEDULES[sched])(x, strided(ids), strided(weights), w)
    assert torch.equal(got, want)
    assert within(got, experts_reference(block, x, ids, weights, w))
