"""Triton grouped_gemm on FP8 block-quantised weights (grouped_gemm_fp8.py), w8a16 and w8a8, against the float32
reference on the dequantised weights over a table of cases and skewed random ones (hypothesis) (CPU:
TRITON_INTERPRET=1; fp8 × fp8 tl.dot runs there); the activation quantisation bit for bit against
quant.quantize_rows; e4m3 edge values, ue8m0 scale bytes and non-finite weights; the refusals; a representative
grid compiled for sm_90 (fp8_sm90.py); and, with MOETUNE_TEST_GPU=1 on a GPU, the default and a sample of the
space at the FP8 presets' shapes, eagerly and in CUDA-graph replay."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("moetune.codegen.triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from test_triton_compile import H200_SMEM_LIMIT, _compile  # noqa: E402
from triton_cases import make_ids  # noqa: E402

from moetune.codegen.quant import activation_group, fake_quantize_rows, quantize_rows  # noqa: E402
from moetune.codegen.torch.reference import (  # noqa: E402
    apply_activation,
    expert_matrix,
    experts_reference,
    split_gate_up,
)
from moetune.codegen.torch.tolerance import accuracy, worst_error  # noqa: E402
from moetune.codegen.triton import BACKEND  # noqa: E402
from moetune.codegen.triton._fp8 import _ue8m0  # noqa: E402
from moetune.codegen.triton.grouped_gemm_fp8 import Fp8GemmParams, smem_bytes  # noqa: E402
from moetune.codegen.triton.quant_rows import quant_rows  # noqa: E402
from moetune.ir import MoEBlock, Schedule, UnsupportedSchedule, WeightFormat  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEV = "cuda" if ON_GPU else "cpu"


def fp8_block(E, k, D, F, block=(32, 32), scale_dtype="float32", compute_dtype="bfloat16", **overrides):
    return MoEBlock(E=E, k=k, D=D, F=F, routing_weight_dtype=compute_dtype, **overrides).with_weight_format(
        WeightFormat.fp8_block(block, scale_dtype, compute_dtype))


def inputs(block, T, kind, seed=0):
    """(x [T, D], ids [T, k], weights [T, k]) on DEV, routed per `kind` (triton_cases.make_ids)."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, block.weight_format.compute_dtype)
    x = torch.randn(T, block.D, generator=gen).to(dt).to(DEV)
    ids = make_ids(kind, T, block.E, block.k, gen).to(DEV)
    weights = torch.softmax(torch.randn(T, block.k, generator=gen), -1).to(dt).to(DEV)
    return x, ids, weights


def problem(block, T, kind, seed=0):
    """inputs(...) and the block's FP8 expert tensors (moetune.search.objective.expert_tensors) on DEV."""
    return (*inputs(block, T, kind, seed), expert_tensors(block, DEV, seed))


def schedule(**params) -> Schedule:
    return Schedule("grouped_gemm", backend="triton", params=Fp8GemmParams(**params))


