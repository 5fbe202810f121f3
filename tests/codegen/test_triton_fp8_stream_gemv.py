"""Triton stream_gemv on FP8 block-quantised weights against the float32 reference on the dequantised
weights (CPU: interpreted, small scale blocks to keep it quick); its space, default, cost and refusals;
every sampled configuration compiled for sm_90; on an H200 (MOETUNE_TEST_GPU=1) the preset shapes, eager
and in CUDA-graph replay:

    MOETUNE_TEST_GPU=1 python -m pytest -p no:logging tests/codegen/test_triton_fp8_stream_gemv.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("moetune.codegen.triton")
from triton_cases import DEV, ON_GPU, make_ids  # noqa: E402

from moetune.codegen.quant import E4M3, quantize_blocks, quantize_gate_up  # noqa: E402
from moetune.codegen.tensors import ExpertTensors  # noqa: E402
from moetune.codegen.torch.reference import experts_reference  # noqa: E402
from moetune.codegen.torch.tolerance import worst_error  # noqa: E402
from moetune.codegen.triton import BACKEND, Fp8GemvParams, GemvParams  # noqa: E402
from moetune.codegen.triton.stream_gemv_fp8 import KIND  # noqa: E402
from moetune.ir import Activation, MoEBlock, Schedule, UnsupportedSchedule, WeightFormat  # noqa: E402
from moetune.ir.presets import preset  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402
from moetune.targets import TARGETS  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def sched(**kw) -> Schedule:
    return Schedule("stream_gemv", backend="triton", params=Fp8GemvParams(**kw))


# CI-sized schedules of every path for (32, 32) scale blocks: FMA rows with chunks of two column blocks and
# of half a block, the token / expert downs (split K), the 16-row tl.dot passes fused and routed
SCHEDULES = {
    "fma_token": sched(block_n=16, block_k=64, down_block_n=16, down_block_k=32),
    "fma_expert_split": sched(block_n=32, block_k=16, down_block_n=32, down_block_k=64, down_mode="expert",
                              split_k=2, fused_route=False),
    "dot_expert": sched(rows=16, block_n=32, block_k=32, down_block_n=16, down_block_k=16, down_mode="expert",
                        fused_route=False),
    "dot_fused_token": sched(rows=16, block_n=16, block_k=16, down_block_n=32, down_block_k=32),
    "dot_f16_token": sched(rows=16, block_n=16, block_k=32, down_block_n=8, down_block_k=32, f16_dot=True),
    "dot_f16_expert": sched(rows=16, block_n=32, block_k=32, down_block_n=32, down_block_k=32, down_mode="expert",
                            split_k=2, fused_route=False, f16_dot=True),
    # the token down walking 4 D-blocks per program: at D = 160 (10 blocks of 16) and 96 the last program's
    # blocks partly past D
    "fma_token_nb4": sched(block_n=32, block_k=32, down_block_n=16, down_block_k=16, down_nb=4),
    # the down launched programmatically (interpreted, the launches run in turn: the same dataflow)
    "fma_token_pdl": sched(block_n=16, block_k=64, down_block_n=16, down_block_k=32, down_nb=2, pdl=True),
}

CASES = [  # name, E, k, D, F, T, routing, scale block, scale dtype, compute dtype, block overrides
    ("uniform", 8, 2, 128, 64, 5, "uniform", (32, 32), "float32", "bfloat16", {}),
    ("zero_row_experts", 8, 2, 64, 64, 6, "zero_rows", (32, 32), "float32", "bfloat16", {}),
    ("one_expert_every_row", 6, 2, 64, 64, 7, "one_hot_expert", (32, 32), "float32", "bfloat16", {}),
    ("one_row_per_expert", 8, 2, 64, 64, 4, "one_row_per_expert", (32, 32), "float32", "bfloat16", {}),
    ("k1", 4, 1, 64, 64, 6, "uniform", (32, 32), "float32", "bfloat16", {}),
    ("ue8m0", 8, 2, 96, 64, 5, "uniform", (32, 32), "ue8m0", "bfloat16", {}),
    ("odd_block_counts", 5, 2, 160, 96, 3, "uniform", (32, 32), "float32", "bfloat16", {}),
    ("sentinel_ids", 8, 2, 64, 64, 4, "sentinel", (32, 32), "float32", "bfloat16", {}),
    ("fp16_weight_on_input", 6, 2, 64, 64, 4, "uniform", (32, 32), "float32", "float16",
     dict(weight_application="input")),
    ("clamped_swiglu_fp32", 4, 2, 64, 64, 3, "uniform", (32, 32), "ue8m0", "float32",
     dict(activation=Activation("clamped_swiglu", alpha=1.702, limit=7.0))),
]
CORE = {"uniform", "one_expert_every_row", "ue8m0"}  # every schedule; the rest under the first two


def fp8_block(E, k, D, F, fmt_block=(32, 32), scale_dtype="float32", compute="bfloat16", **overrides):
    return MoEBlock(E=E, k=k, D=D, F=F, routing_weight_dtype=compute, **overrides).with_weight_format(
        WeightFormat.fp8_block(fmt_block, scale_dtype, compute))


def make_problem(E, k, D, F, T, routing, fmt_block, scale_dtype, compute, overrides, seed=0):
    block = fp8_block(E, k, D, F, fmt_block, scale_dtype, compute, **overrides)
    w = expert_tensors(block, DEV, seed)
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, compute)
    x = torch.randn(T, D, generator=gen).to(dt).to(DEV)  # [T, D]
    ids = make_ids(routing, T, E, k, gen).to(DEV)  # [T, k]
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1).to(dt).to(DEV)  # [T, k]
    return block, x, ids, weights, w


def within(out, ref) -> bool:
    return worst_error(out, ref, tf32=ON_GPU) <= 1


def check(block, x, ids, weights, w, schedule, what: str) -> torch.Tensor:
    out = BACKEND.build(block, schedule)(x, ids, weights, w)
    ref = experts_reference(block, x, ids, weights, w)
    assert out.shape == ref.shape and out.dtype == x.dtype, what
    assert torch.isfinite(out).all(), f"{what}: unwritten (NaN) output elements"
    assert within(out, ref), f"{what}: worst error {worst_error(out, ref, tf32=ON_GPU):.2f}× the tolerance"
    return out


PAIRS = [(c, s) for c in CASES for s in SCHEDULES
         if (c[0] in CORE and s not in ("fma_token_nb4", "dot_f16_expert", "dot_f16_token"))
         or s in ("fma_token", "dot_expert")
         or (s == "dot_f16_token" and c[0] in ("one_row_per_expert", "ue8m0", "sentinel_ids"))
         or (s == "fma_token_nb4" and c[0] in ("odd_block_counts", "ue8m0", "k1"))
         or (s == "dot_f16_expert" and c[0] in ("uniform", "one_expert_every_row", "fp16_weight_on_input"))
         or (s == "fma_token_pdl" and c[0] in ("odd_block_counts", "sentinel_ids", "k1"))]


@pytest.mark.parametrize("case, name", PAIRS, ids=[f"{c[0]}-{s}" for c, s in PAIRS])
def test_against_reference(case, name, poisoned):
    """Every output element written (torch.empty poisoned) and within the dtype's bound of the float32
    reference on the dequantised weights; the workspace stays O(T·k·(F + D) + E)."""
    label, E, k, D, F, T, routing, fb, sd, compute, over = case
    block, x, ids, weights, w = make_problem(E, k, D, F, T, routing, fb, sd, compute, over)
    poisoned.clear()
    check(block, x, ids, weights, w, SCHEDULES[name], f"{label}/{name}")
    P = T * k
    bound = 4 * (P * F + 2 * P * D + T * D + 2 * P) + 4 * 64 * max(16, E) + 4 * E
    assert sum(poisoned) <= bound, f"{label}/{name}: {sum(poisoned)} bytes allocated, bound {bound}"


def test_128_blocks_at_odd_block_counts():
    """The checkpoints' 128 x 128 blocks at D = 384, F = 640 (3 and 5 blocks): the default's long FMA
    chunks (the last one partly past D) and the dot pass with split K."""
    block, x, ids, weights, w = make_problem(3, 1, 384, 640, 2, "uniform", (128, 128), "float32", "bfloat16", {})
    check(block, x, ids, weights, w, BACKEND.default(block, "stream_gemv", 1), "default")
    assert BACKEND.default(block, "stream_gemv", 1).params.block_k == 256
    check(block, x, ids, weights, w, sched(rows=16, block_n=128, block_k=128, down_block_n=64, down_block_k=128,
                                           down_mode="expert", split_k=2), "dot_split")


def edge_weights(block: MoEBlock, seed: int = 0) -> ExpertTensors:
    """FP8 weights at e4m3's edges: every block holds ±448 (the largest finite) and subnormals (2^-9 · m/8),
    scales spread over many octaves from block to block."""
    gen = torch.Generator().manual_seed(seed)
    fb, sd = block.weight_format.block, block.weight_format.scale_dtype

    def mat(E, out, cin, quant):
        w = torch.randn(E, out, cin, generator=gen)
        w *= 2.0 ** torch.randint(-12, 6, (E, out // fb[0], 1, cin // fb[1], 1), generator=gen).float().repeat(
            1, 1, fb[0], 1, fb[1]).reshape(E, out, cin)
        q, s = quant(w, fb, sd)
        q = q.clone()
        q[:, ::7, ::5] = torch.tensor(448.0).to(E4M3)
        q[:, 3::7, 1::5] = torch.tensor(-448.0).to(E4M3)
        q[:, 1::3, 2::3] = (torch.randint(1, 8, q[:, 1::3, 2::3].shape, generator=gen) * 2.0 ** -9).to(E4M3)
        return q, s

    gu, gus = mat(block.E, 2 * block.F, block.D, quantize_gate_up)
    dn, dns = mat(block.E, block.D, block.F, quantize_blocks)
    return ExpertTensors(gu.to(DEV), dn.to(DEV), gate_up_scale=gus.to(DEV), down_scale=dns.to(DEV))


@pytest.mark.parametrize("scale_dtype", ["float32", "ue8m0"])
@pytest.mark.parametrize("name", ["fma_token", "dot_expert"])
def test_e4m3_edge_values(scale_dtype, name):
    """±448, subnormal weights and scales many octaves apart dequantise as the reference does."""
    block, x, ids, weights, _ = make_problem(6, 2, 64, 64, 3, "uniform", (32, 32), scale_dtype, "bfloat16", {})
    w = edge_weights(block)
    assert (w.gate_up.float().abs() == 448).any() and ((w.down.float().abs() < 2 ** -6) & (w.down.float() != 0)).any()
    check(block, x, ids, weights, w, SCHEDULES[name], f"edges/{scale_dtype}/{name}")


@pytest.mark.parametrize("name", ["dot_expert", "dot_f16_expert"])
def test_activation_rows_far_apart_in_scale(name):
    """Rows 2^20 times larger and 2^30 times smaller than the rest (beyond float16's range both ways): each
    token's output within bf16's relative error of its own reference (f16_dot scales each chunk's rows)."""
    block, x, ids, weights, w = make_problem(6, 2, 64, 64, 7, "one_hot_expert", (32, 32), "float32", "bfloat16", {})
    x[0] *= 2.0**20
    x[1] *= 2.0**-30
    out = BACKEND.build(block, SCHEDULES[name])(x, ids, weights, w)
    ref = experts_reference(block, x, ids, weights, w)
    for t in range(3):
        rel = ((out[t].float() - ref[t]).abs().max() / ref[t].abs().max()).item()
        assert rel < 2e-2, f"{name}: token {t} relative error {rel:.2e}"


@settings(max_examples=5, deadline=None)
@given(E=st.integers(2, 8), k=st.integers(1, 3), T=st.integers(1, 5), nd=st.integers(1, 2), nf=st.integers(1, 3),
       fb=st.sampled_from([(16, 16), (16, 32), (32, 16)]), sd=st.sampled_from(["float32", "ue8m0"]),
       seed=st.integers(0, 2**16), name=st.sampled_from(sorted(SCHEDULES)))
def test_hypothesis_shapes_and_routings(E, k, T, nd, nf, fb, sd, seed, name):
    """Skewed routings (experts of random popularity) over small shapes in whole blocks; tiles are fitted
    to the blocks (the space's rule)."""
    k = min(k, E)
    gen = torch.Generator().manual_seed(seed)
    pop = torch.rand(E, generator=gen) ** 3 + 1e-3
    ids = torch.stack([torch.multinomial(pop, k, replacement=False, generator=gen) for _ in range(T)]).to(DEV)
    D, F = 32 * nd, 32 * nf
    block, x, _, weights, w = make_problem(E, k, D, F, T, "uniform", fb, sd, "bfloat16", {}, seed=seed)
    r, c = fb
    p = SCHEDULES[name].params
    fit = dict(block_n=min(p.block_n, r),
               block_k=min(p.block_k, c), down_block_n=min(p.down_block_n, r),
               down_block_k=min(p.down_block_k, c))
    if p.rows >= 16:
        fit = {n: max(16, v) for n, v in fit.items()}
    s = Schedule("stream_gemv", backend="triton", params=BACKEND.space(block, "stream_gemv").make(
        **{**vars(p), **fit}))
    check(block, x, ids, weights, w, s, f"{name} E={E} k={k} T={T} D={D} F={F} {fb} {sd}")


def test_partial_blocks_are_refused_with_the_reason():
    q = fp8_block(8, 2, 200, 128, (128, 128))
    why = BACKEND.kinds(q)["stream_gemv"]
    assert why and "D = 200" in why and "128x128" in why, why
    with pytest.raises(UnsupportedSchedule, match="not a multiple"):
        BACKEND.build(q, Schedule("stream_gemv", backend="triton", params=Fp8GemvParams()))
    assert "F = 96" in BACKEND.kinds(fp8_block(8, 2, 256, 96, (128, 128)))["stream_gemv"]
    assert BACKEND.kinds(fp8_block(8, 2, 256, 128, (128, 128)))["stream_gemv"] is None
    assert BACKEND.kind("stream_gemv", fp8_block(8, 2, 256, 128)) is KIND
    assert KIND.refusal(MoEBlock(E=8, k=2, D=256, F=128)), "unquantised weights are the bf16 kernel's"


@pytest.mark.parametrize("bad, why", [
    (dict(block_n=64, block_k=64), "divide the block rows 32"),
    (dict(block_k=48), "power of two"),
    (dict(block_k=16, rows=16, block_n=16, down_block_n=16, down_block_k=64, down_mode="expert"),
     "down_block_k = 64 must divide"),
    (dict(down_block_k=64), "down_block_k = 64 must divide"),
    (dict(rows=16, block_k=64, block_n=16, down_block_n=16, down_block_k=16), "block_k = 64 must divide"),
    (dict(rows=4), "1 \\(FMA\\) or 16 / 32"),
    (dict(rows=16, block_n=8), "tl.dot tiles need ≥ 16, got block_n = 8"),
    (dict(rows=16, block_n=16, block_k=16, down_mode="expert", down_block_n=8, down_block_k=16), "down_block_n = 8"),
    (dict(split_k=2), "only with"),
    (dict(down_mode="expert", down_nb=2), "down_mode='token'"),
    (dict(down_nb=3), "1, 2, 4 or 8"),
    (dict(f16_dot=True), "only with the tl.dot pass"),
    (dict(block_n=32, block_k=1024, num_warps=4), "registers"),
    (dict(down_mode="fused"), "'token' or 'expert'"),
    (dict(pdl=True, down_mode="expert"), "pdl: only with down_mode='token'"),
])
def test_params_refused_with_reason(bad, why):
    space = BACKEND.space(fp8_block(8, 2, 64, 64, (32, 32)), "stream_gemv")
    with pytest.raises(UnsupportedSchedule, match=why):
        space.make(**bad)


def test_token_down_over_the_registers_is_refused():
    """The token-mode down holds one [BN, BK] accumulator per expert of the token (next_pow2(k) of them)."""
    space = BACKEND.space(fp8_preset("deepseek-v3"), "stream_gemv")
    with pytest.raises(UnsupportedSchedule, match=r"token mode, k = 8\): 512 fp32 accumulator registers"):
        space.make(down_block_n=64, down_block_k=128)
    space.make(down_block_n=64, down_block_k=128, down_mode="expert")
    space.make(down_block_n=16, down_block_k=128)


def test_dot_pass_over_the_targets_shared_memory_is_refused():
    space = BACKEND.space(fp8_block(8, 2, 512, 256, (256, 256)), "stream_gemv")
    with pytest.raises(UnsupportedSchedule, match=r"KiB shared memory, limit 227 KiB on h200; lower block_k"):
        space.make(rows=32, block_n=128, block_k=256, num_stages=5, down_block_n=16, down_block_k=128)
    space.make(rows=32, block_n=128, block_k=256, num_stages=2, down_block_n=16, down_block_k=128)


FP8_PRESETS = ("qwen3-30b-a3b", "qwen3.5-397b-a17b", "deepseek-v3", "mixtral-8x7b")


def fp8_preset(name: str, scale_dtype: str = "float32") -> MoEBlock:
    return preset(name).with_weight_format(WeightFormat.fp8_block(scale_dtype=scale_dtype))


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_default_is_a_point_of_the_space_and_costs_fp8_bytes(name):
    """The default at every token count is a point of the block's space; its bytes count 1-byte weights and
    their scales (about half the bf16 kernel's); FMA rows and the token down at one row per expert, tl.dot
    passes with the expert down beyond."""
    from moetune.passes.policy import rows_per_active

    block = fp8_preset(name)
    bf16 = preset(name)
    space = BACKEND.space(block, "stream_gemv")
    for T in (1, 2, 3, 4, 8, 16, 32, 64, 128, 1024):
        s = BACKEND.default(block, "stream_gemv", T)
        assert isinstance(s.params, Fp8GemvParams)
        for field, values in space.choices:
            assert getattr(s.params, field) in values, (T, field)
        space.admit(s.params)
        assert (s.params.rows == 1) == (rows_per_active(block, T) <= 1.5), T
        assert (s.params.down_mode == "token") == (s.params.rows == 1)
        flops, moved = BACKEND.cost(block, s, T)
        f16, m16 = BACKEND.cost(bf16, BACKEND.default(bf16, "stream_gemv", T), T)
        assert flops == f16 and 0.45 * m16 < moved < 0.6 * m16, (T, moved, m16)
    assert isinstance(BACKEND.default(bf16, "stream_gemv", 1).params, GemvParams)


@pytest.mark.parametrize("fb", [(128, 128), (64, 64), (256, 128), (128, 256), (32, 16), (8, 16)])
def test_default_fits_every_scale_block(fb):
    block = fp8_block(64, 6, 1024, 512, fb)
    space = BACKEND.space(block, "stream_gemv")
    for T in (1, 4, 16, 64, 512):
        p = BACKEND.default(block, "stream_gemv", T).params
        for field, values in space.choices:
            assert getattr(p, field) in values, (fb, T, field)
        space.admit(p)


def test_space_holds_only_block_aligned_tiles():
    sp = BACKEND.space(fp8_block(8, 2, 64, 64, (32, 32)), "stream_gemv")
    ch = dict(sp.choices)
    assert max(ch["block_n"]) == 32 and max(ch["down_block_n"]) == 32 and 1024 in ch["block_k"]
    sp128 = dict(BACKEND.space(fp8_preset("deepseek-v3"), "stream_gemv").choices)
    assert 128 in sp128["block_n"] and {128, 256, 512} <= set(sp128["block_k"])


def test_f16_dot_is_refused_for_float32_activations():
    block = fp8_block(4, 2, 64, 64, (32, 32), compute="float32")
    with pytest.raises(UnsupportedSchedule, match="f16_dot rounds float32 activations"):
        BACKEND.build(block, SCHEDULES["dot_f16_expert"])


def test_strided_weights_are_refused():
    block, x, ids, weights, w = make_problem(4, 2, 64, 64, 2, "uniform", (32, 32), "float32", "bfloat16", {})
    gu = w.gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(UnsupportedSchedule, match="must be contiguous"):
        BACKEND.build(block, SCHEDULES["fma_token"])(x, ids, weights, ExpertTensors(
            gu, w.down, gate_up_scale=w.gate_up_scale, down_scale=w.down_scale))


def _compile(args: list[str]) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    res = subprocess.run([sys.executable, str(HERE / "fp8_gemv_sm90.py"), *args], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_sampled_configs_compile_for_sm_90_and_fit_h200():
    """FP8 presets' defaults (float32 and ue8m0 scales, T = 1 and 64) and a grid of the space compile for
    sm_90: within the H200's shared memory, weight loads through the cp.async pipeline, e4m3 converted in
    registers, tensor-core instructions on the dot path; the defaults without register spills. With pdl the
    gate/up kernel releases the down kernel, which asks L2 for its lines and waits; without, neither."""
    rows = _compile([])
    assert len(rows) >= 20
    pdl = [r for r in rows if r["pdl"]]
    assert len(pdl) == 4, [r["label"] for r in pdl]
    for r in rows:
        down = r["label"].endswith("/down")
        want = (int(down and r["pdl"]), int(down and r["pdl"]), int(not down and r["pdl"]))
        assert (min(r["grid_wait"], 1), min(r["prefetch"], 1), min(r["grid_release"], 1)) == want, r
        assert r["grid_wait"] <= 1 and r["grid_release"] <= 1, r
    limit = TARGETS["h200"].smem_per_block
    for r in rows:
        assert r["shared"] <= limit, f"{r['label']}: {r['shared']} B shared > {limit}"
        assert r["regs"] <= 255, r
        if r["default"]:
            assert r["local"] == 0 and r["spill_bytes"] == 0, f"{r['label']}: register spills {r}"
        assert r["cp_async"] > 0, f"{r['label']}: weight loads not pipelined (no cp.async)"
        assert r["cvt_fp8"] > 0, f"{r['label']}: no e4m3 conversion"
        if r["rows"] >= 16 and r["proj"] != 2:
            assert r["mma"] > 0, f"{r['label']}: no tensor-core instruction"


# ------------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not ON_GPU, reason="FP8 timing shapes and CUDA graphs need a CUDA GPU "
                                             "(MOETUNE_TEST_GPU=1 on the GPU machine)")


@gpu
class TestOnGPU:
    """The FP8 presets' shapes on the GPU: the default and a sample of the space at T = 1, 4, 64, eagerly and
    replayed from a CUDA graph on new inputs."""

    SAMPLE = (dict(block_n=32, block_k=512, num_warps=8, num_stages=3, fused_route=False),
              dict(rows=16, block_n=128, block_k=128, num_warps=8, down_block_n=32, down_block_k=128,
                   down_mode="expert", fused_route=False),
              dict(block_n=8, down_mode="expert", split_k=2, down_block_n=16, down_block_k=256),
              dict(rows=16, block_n=64, block_k=128, down_block_n=64, down_block_k=128, down_mode="expert",
                   fused_route=False, f16_dot=True),
              dict(block_n=16, block_k=256, down_block_n=8, pdl=True),
              dict(block_n=32, block_k=256, down_block_n=4, down_nb=2, pdl=True, fused_route=False))

    weights: dict = {}  # one preset's weights at a time, drawn once for its token counts

    @classmethod
    def cases(cls, block, T, n=2, seed=0):
        from moetune.search.objective import make_cases

        if block.name not in cls.weights:
            cls.weights.clear()
            cls.weights[block.name] = expert_tensors(block, "cuda", seed)
        return make_cases(block, cls.weights[block.name], T, n, torch.Generator().manual_seed(seed))

    @pytest.mark.parametrize("T", [1, 4, 64])
    @pytest.mark.parametrize("name", FP8_PRESETS)
    def test_default_and_sample_eager_and_graph(self, name, T):
        block = fp8_preset(name, "ue8m0" if name == "deepseek-v3" else "float32")
        cases = self.cases(block, T)
        space = BACKEND.space(block, "stream_gemv")
        scheds = [BACKEND.default(block, "stream_gemv", T)] + [
            Schedule("stream_gemv", backend="triton", params=space.make(**kw)) for kw in self.SAMPLE]
        refs = [experts_reference(block, c.x, c.ids, c.weights, c.w) for c in cases]
        for s in scheds:
            fn = BACKEND.build(block, s)
            for c, ref in zip(cases, refs, strict=True):
                out = fn(c.x, c.ids, c.weights, c.w)
                assert within(out, ref), f"{name} T={T} {s.describe()}: {worst_error(out, ref):.2f}"
            c0, c1 = cases
            x, ids, wts = c0.x.clone(), c0.ids.clone(), c0.weights.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(x, ids, wts, c0.w)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = fn(x, ids, wts, c0.w)
            x.copy_(c1.x)
            ids.copy_(c1.ids)
            wts.copy_(c1.weights)
            g.replay()
            torch.cuda.synchronize()
            assert within(out, refs[1]), f"{name} T={T} {s.describe()} graph replay: {worst_error(out, refs[1]):.2f}"

    @pytest.mark.parametrize("name", ["fma_token", "dot_expert"])
    def test_nan_in_a_weight_propagates(self, name):
        """A NaN weight (e4m3 0x7F) makes NaN of every output its expert reaches, as in the reference (the
        interpreter converts it to 480, so this runs on the GPU only)."""
        block, x, ids, weights, w = make_problem(6, 2, 64, 64, 3, "uniform", (32, 32), "float32", "bfloat16", {})
        gu = w.gate_up.clone()
        e = int(ids[0, 0])
        gu.view(torch.uint8)[e, 5, 7] = 0x7F
        w2 = ExpertTensors(gu, w.down, gate_up_scale=w.gate_up_scale, down_scale=w.down_scale)
        out = BACKEND.build(block, SCHEDULES[name])(x, ids, weights, w2)
        ref = experts_reference(block, x, ids, weights, w2)
        assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(ref[0]).all()
