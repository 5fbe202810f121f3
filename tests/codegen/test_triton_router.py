"""The fused router (codegen/triton/router.py, runtime/router.py) against the float32 routing reference and
against the model's own router.

Interpreted on the CPU; on the GPU machine with compiled kernels: MOETUNE_TEST_GPU=1 (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

import moetune
from moetune.codegen.torch.tolerance import tolerances
from moetune.codegen.triton.router import MAX_TOKEN_EXPERTS, MAX_TOKENS, fused_route, fused_tokens, refusal, tiles
from moetune.ir import MoetuneError, Router
from moetune.ir.capture import _compare, _tolerance
from moetune.ir.routing import route, selection_scores
from moetune.runtime import describe
from moetune.testing import VOCAB, build, moe_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(spec: Router, T: int, E: int, k: int, D: int, dtype: torch.dtype, w_dtype: torch.dtype, seed: int,
           *, ties: bool = False, x_stride: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D * x_stride, generator=gen)[:, ::x_stride].to(dtype=dtype, device=DEVICE)
    W = (torch.randn(E, D, generator=gen) / D**0.5).to(dtype=dtype, device=DEVICE)
    if ties:  # pairs of equal experts: equal logits, the lower id first
        W[1::2] = W[0::2][: E // 2]
    b = torch.randn(E, generator=gen).to(dtype=dtype, device=DEVICE) if spec.logit_bias else None
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the counter is back at zero for the next call
        lg, w, ids = fused_route(x, W, b, counter, spec, k, dtype, w_dtype)
        assert int(counter.item()) == 0
    exact = x.double() @ W.double().T + (b.double() if b is not None else 0)  # [T, E]
    # one rounding to the logits' dtype, and the float32 sum's own error over D products
    bound = exact.abs() * torch.finfo(dtype).eps + D * 2.0**-24 * (x.double().abs() @ W.double().abs().T)
    assert lg.dtype == dtype and ((lg.double() - exact).abs() <= bound).all(), "logits not x·Wᵀ rounded once"
    assert w.dtype == w_dtype and ids.dtype == torch.int64 and tuple(ids.shape) == (T, k)
    ref_ids, ref_w = route(spec, lg.float(), None, k)
    _compare("fused", spec, selection_scores(spec, lg.float(), None), ref_ids.to(DEVICE), ref_w.to(DEVICE),
             ids.long(), w.float(), _tolerance(w_dtype))
    if ties:  # of two equal maxima the lower expert is taken first, as the arg-max passes promise
        s = selection_scores(spec, lg.float(), None)
        for t in range(T):
            for j in range(k - 1):
                if s[t, ids[t, j]] == s[t, ids[t, j + 1]]:
                    assert ids[t, j] < ids[t, j + 1]
    scores = selection_scores(spec, lg.float(), None).gather(1, ids)
    assert (scores[:, :-1] >= scores[:, 1:]).all(), "ids not in descending order of their scores"


CASES = [  # kind, renormalize, logit bias, E, k, D
    ("softmax_topk", True, False, 128, 8, 256),
    ("softmax_topk", False, False, 60, 4, 200),
    ("softmax_topk", True, False, 8, 2, 64),
    ("softmax_topk", True, False, 8, 8, 48),  # k = E
    ("topk_softmax", False, True, 32, 4, 96),
    ("topk_softmax", False, False, 17, 1, 33),  # odd E, k = 1
]


@pytest.mark.parametrize("kind,renorm,bias,E,k,D", CASES)
@pytest.mark.parametrize("T", [1, 3, MAX_TOKENS])
def test_fused_router_is_the_reference_routing_of_its_logits(kind, renorm, bias, E, k, D, T):
    spec = Router(kind, renormalize=renorm, logit_bias=bias, compute_dtype="model")
    _check(spec, T, E, k, D, torch.bfloat16, torch.bfloat16, seed=E * 100 + T)
    _check(spec, T, E, k, D, torch.float32, torch.float32, seed=E * 100 + T + 1, x_stride=2)


def test_fused_router_breaks_ties_to_the_lower_expert():
    spec = Router("softmax_topk", renormalize=True, compute_dtype="model")
    _check(spec, 5, 16, 6, 64, torch.float32, torch.float32, seed=3, ties=True)


@pytest.mark.parametrize("kind", ["softmax_topk", "topk_softmax"])
def test_a_nan_logit_gives_ids_in_range_and_nan_weights(kind):
    """A token whose hidden state holds a NaN: every id still names an expert (never E, which would select none
    and hide the NaN), its weights NaN as the reference's are; the other tokens routed as without it."""
    spec = Router(kind, renormalize=True, compute_dtype="model")
    T, E, k, D = 3, 16, 4, 64
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=gen).to(DEVICE)
    W = (torch.randn(E, D, generator=gen) / D**0.5).to(DEVICE)
    x[1, 7] = float("nan")
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    lg, w, ids = fused_route(x, W, None, counter, spec, k, torch.float32, torch.float32)
    assert ((ids >= 0) & (ids < E)).all(), ids
    assert torch.isnan(w[1]).all() and torch.isnan(lg[1]).all()
    assert all(len(set(row)) == k for row in ids.tolist())  # k distinct experts a token
    for t in (0, 2):  # the finite tokens routed as the reference routes them
        ref_ids, ref_w = route(spec, lg[t:t + 1].float(), None, k)
        assert torch.equal(ids[t:t + 1].cpu(), ref_ids.cpu()) and torch.allclose(w[t:t + 1].cpu(), ref_w.float().cpu())