def rel_err(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# CI-sized schedules (32-column blocks: w8a16 K steps of 32 or 16, w8a8 of 32, the least an FP8 tl.dot takes;
# w8a8 groups of the block's 32 columns)
SCHEDULES = {
    "w8a16_m16": dict(block_m=16, block_n=32, block_k=32, group_m=2, down_block_n=32, down_block_k=32),
    "w8a16_m32_exact_split2": dict(block_m=32, block_n=64, block_k=16, group_m=1, down_block_n=64, down_block_k=16,
                                   split_k=2, fold_scale=False),
    "w8a8_m16": dict(block_m=16, block_n=32, block_k=32, group_m=2, down_block_n=32, down_block_k=32,
                     act_quant="fp8_1x32"),
    "w8a8_m32_n64_split2_yhalf_nb2": dict(block_m=32, block_n=64, block_k=32, group_m=4, down_block_n=32,
                                          down_block_k=32, split_k=2, y_half=True, act_quant="fp8_1x32",
                                          down_nb=2),
    "w8a8_on_load_m32": dict(block_m=32, block_n=32, block_k=32, group_m=2, down_block_n=64, down_block_k=32,
                             act_quant="fp8_1x32", quant_on_load=True),
    # a down program over up to 4 column blocks: at D = 64 (two 32-column blocks) its walk ends short
    "w8a16_m16_down_nb4": dict(block_m=16, block_n=32, block_k=32, group_m=2, down_block_n=32, down_block_k=16,
                               down_nb=4),
    "w8a16_m16_tma": dict(block_m=16, block_n=32, block_k=32, group_m=2, down_block_n=32, down_block_k=32, tma=True),
    "w8a16_m16_tma_nb2_split2": dict(block_m=16, block_n=32, block_k=32, group_m=1, down_block_n=32, down_block_k=16,
                                     down_nb=2, split_k=2, tma=True),
    "w8a8_m16_tma_split2_nb2": dict(block_m=16, block_n=32, block_k=32, group_m=1, down_block_n=32,
                                    down_block_k=32, split_k=2, act_quant="fp8_1x32", tma=True, down_nb=2),
    "w8a8_on_load_m32_tma": dict(block_m=32, block_n=32, block_k=32, group_m=2, down_block_n=64, down_block_k=32,
                                 act_quant="fp8_1x32", quant_on_load=True, tma=True),
    # the down GEMM launched programmatically (interpreted, the launches run in turn: the same dataflow)
    "w8a8_m16_pdl": dict(block_m=16, block_n=32, block_k=32, group_m=2, down_block_n=32, down_block_k=32,
                         act_quant="fp8_1x32", pdl=True),
    # h quantised by its own pass: gate/up tiles narrower than a group
    "w8a8_h_pass_n16": dict(block_m=16, block_n=16, block_k=32, group_m=2, down_block_n=32, down_block_k=32,
                            act_quant="fp8_1x32", h_pass=True),
    "w8a8_h_pass_n16_tma_pdl": dict(block_m=16, block_n=16, block_k=32, group_m=1, down_block_n=32, down_block_k=32,
                                    act_quant="fp8_1x32", h_pass=True, tma=True, pdl=True),
}

CASES = [  # name, E, k, D, F, T, routing, block overrides
    ("uniform", 8, 2, 64, 96, 5, "uniform", {}),
    ("zero_row_experts", 8, 2, 64, 64, 6, "zero_rows", {}),
    ("one_expert_every_row", 6, 2, 64, 64, 19, "one_hot_expert", {}),  # 19 rows: two 16-row tiles
    ("one_row_per_expert", 8, 2, 96, 64, 4, "one_row_per_expert", {}),
    ("sentinel_ids", 8, 2, 64, 64, 4, "sentinel", {}),
    ("ue8m0", 8, 2, 64, 96, 5, "uniform", dict(scale_dtype="ue8m0")),
    ("fp16", 4, 2, 64, 64, 5, "uniform", dict(compute_dtype="float16")),
    ("weight_on_input", 6, 2, 64, 64, 4, "uniform", dict(weight_application="input")),
    ("block_64x32", 4, 2, 128, 128, 5, "uniform", dict(block=(64, 32))),
]


def reference(block, x, ids, weights, w, params) -> torch.Tensor:
    """The float32 reference a schedule of `params` is checked against: a w8a8 one's on its rounded activations."""
    return experts_reference(block, x, ids, weights, w, activation_group(params))


def _check(out, ref, a8: bool, name: str) -> None:
    assert torch.isfinite(out).all(), f"{name}: unwritten (NaN) or non-finite output elements"
    err = worst_error(out, ref, a8=a8, tf32=ON_GPU)
    assert err <= 1, f"{name}: worst error {err:.2f}× the tolerance"


# each case under one w8a16 and one w8a8 schedule, each taken in turn down the table
W8A16 = [n for n in SCHEDULES if n.startswith("w8a16")]
W8A8 = [n for n in SCHEDULES if n.startswith("w8a8")]
PAIRS = [(c, s) for i, c in enumerate(CASES) for s in (W8A16[i % len(W8A16)], W8A8[i % len(W8A8)])]


def case_params(block: MoEBlock, sched: str) -> dict:
    """SCHEDULES[sched] fitted to the block's scale block: a w8a8 group is the block's columns."""
    params = dict(SCHEDULES[sched])
    c = block.weight_format.block[1]
    if c != 32 and "act_quant" in params:
        params["act_quant"] = f"fp8_1x{c}"
        params["block_n"] = max(params["block_n"], c)
        if params.get("quant_on_load"):
            params["block_k"] = params["down_block_k"] = c
    return params


@settings(max_examples=12, deadline=None)
@given(E=st.integers(2, 8), k=st.integers(1, 3), T=st.integers(1, 24), nd=st.integers(1, 3), nf=st.integers(1, 3),
       sd=st.sampled_from(["float32", "ue8m0"]), seed=st.integers(0, 2**16), sched=st.sampled_from(sorted(SCHEDULES)))
def test_hypothesis_shapes_and_routings(E, k, T, nd, nf, sd, seed, sched):
    """Skewed routings (experts of random popularity, so some take many rows over several tiles and some none)
    over small shapes in whole 32×32 blocks, under any of the table's schedules that takes the shape (the others
    refuse it with the reason, as the space does)."""
    k = min(k, E)
    gen = torch.Generator().manual_seed(seed)
    pop = torch.rand(E, generator=gen) ** 3 + 1e-3
    ids = torch.stack([torch.multinomial(pop, k, replacement=False, generator=gen) for _ in range(T)]).to(DEV)
    block = fp8_block(E, k, 32 * nd, 32 * nf, scale_dtype=sd)
    x, _, weights, w = problem(block, T, "uniform", seed=seed)
    s = schedule(**SCHEDULES[sched])
    try:
        fn = BACKEND.build(block, s)
    except UnsupportedSchedule as e:
        assert str(e), sched
        return
    ref = reference(block, x, ids, weights, w, s.params)
    _check(fn(x, ids, weights, w), ref, s.params.act_quant != "none",
           f"{sched} E={E} k={k} T={T} D={block.D} F={block.F} {sd}")


def test_case_schedules_are_valid_compiled(monkeypatch):
    """Every (case, schedule) pair the table runs is a schedule the compiled kernels take, so the same table runs
    on the GPU: the interpreter admits smaller blocks than an sm_90 tl.dot does."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for (_, E, k, D, F, _, _, over), sched in PAIRS:
        schedule(**case_params(fp8_block(E, k, D, F, **over), sched))  # raises UnsupportedSchedule if not


@pytest.mark.parametrize(("case", "sched"), PAIRS, ids=[f"{c[0]}-{s}" for c, s in PAIRS])
def test_against_reference(case, sched, poisoned):
    """Every case matches the float32 reference on the dequantised weights (w8a8 within the a8 tolerance)
    under a w8a16 and a w8a8 schedule, every output element is written (torch.empty poisoned) and the
    workspace is O(T·k·(F + D) + E)."""
    name, E, k, D, F, T, kind, over = case
    block = fp8_block(E, k, D, F, **over)
    s = schedule(**case_params(block, sched))
    x, ids, weights, w = problem(block, T, kind)
    ref = reference(block, x, ids, weights, w, s.params)
    poisoned.clear()
    out = BACKEND.build(block, s)(x, ids, weights, w)
    assert out.shape == (T, D) and out.dtype == x.dtype
    _check(out, ref, s.params.act_quant != "none", f"{name}/{sched}")
    P = T * k  # h, y (≤ 2 planes), the sorted copy of x (tma), x quantised, scales, counts, order, histograms
    bound = 4 * (P * F + 3 * P * D + T * D + 2 * P + P * F // 16 + T * D // 16) + 4 * 64 * max(16, E) + 4 * E
    assert sum(poisoned) <= bound, f"{name}/{sched}: {sum(poisoned)} bytes allocated, bound {bound}"


# K steps of two or four 32-column scale blocks (dot_k): each dot its own scales, the step's loads together
WIDE_K = {
    "w8a8_k64": dict(block_m=16, block_n=32, block_k=64, group_m=2, down_block_n=32, down_block_k=128,
                     act_quant="fp8_1x32"),
    "w8a16_k128_split2": dict(block_m=32, block_n=32, block_k=128, down_block_n=64, down_block_k=64, split_k=2),
    "w8a8_k128_tma_split2": dict(block_m=16, block_n=32, block_k=128, group_m=1, down_block_n=32, down_block_k=64,
                                 split_k=2, act_quant="fp8_1x32", tma=True, y_half=True),
    "w8a16_k64_tma_exact": dict(block_m=16, block_n=32, block_k=64, down_block_n=32, down_block_k=128, tma=True,
                                fold_scale=False),
    "w8a8_on_load_k64": dict(block_m=32, block_n=32, block_k=64, down_block_n=32, down_block_k=128,
                             act_quant="fp8_1x32", quant_on_load=True),
    "w8a8_on_load_k128_tma": dict(block_m=16, block_n=32, block_k=128, down_block_n=64, down_block_k=64,
                                  act_quant="fp8_1x32", quant_on_load=True, tma=True),
    "w8a8_h_pass_n16_k64_tma": dict(block_m=16, block_n=16, block_k=64, down_block_n=32, down_block_k=64,
                                    act_quant="fp8_1x32", h_pass=True, tma=True),
}


@pytest.mark.parametrize("sched", list(WIDE_K))
@pytest.mark.parametrize("kind", ["uniform", "zero_rows"])
def test_k_steps_spanning_scale_blocks(sched, kind):
    """A K step over several weight block columns (block_k > the block's columns) matches the float32 reference
    on both operand paths, each dot scaled by its own block column's scales (and, quantised on load, each dot's
    activations one group); ue8m0 scales on one of them."""
    over = dict(scale_dtype="ue8m0") if sched.endswith("exact") else {}
    block = fp8_block(8, 2, 128, 256, **over)
    x, ids, weights, w = problem(block, 7, kind)
    s = schedule(**WIDE_K[sched])
    ref = reference(block, x, ids, weights, w, s.params)
    out = BACKEND.build(block, s)(x, ids, weights, w)
    _check(out, ref, s.params.act_quant != "none", f"{kind}/{sched}")


def w8a8_rule(block, x, ids, weights, w, group: int, h_dtype=torch.float32) -> torch.Tensor:
    """float32 result of the w8a8 rule, written out apart from the reference (the weight on the output): x and
    h each rounded through quant.fake_quantize_rows (per row, per `group` channels) before their GEMM, h first
    rounded to `h_dtype` (the 16-bit h that quant_on_load and h_pass store)."""
    out = torch.zeros(x.shape[0], block.D, device=x.device)  # [T, D]
    for e in torch.unique(ids[(ids >= 0) & (ids < block.E)]).tolist():
        tok, pos = torch.where(ids == e)
        gu = fake_quantize_rows(x[tok].float(), group) @ expert_matrix(block, w.gate_up[e], w.gate_up_scale, e).t()
        h = apply_activation(block.activation, *split_gate_up(block, gu)).to(h_dtype).float()
        h = fake_quantize_rows(h, group)
        y = h @ expert_matrix(block, w.down[e], w.down_scale, e).t()
        out.index_add_(0, tok, y * weights[tok, pos].float()[:, None])
    return out


def test_w8a8_is_the_activation_rounding_rule():
    """In 128×128 blocks (D = 384, F = 640: 3 and 5 block columns, 2.5 column tiles of 256): w8a8's output is
    the w8a8 rule's (x and h rounded to e4m3 per 1×128 group, everything else float32; with quant_on_load h
    first rounded to bf16, as it stores h) up to the output's rounding, so its norm-relative error against the
    float32 reference is the rule's own (under 5e-2 on these normal weights); w8a16's is under 1e-2. h_pass
    stores h in bf16 before its pass quantises it: quant_on_load's rule."""
    D, F, T = 384, 640, 5
    block = fp8_block(4, 2, D, F, block=(128, 128))
    x, ids, weights, w = problem(block, T, "uniform", seed=3)
    ref = experts_reference(block, x, ids, weights, w)
    rules = {False: experts_reference(block, x, ids, weights, w, act_group=128),
             True: w8a8_rule(block, x, ids, weights, w, 128, h_dtype=x.dtype)}
    torch.testing.assert_close(rules[False], w8a8_rule(block, x, ids, weights, w, 128), rtol=1e-5, atol=1e-5)
    errs = {}
    for tag, aq, extra in (("w8a16", "none", dict(block_n=128)), ("w8a8", "fp8_1x128", dict(block_n=256)),
                           ("w8a8_on_load", "fp8_1x128", dict(block_n=128, quant_on_load=True)),
                           ("w8a8_h_pass", "fp8_1x128", dict(block_n=64, h_pass=True))):
        s = schedule(block_m=16, block_k=128, down_block_n=128, down_block_k=128, act_quant=aq, **extra)
        out = BACKEND.build(block, s)(x, ids, weights, w)
        _check(out, rules[False] if aq != "none" else ref, aq != "none", f"{D}x{F}/{tag}")
        errs[tag] = rel_err(out, ref)
        if aq != "none":
            rule = rules[s.params.quant_on_load or s.params.h_pass]
            assert rel_err(out, rule) < 5e-3, f"{tag} against its rule: {rel_err(out, rule):.3g}"
            assert abs(errs[tag] - rel_err(rule, ref)) < 5e-3, (errs, rel_err(rule, ref))
    assert errs["w8a16"] < 1e-2 and 1e-2 < errs["w8a8"] < 5e-2, errs


