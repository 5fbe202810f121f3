"""The tuner's fp32 reference (expert by expert) equals the package's yardstick `experts_reference` (one
gathered bmm) on every layout, activation, weight placement and routing shape it must handle."""

from __future__ import annotations

import pytest
import torch

from moetune.codegen.torch import experts_reference
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


@pytest.mark.parametrize("name", list(BLOCKS))
@pytest.mark.parametrize("kind", ["uniform", "one hot expert", "sentinels"])
def test_expert_by_expert_reference_equals_the_gathered_one(name, kind):
    block = MoEBlock(E=8, k=3, D=40, F=24, name="ref", **{"weight_dtype": "float32", **BLOCKS[name]})
    w = expert_tensors(block, seed=1)
    g = torch.Generator().manual_seed(2)
    T = 11
    ids = routing(kind, T, block.E, block.k, g)
    x = torch.randn(T, block.D, generator=g).to(w.gate_up.dtype)
    wts = torch.softmax(torch.randn(T, block.k, generator=g), dim=1)
    got = reference(block, Case(x, ids, wts, w))
    want = experts_reference(block, x, ids, wts, w)
    assert got.dtype == torch.float32 and got.shape == (T, block.D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.norm() > 0
    if kind == "one hot expert":  # zero-row experts: only expert 3 was read
        w.gate_up[torch.arange(block.E) != 3] = float("nan")
        assert torch.isfinite(reference(block, Case(x, ids, wts, w))).all()
