"""The reference routers (`moetune.ir.routing.route`) against hand cases and a per-token loop."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetune.ir import IRError, Router
from moetune.ir.routing import route, router_logits, selection_scores

SOFT = Router("softmax_topk")
SOFT_RENORM = Router("softmax_topk", renormalize=True)
TOPK_SOFT = Router("topk_softmax")


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _as_set(ids: torch.Tensor) -> list[set[int]]:
    return [set(r) for r in ids.tolist()]


def test_softmax_topk_hand_case():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])  # [1, 4]
    p = torch.softmax(logits, -1)[0]
    ids, w = route(SOFT, logits, None, 2)
    assert ids.tolist() == [[2, 1]] and ids.dtype == torch.int64 and w.dtype == torch.float32
    torch.testing.assert_close(w[0], p[[2, 1]])
    _, w_n = route(SOFT_RENORM, logits, None, 2)
    torch.testing.assert_close(w_n[0], p[[2, 1]] / p[[2, 1]].sum())


def test_topk_softmax_equals_renormalised_softmax_topk():
    logits = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    ids_a, w_a = route(TOPK_SOFT, logits, None, 4)
    ids_b, w_b = route(SOFT_RENORM, logits, None, 4)
    assert torch.equal(ids_a, ids_b)
    torch.testing.assert_close(w_a, w_b)
    _, w_c = route(SOFT, logits, None, 4)
    assert not torch.allclose(w_a, w_c)  # without renormalisation the weights are smaller


DS = dict(kind="sigmoid_grouped_topk", score_bias=True, n_group=4, topk_group=2)


def test_grouped_topk_drops_the_group_of_the_best_single_expert():
    # s per group (2 experts each): [0.9, 0.01 | 0.6, 0.6 | 0.5, 0.5 | 0.1, 0.1]
    # group scores 0.91, 1.2, 1.0, 0.2: groups 1 and 2 are kept, so expert 0 (s = 0.9) is not chosen.
    s = [0.9, 0.01, 0.6, 0.6, 0.5, 0.5, 0.1, 0.1]
    logits = torch.tensor([[_logit(p) for p in s]])  # [1, 8]
    ids, w = route(Router(**DS, renormalize=False), logits, torch.zeros(8), 2)
    assert _as_set(ids) == [{2, 3}]
    torch.testing.assert_close(w, torch.tensor([[0.6, 0.6]]))
    ids_flat, _ = route(Router(**{**DS, "n_group": 1, "topk_group": 1}), logits, torch.zeros(8), 2)
    assert 0 in _as_set(ids_flat)[0]  # without groups the best expert wins


def test_score_bias_selects_but_weights_come_from_sigmoid():
    s = [0.5, 0.4, 0.3, 0.2]
    logits = torch.tensor([[_logit(p) for p in s]])  # [1, 4]
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])  # lifts expert 3 into the top-2
    r = Router("sigmoid_grouped_topk", score_bias=True, renormalize=True, scaling=2.5)
    ids, w = route(r, logits, bias, 2)
    assert _as_set(ids) == [{0, 3}]
    got = dict(zip(ids[0].tolist(), w[0].tolist(), strict=True))
    assert got[3] == pytest.approx(2.5 * 0.2 / (0.5 + 0.2), rel=1e-6)
    assert got[0] == pytest.approx(2.5 * 0.5 / (0.5 + 0.2), rel=1e-6)


def _loop_reference(r: Router, logits: list[float], bias: list[float], k: int) -> dict[int, float]:
    """One token, written as plainly as possible: {expert: weight}."""
    E = len(logits)
    if r.kind == "softmax_topk":
        z = sum(math.exp(v) for v in logits)
        p = [math.exp(v) / z for v in logits]
        top = sorted(range(E), key=lambda e: -p[e])[:k]
        tot = sum(p[e] for e in top) if r.renormalize else 1.0
        return {e: p[e] / tot for e in top}
    if r.kind == "topk_softmax":
        top = sorted(range(E), key=lambda e: -logits[e])[:k]
        z = sum(math.exp(logits[e]) for e in top)
        return {e: math.exp(logits[e]) / z for e in top}
    s = [1 / (1 + math.exp(-v)) for v in logits]
    c = [s[e] + bias[e] for e in range(E)]
    per = E // r.n_group
    groups = [list(range(g * per, (g + 1) * per)) for g in range(r.n_group)]
    gscore = [sum(sorted((c[e] for e in grp), reverse=True)[:2]) for grp in groups]
    kept = sorted(range(r.n_group), key=lambda g: -gscore[g])[: r.topk_group]
    cand = [e for g in kept for e in groups[g]]
    top = sorted(cand, key=lambda e: -c[e])[:k]
    tot = (sum(s[e] for e in top) + 1e-20) if r.renormalize else 1.0
    return {e: s[e] / tot * r.scaling for e in top}


ROUTERS = [
    SOFT, SOFT_RENORM, TOPK_SOFT,
    Router(**DS, renormalize=True, scaling=2.5),
    Router(**DS, renormalize=False),
    Router("sigmoid_grouped_topk", renormalize=True),
]


@settings(max_examples=25, deadline=None)
@given(r_i=st.integers(0, len(ROUTERS) - 1), T=st.integers(1, 6), k=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_route_matches_per_token_loop(r_i, T, k, seed):
    r, E = ROUTERS[r_i], 16
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2  # [T, E]
    bias = torch.randn(E, generator=g) * 0.1 if r.score_bias else None  # [E]
    ids, w = route(r, logits, bias, k)
    assert ids.shape == (T, k) and w.shape == (T, k)
    for t in range(T):
        want = _loop_reference(r, logits[t].tolist(), bias.tolist() if bias is not None else [0.0] * E, k)
        got = dict(zip(ids[t].tolist(), w[t].tolist(), strict=True))
        assert set(got) == set(want)
        for e in want:
            assert got[e] == pytest.approx(want[e], rel=1e-5, abs=1e-7)


def test_selection_scores_mask_dropped_groups():
    r = Router(**DS)
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    sc = selection_scores(r, logits, torch.zeros(16))  # [3, 16]
    kept_groups = torch.isfinite(sc).view(3, 4, 4).all(-1).sum(-1)  # [3]
    assert kept_groups.tolist() == [2, 2, 2]


def test_router_logits_precision_and_bias():
    g = torch.Generator().manual_seed(2)
    x, W, b = torch.randn(5, 8, generator=g), torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
    r = Router("topk_softmax", logit_bias=True, compute_dtype="model")
    torch.testing.assert_close(router_logits(r, x, W, b), x @ W.T + b)
    xb = x.bfloat16()
    model_lg = router_logits(Router("softmax_topk", compute_dtype="model"), xb, W)
    assert model_lg.dtype == torch.float32
    torch.testing.assert_close(model_lg, torch.nn.functional.linear(xb, W.bfloat16()).float())
    fp32_lg = router_logits(Router("softmax_topk", compute_dtype="float32"), xb, W)
    torch.testing.assert_close(fp32_lg, xb.float() @ W.T)
    with pytest.raises(IRError, match="logit_bias"):
        router_logits(r, x, W, None)


@pytest.mark.parametrize(
    "r, bias, k, match",
    [
        (SOFT, None, 17, "k"),
        (SOFT, None, 0, "k"),
        (Router(**DS), None, 2, "score_bias"),
        (SOFT_RENORM, None, 2, None),
        (Router("sigmoid_grouped_topk"), torch.zeros(16), 2, "score_bias"),
        (Router(**DS), torch.zeros(15), 2, "score_bias.shape"),
    ],
)
def test_route_errors(r, bias, k, match):
    logits = torch.randn(2, 16)
    if match is None:
        route(r, logits, bias, k)
        return
    with pytest.raises(IRError, match=match):
        route(r, logits, bias, k)