def test_activation_quantisation_is_quantize_rows_bit_for_bit():
    """The pre-pass (and the epilogue's helper it shares) gives quant.quantize_rows' scales and e4m3 bytes,
    including zero groups, values over ±448 after scaling, e4m3 subnormals and signed zeros."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(21, 256, generator=gen) * torch.logspace(-6, 3, 256)).to(torch.bfloat16)
    x[3, :128] = 0
    x[5, 7] = 1e-30
    x[6, :4] = torch.tensor([448.0, -3e4, 1e-8, -1e-8])
    q, s = quant_rows(x.to(DEV), 128)
    qr, sr = quantize_rows(x, 128)
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("act_quant", ["none", "fp8_1x32"])
def test_e4m3_edge_values(act_quant):
    """Weights at ±448, e4m3 subnormals (2^-9 · 1..7) and zeros, scales of very different sizes: still the
    reference's result."""
    block = fp8_block(4, 2, 64, 64)
    x, ids, weights, w = problem(block, 6, "uniform")
    gu = w.gate_up.view(torch.uint8)
    gu[:, 0, :8] = torch.tensor([0x7E, 0xFE, 0x01, 0x81, 0x07, 0x00, 0x80, 0x08], dtype=torch.uint8)
    gu[:, 70, :] = 0x01  # a row of the smallest subnormal
    w.down.view(torch.uint8)[:, :, 3] = 0x7E
    w.gate_up_scale[:, 1] *= 1e-3
    w.down_scale[:, :, 0] *= 64.0
    s = schedule(**SCHEDULES["w8a8_m16" if act_quant != "none" else "w8a16_m16"])
    ref = reference(block, x, ids, weights, w, s.params)
    out = BACKEND.build(block, s)(x, ids, weights, w)
    _check(out, ref, act_quant != "none", f"edges/{act_quant}")