def test_tiles_split_the_experts_and_bound_the_product_tile():
    for T in (1, 4, 16):
        for E in (8, 60, 128, 512):
            bt, be, bd, warps = tiles(T, E, 4096)
            assert bt >= T and bt * be * bd <= 8192 and 1 <= be <= E and warps in (1, 2, 4)


def test_the_fused_range_shrinks_with_the_experts():
    assert fused_tokens(8) == fused_tokens(128) == MAX_TOKENS
    assert fused_tokens(512) == MAX_TOKEN_EXPERTS // 512 < MAX_TOKENS
    assert fused_tokens(10**6) == 1


def test_fused_router_refuses_what_it_does_not_compute():
    spec = Router("sigmoid_grouped_topk", renormalize=True, score_bias=True, n_group=4, topk_group=2)
    assert "sigmoid_grouped_topk" in refusal(spec)
    with pytest.raises(ValueError, match="1 to"):
        fused_route(torch.zeros(MAX_TOKENS + 1, 8), torch.zeros(4, 8), None, torch.zeros(1, dtype=torch.int32),
                    Router("softmax_topk"), 2, torch.float32, torch.float32)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "granitemoe", "deepseek_v3"])
def test_compiled_model_routes_through_the_fused_router_and_matches_its_own(family):
    """The router modules of a model compiled on the triton backend take the fused forward (DeepSeek-V3's
    sigmoid router keeps its own, with the reason in describe); the model's logits are those of the model
    before compile; uncompile restores every router's forward."""
    torch.manual_seed(0)
    model = build(family, dtype=torch.float32).to(DEVICE)
    ids = torch.randint(0, VOCAB, (2, 1), device=DEVICE)  # a decode step: T = 2
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        moetune.compile(model, backend="triton")
        routers = [b.gate if hasattr(b, "gate") else b.router for _, b in moe_blocks(model)]
        text = describe(model)
        if family == "deepseek_v3":
            assert all("_moetune_router" not in r.__dict__ for r in routers)
            assert "router: the model's own (router kind sigmoid_grouped_topk" in text
        else:
            assert all("forward" in r.__dict__ for r in routers), text
            assert "router: fused" in text
        got = model(input_ids=ids, use_cache=False).logits
        rtol, atol = tolerances(torch.float32, tf32=DEVICE == "cuda")
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        for r in routers:  # above the fused range: the module's own forward, as it was
            x = torch.randn(fused_tokens(r.weight.shape[0]) + 3, r.weight.shape[1], device=DEVICE)
            for a, b in zip(r(x), type(r).forward(r, x), strict=True):
                assert torch.equal(a, b)
        moetune.uncompile(model)
        assert all("forward" not in r.__dict__ and "_moetune_router" not in r.__dict__ for r in routers)


def test_compile_without_router_fusion_keeps_the_routers():
    model = build("qwen3_moe", dtype=torch.float32).to(DEVICE)
    moetune.compile(model, backend="triton", fuse_router=False)
    assert all("forward" not in b.gate.__dict__ for _, b in moe_blocks(model))
    assert "router:" not in describe(model)
    moetune.uncompile(model)


def test_a_model_moved_after_compile_keeps_its_routers_own_forward_until_compiled_again():
    """The fused router stands aside for weights of another dtype than at compile; the experts' call check then
    names the move (tests/runtime/test_call_checks.py)."""
    model = build("qwen3_moe", dtype=torch.float32).to(DEVICE)
    moetune.compile(model, backend="triton")
    model.to(torch.float64)
    gate = next(moe_blocks(model))[1].gate
    x = torch.randn(2, gate.weight.shape[1], dtype=torch.float64, device=DEVICE)
    for a, b in zip(gate(x), type(gate).forward(gate, x), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(MoetuneError, match="moved after moetune.compile"):
        model(input_ids=torch.randint(0, VOCAB, (1, 2), device=DEVICE), use_cache=False)
    moetune.uncompile(model)
