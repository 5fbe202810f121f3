"""moetune.jax.experts on the Pallas TPU backend, in TPU interpret mode (race detection on): its default
schedules at decode and at batch token counts match the torch float32 reference, and the lowered program of
the jitted call holds moetune's Pallas kernel under moetune's scope."""

from __future__ import annotations

import pytest
import torch

jax = pytest.importorskip("jax")

import moetune.jax as mj  # noqa: E402
from moetune.codegen.pallas_tpu._common import to_jax  # noqa: E402
from moetune.codegen.torch import experts_reference  # noqa: E402
from moetune.codegen.torch.tolerance import worst_error  # noqa: E402
from moetune.ir import MoEBlock  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402

BLOCK = MoEBlock(E=8, k=2, D=256, F=256, weight_dtype="float32", routing_weight_dtype="float32")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("MOETUNE_PALLAS_INTERPRET", "races")


def _args(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = expert_tensors(BLOCK, seed=seed)
    x = torch.randn(T, BLOCK.D, generator=g)
    ids = torch.stack([torch.randperm(BLOCK.E, generator=g)[: BLOCK.k] for _ in range(T)])
    ids[0, 0] = BLOCK.E  # an expert-parallel sentinel: contributes nothing
    wts = torch.softmax(torch.randn(T, BLOCK.k, generator=g), 1)
    return w, x, ids, wts


@pytest.mark.parametrize("T", [1, 3, 24])
def test_pallas_tpu_experts_match_the_reference_and_lower_to_the_kernel(T):
    w, x, ids, wts = _args(T)

    def f(x, ids, wts, gate_up, down):
        return mj.experts(x, ids, wts, gate_up, down, block=BLOCK, backend="pallas_tpu")

    args = (to_jax(x), to_jax(ids), to_jax(wts), to_jax(w.gate_up), to_jax(w.down))
    out = torch.from_dlpack(jax.jit(f)(*args))
    assert worst_error(out, experts_reference(BLOCK, x, ids, wts, w)) <= 1
    text = jax.jit(f).lower(*args).as_text(debug_info=True)
    assert "moetune_experts/pallas_tpu." in text
    assert "tpu_custom_call" in text or "pallas" in text.lower()