@pytest.mark.parametrize("act_quant", ["none", "fp8_1x32"])
def test_non_finite_weights_propagate_as_in_the_reference(act_quant):
    """A NaN weight byte (e4m3fn has no infinity) makes NaN exactly the output rows of the tokens routed to its
    expert; an infinite block scale makes the same rows non-finite as in the reference; other rows match."""
    block = fp8_block(8, 2, 64, 64)
    x, ids, weights, w = problem(block, 6, "uniform")
    s = schedule(**SCHEDULES["w8a8_m16" if act_quant != "none" else "w8a16_m16"])
    fn = BACKEND.build(block, s)
    e = int(ids[0, 0])
    w.gate_up.view(torch.uint8)[e, 5, 9] = 0x7F  # NaN
    ref = reference(block, x, ids, weights, w, s.params)
    out = fn(x, ids, weights, w)
    assert torch.isnan(ref).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    fin = torch.isfinite(ref)
    assert worst_error(out[fin.all(1)], ref[fin.all(1)], a8=act_quant != "none") <= 1
    w.gate_up.view(torch.uint8)[e, 5, 9] = 0x01
    w.down_scale[e, 1, 0] = float("inf")
    ref = reference(block, x, ids, weights, w, s.params)
    out = fn(x, ids, weights, w)
    assert not torch.isfinite(ref).all()
    assert torch.equal(torch.isfinite(out).all(1), torch.isfinite(ref).all(1))


