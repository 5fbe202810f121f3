"""The float32 reference the tuner checks candidates against (`experts_reference`, expert by expert)
equals a plain loop over (token, slot) pairs on every layout, activation, weight placement and routing
shape it must handle; the objective's check accepts the reference's own answer and refuses a wrong one."""

from __future__ import annotations

import pytest
import torch

from moetune.codegen.torch.reference import apply_activation, split_gate_up
from moetune.ir import Activation, MoEBlock, WeightLayout
from moetune.search.objective import expert_tensors, reference
from moetune.search.timing import Case

GPT_OSS = dict(activation=Activation("clamped_swiglu", alpha=1.702, limit=7.0),
               layout=WeightLayout(transposed=True, interleaved=True, has_bias=True))
BLOCKS = {
    "standard": {},
    "gpt-oss layout (transposed, interleaved, bias, clamped)": GPT_OSS,
    "transposed only": dict(layout=WeightLayout(transposed=True)),
    "weight on the input (llama4)": dict(weight_application="input"),
    "bf16 weights": dict(weight_dtype="bfloat16"),
}


def routing(kind: str, T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if kind == "one hot expert":  # every row to expert 3, a token's k slots included
        return torch.full((T, k), 3)
    if kind == "sentinels":  # expert-parallel ids outside [0, E) contribute nothing
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        ids[0, 0], ids[-1, -1] = -1, E
        return ids
    raise ValueError(kind)


def per_pair(block: MoEBlock, x, ids, wts, w) -> torch.Tensor:
    """out_t = Σ_j over valid slots of expert e_tj applied to token t, in float64, one pair at a time."""
    out = torch.zeros(x.shape[0], block.D, dtype=torch.float64)
    tr = block.layout.transposed
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < block.E:
                continue
            xs, wt = x[t].double(), float(wts[t, j])
            if block.weight_application == "input":
                xs = xs * wt
            gu_w = w.gate_up[e].double()
            gu = xs @ (gu_w if tr else gu_w.t())
            if block.layout.has_bias:
                gu = gu + w.gate_up_bias[e].double()
            h = apply_activation(block.activation, *split_gate_up(block, gu))
            dn_w = w.down[e].double()
            y = h @ (dn_w if tr else dn_w.t())
            if block.layout.has_bias:
                y = y + w.down_bias[e].double()
            out[t] += y * wt if block.weight_application == "output" else y
    return out


@pytest.mark.parametrize("name", list(BLOCKS))
@pytest.mark.parametrize("kind", ["uniform", "one hot expert", "sentinels"])
def test_the_reference_equals_a_loop_over_token_slot_pairs(name, kind):
    block = MoEBlock(E=8, k=3, D=40, F=24, name="ref", **{"weight_dtype": "float32", **BLOCKS[name]})
    w = expert_tensors(block, seed=1)
    g = torch.Generator().manual_seed(2)
    T = 11
    ids = routing(kind, T, block.E, block.k, g)
    x = torch.randn(T, block.D, generator=g).to(w.gate_up.dtype)
    wts = torch.softmax(torch.randn(T, block.k, generator=g), dim=1)
    got = reference(block, Case(x, ids, wts, w))
    assert got.dtype == torch.float32 and got.shape == (T, block.D)
    torch.testing.assert_close(got.double(), per_pair(block, x, ids, wts, w), rtol=1e-5, atol=1e-5)
    assert got.norm() > 0
    if kind == "one hot expert":  # zero-row experts: only expert 3 was read
        w.gate_up[torch.arange(block.E) != 3] = float("nan")
        assert torch.isfinite(reference(block, Case(x, ids, wts, w))).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_check_accepts_the_reference_and_refuses_a_wrong_answer(dtype):
    import toy_backend as tb

    from moetune.search.objective import Objective, make_cases
    from moetune.search.timing import FakeTimer

    block = tb.BLOCK.replace(weight_dtype=dtype, routing_weight_dtype=dtype)
    w = expert_tensors(block)
    cases = make_cases(block, w, 4, 2, torch.Generator().manual_seed(0))
    s = tb.toy("toy-check").default(block, "stream_gemv", 4)
    obj = Objective(block, tb.toy("toy-check"), FakeTimer(tb.cost), cases, (1, 4, 8))
    right = obj.evaluate(s)
    assert right.ok and right.rel_err <= 1
    wrong = tb.toy("toy-check-wrong", faults={("stream_gemv", 16, 1): "wrong"})  # every output 5 % off
    out = Objective(block, wrong, FakeTimer(tb.cost), cases, (1, 4, 8)).evaluate(s)
    assert out.status == "wrong" and "tolerance" in out.reason and out.rel_err > 1