@triton.jit
def _decode_ue8m0(b_ptr, out_ptr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, _ue8m0(tl.load(b_ptr + offs)))


def test_the_ue8m0_decode_is_torchs_for_every_byte():
    """`_fp8._ue8m0`, the one decode of ue8m0 scale bytes every FP8 kernel takes, against torch's float8_e8m0fnu
    widening for all 256 bytes: 2^(b − 127), 0 → 2^-127, 255 → NaN."""
    b = torch.arange(256, dtype=torch.uint8, device=DEV)
    out = torch.empty(256, dtype=torch.float32, device=DEV)
    _decode_ue8m0[(1,)](b, out)
    want = b.view(torch.float8_e8m0fnu).float()
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[:255], want[:255])


@pytest.mark.parametrize("act_quant", ["none", "fp8_1x32"])
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_ue8m0_scale_bytes_at_the_ends_of_the_format(proj, act_quant):
    """A ue8m0 scale byte of 255 (NaN) makes NaN exactly the output rows the reference makes NaN (the tokens
    routed to its expert) on either GEMM, whether the scale folds into the weights (w8a16) or multiplies the
    accumulator (w8a8); a byte of 0 (2^-127) gives the reference's result."""
    block = fp8_block(8, 2, 64, 64, scale_dtype="ue8m0")
    x, ids, weights, w = problem(block, 6, "uniform")
    s = schedule(**SCHEDULES["w8a8_m16" if act_quant != "none" else "w8a16_m16"])
    fn = BACKEND.build(block, s)
    e = int(ids[0, 0])
    scales = (w.gate_up_scale if proj == "gate_up" else w.down_scale).view(torch.uint8)
    for byte in (255, 0):
        scales[e, 1, 0] = byte
        ref = reference(block, x, ids, weights, w, s.params)
        out = fn(x, ids, weights, w)
        assert torch.isnan(ref).any() == (byte == 255)
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), (byte, torch.isnan(out).any(1), torch.isinf(out).any(1))
        fin = torch.isfinite(ref).all(1)
        assert worst_error(out[fin], ref[fin], a8=act_quant != "none") <= 1


def test_partial_blocks_are_refused_with_the_reason():
    block = fp8_block(4, 2, 200, 128, block=(128, 128))
    why = BACKEND.kinds(block)["grouped_gemm"]
    assert why and "D = 200 is not a multiple of the weight block's columns (128)" in why
    with pytest.raises(UnsupportedSchedule, match="D = 200"):
        BACKEND.build(block, schedule())
    ok = fp8_block(4, 2, 256, 384, block=(128, 128))
    assert BACKEND.kinds(ok)["grouped_gemm"] is None


def test_params_refused_where_they_do_not_fit_the_blocks():
    block = fp8_block(4, 2, 256, 256, block=(128, 128))
    space = BACKEND.space(block, "grouped_gemm")
    with pytest.raises(UnsupportedSchedule, match="whole groups of 128 columns.*h_pass"):
        space.make(block_n=64, act_quant="fp8_1x128")
    assert space.make(block_n=64, act_quant="fp8_1x128", h_pass=True).h_pass
    assert not space.make(block_n=128, act_quant="none", h_pass=True).h_pass  # nothing to quantise
    small = fp8_block(4, 2, 64, 96, block=(32, 32))
    BACKEND.space(small, "grouped_gemm").make(block_k=64, down_block_k=32)  # two whole block columns a step
    with pytest.raises(UnsupportedSchedule, match="block_k = 128 spans 4 scale block columns: K = 64 is not"):
        BACKEND.space(small, "grouped_gemm").make(block_k=128, down_block_k=32)
    with pytest.raises(UnsupportedSchedule, match="down_block_k = 64 spans 2 .* K = 96"):
        BACKEND.space(small, "grouped_gemm").make(block_k=32, down_block_k=64)
    with pytest.raises(UnsupportedSchedule, match="gate/up tile .* limit 227 KiB on h200"):
        space.make(block_m=128, block_n=256, block_k=128, num_stages=4)
    with pytest.raises(UnsupportedSchedule, match="act_quant"):
        Fp8GemmParams(act_quant="int8")
    with pytest.raises(UnsupportedSchedule, match="down_nb = 3"):
        Fp8GemmParams(down_nb=3)
    one, four = (space.make(down_block_n=128, down_stages=4, down_nb=n) for n in (1, 4))
    assert smem_bytes(four, 1) == smem_bytes(one, 1) + 64 * 128 * 4  # the y tile staged inside the loop


def test_default_is_w8a8_and_admitted_at_every_token_count():
    """The default (activations quantised per 1 × the block's columns) is inside the space of every FP8 preset
    shape and of a 64-column block at every token count, its tiles widen with the rows per expert, and the backend
    picks this kernel file for fp8_block weights; w8a8 says it is checked to the a8 tolerance."""
    shapes = ((128, 8, 2048, 768, 128), (512, 10, 4096, 1024, 128), (256, 8, 7168, 2048, 128),
              (8, 2, 4096, 14336, 128), (16, 4, 512, 256, 64))
    for E, k, D, F, c in shapes:
        block = fp8_block(E, k, D, F, block=(c, c))
        space = BACKEND.space(block, "grouped_gemm")
        assert space.params_type is Fp8GemmParams
        tiles = []
        for T in (1, 4, 16, 64, 128, 256, 512, 1024, 4096):
            p = BACKEND.default(block, "grouped_gemm", T).params
            assert p.act_quant == f"fp8_1x{c}" and p.block_k <= c
            space.admit(p)
            flops, nbytes = BACKEND.cost(block, Schedule("grouped_gemm", backend="triton", params=p), T)
            assert flops > 0 and nbytes > 0
            tiles.append(p.block_m)
        assert tiles == sorted(tiles) and tiles[0] == 16, tiles
    assert "w8a8" in accuracy(Fp8GemmParams(block_n=128, act_quant="fp8_1x128"))


def test_the_search_objective_checks_w8a8_to_its_tolerance():
    """moetune.search.objective scores both act_quant settings "ok" on an FP8 block: fresh inputs against the
    float32 reference, w8a8 with the a8 tolerance its params state."""
    from moetune.search.objective import Objective, make_cases
    from moetune.search.timing import FakeTimer

    block = fp8_block(8, 2, 128, 128, block=(64, 64))
    w = expert_tensors(block, DEV, 0)
    cases = make_cases(block, w, 6, 2, torch.Generator().manual_seed(0))
    obj = Objective(block, BACKEND, FakeTimer(lambda s: 1e-3), cases, (6,))
    for aq in ("none", "fp8_1x64"):
        o = obj.evaluate(schedule(block_m=16, block_n=64, block_k=64, down_block_k=64, act_quant=aq))
        assert o.status == "ok" and o.rel_err <= 1, (aq, o.status, o.reason)


def test_cost_reads_one_byte_weights_and_their_scales():
    block = fp8_block(8, 2, 256, 256, block=(128, 128))
    s = schedule(block_m=16)
    _, nbytes = BACKEND.cost(block, s, 1024)  # every expert active
    weights = 8 * (3 * 256 * 256 + (4 + 2) * 4 * 4)
    assert weights <= nbytes < weights + 1024 * 2 * (256 * 20 + 256 * 10)


def test_representative_fp8_configs_compile_for_sm_90():
    """The defaults and a sample of the space, both act_quant settings, fp32 and ue8m0 scales, compile for
    sm_90 within the H200's shared memory without spills; w8a8 runs FP8 tensor-core instructions and rounds
    with the e4m3 conversion instruction; with pdl every kernel of the block releases the launch after it and
    every one but the routing's first waits."""
    rows = _compile("import fp8_sm90; fp8_sm90.main(quick=True)")
    assert len(rows) >= 10
    for r in rows:
        assert "refused" not in r, r
        assert r["shared"] <= H200_SMEM_LIMIT, f"{r['label']}: {r['shared']} B shared > {H200_SMEM_LIMIT}"
        assert r["local"] == 0 and r["spill_bytes"] == 0, f"{r['label']}: register spills: {r}"
        if r["label"].endswith(("gate_up", "down")):  # pipelined loads: cp.async, or TMA on the tma path
            assert r["mma"] > 0 and r["cp_async" if "_tma" not in r["label"] else "tma"] > 0, f"{r['label']}: {r}"
            if r["a8"] and "/m16" not in r["label"]:
                assert r["fp8_mma"] > 0, f"{r['label']}: no e4m3 tensor-core instruction"
        if r["a8"] and r["label"].endswith(("gate_up", "quant_x", "quant_h")):  # (h_pass: h's own pass rounds it)
            assert (r["cvt_e4m3"] > 0) != (r["h_pass"] and r["label"].endswith("gate_up")), f"{r['label']}: {r}"
        if "_tma" in r["label"] and r["label"].endswith(("gate_up", "down")):
            assert r["tma"] > 0, f"{r['label']}: no TMA load (cp.async.bulk.tensor)"
        kernel = r["label"].rsplit("/", 1)[1]  # pdl: each kernel releases the next; all but the first wait
        want = (int(r["pdl"] and kernel != "route2"), int(r["pdl"] and kernel != "combine"))
        assert (min(r["grid_wait"], 1), min(r["grid_release"], 1)) == want, r
    made = {r["label"].rsplit("/", 1)[1] for r in rows if r["pdl"]}
    assert made == {"route2", "route1", "quant_x", "gather", "gate_up", "quant_h", "down", "combine"}, made


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MOETUNE_FP8_FULL_COMPILE"),
                    reason="the full sm_90 grid (about a hundred kernels): MOETUNE_FP8_FULL_COMPILE=1, or "
                           "python tests/codegen/fp8_sm90.py")
def test_every_fp8_default_and_sample_compiles_for_sm_90():
    """The default of every FP8 preset at the timing script's token counts, the GPU tests' sample of the space and
    a few wide candidates compile for sm_90 within the shared memory; the defaults without register spills."""
    rows = _compile("import fp8_sm90; fp8_sm90.main()")
    assert len(rows) >= 60
    for r in rows:
        assert "refused" not in r and r["shared"] <= H200_SMEM_LIMIT, r
        if r["label"].startswith("default"):
            assert r["local"] == 0 and r["spill_bytes"] == 0, f"{r['label']}: register spills: {r}"


# ------------------------------------------------------------------------------------------------- GPU

PRESETS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3.5-397b-a17b": (512, 10, 4096, 1024),
           "deepseek-v3": (256, 8, 7168, 2048), "mixtral-8x7b": (8, 2, 4096, 14336)}
GPU_SAMPLE = [  # a sample of the space beside the default
    dict(block_m=16, block_n=128, block_k=128, num_stages=4, down_block_n=128, down_block_k=128),
    dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3, down_block_n=128, down_block_k=128,
         down_warps=8, act_quant="fp8_1x128"),
    dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, down_block_n=128, down_block_k=64,
         down_warps=8, split_k=2, y_half=True, fold_scale=False),
    dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3, down_block_n=256, down_block_k=128,
         down_warps=8, down_stages=3, act_quant="fp8_1x128", split_k=2),
    dict(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3, down_block_n=128, down_block_k=128,
         down_warps=8, down_stages=3, act_quant="fp8_1x128", quant_on_load=True),
    dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=4, down_block_n=128, down_block_k=128,
         down_warps=8, down_stages=4, act_quant="fp8_1x128", tma=True),
    dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, down_block_n=128, down_block_k=64,
         down_warps=8, down_stages=4, tma=True, split_k=2, y_half=True),
    dict(block_m=16, block_n=128, block_k=128, num_stages=4, down_block_n=128, down_block_k=128,
         act_quant="fp8_1x128", pdl=True),
    dict(block_m=32, block_n=128, block_k=128, num_stages=3, down_block_n=128, down_block_k=128,
         act_quant="fp8_1x128", tma=True, y_half=True, pdl=True),
    dict(block_m=16, block_n=128, block_k=256, num_stages=3, down_block_n=64, down_block_k=256, down_stages=3,
         act_quant="fp8_1x128"),
    dict(block_m=16, block_n=128, block_k=256, num_stages=3, down_block_n=128, down_block_k=256, down_stages=3,
         act_quant="fp8_1x128", tma=True, y_half=True, pdl=True, split_k=2),
    dict(block_m=16, block_n=128, block_k=256, num_stages=2, down_block_n=128, down_block_k=256, down_stages=2),
    dict(block_m=16, block_n=64, block_k=256, num_stages=3, down_block_n=64, down_block_k=128, down_stages=4,
         act_quant="fp8_1x128", h_pass=True),
    dict(block_m=16, block_n=64, block_k=128, num_stages=4, down_block_n=128, down_block_k=128,
         act_quant="fp8_1x128", h_pass=True, tma=True, pdl=True),
    dict(block_m=16, block_n=64, block_k=128, num_stages=4, down_block_n=64, down_block_k=128, down_stages=4,
         down_nb=4, act_quant="fp8_1x128", h_pass=True, pdl=True),
    dict(block_m=16, block_n=128, block_k=128, num_stages=4, down_block_n=128, down_block_k=128, down_nb=2,
         split_k=2),
]


@functools.lru_cache(maxsize=1)
def _preset_weights(preset: str):
    """(block, FP8 expert tensors) of a preset shape, kept for the next test of the same preset."""
    E, k, D, F = PRESETS[preset]
    block = fp8_block(E, k, D, F, block=(128, 128), name=preset)
    return block, expert_tensors(block, DEV, 0)


@pytest.mark.skipif(not (ON_GPU and os.environ.get("MOETUNE_TEST_GPU")),
                    reason="the FP8 grouped GEMM at the presets' shapes needs a CUDA device and MOETUNE_TEST_GPU=1")
class TestGpu:
    @pytest.mark.parametrize("T", [64, 256, 1024])
    @pytest.mark.parametrize("preset", list(PRESETS))
    def test_default_and_sample_eager_and_graph(self, preset, T):
        block, w = _preset_weights(preset)
        x, ids, weights = inputs(block, T, "uniform")
        refs = {g: experts_reference(block, x, ids, weights, w, g) for g in (None, 128)}  # w8a16, w8a8 per 1×128
        ref = refs[None]
        space = BACKEND.space(block, "grouped_gemm")
        points = [BACKEND.default(block, "grouped_gemm", T).params] + [space.make(**g) for g in GPU_SAMPLE]
        for p in points:
            fn = BACKEND.build(block, Schedule("grouped_gemm", backend="triton", params=p))
            a8 = p.act_quant != "none"
            out = fn(x, ids, weights, w)
            _check(out, refs[activation_group(p)], a8, f"{preset}/T{T}/{p}")
            assert rel_err(out, ref) < (4.5e-2 if a8 else 1e-2), f"{preset}/T{T}/{p}: {rel_err(out, ref):.3g}"
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(x, ids, weights, w)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = fn(x, ids, weights, w)
            new_x, new_ids, new_w = inputs(block, T, "uniform", seed=1)
            want = fn(new_x, new_ids, new_w, w)
            x.copy_(new_x)
            ids.copy_(new_ids)
            weights.copy_(new_w)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static, want), f"{preset}/T{T}/{p}: graph replay differs from the eager call"
            del graph, static
            x, ids, weights = inputs(block, T, "uniform")
