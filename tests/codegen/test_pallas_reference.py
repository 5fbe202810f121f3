"""The JAX float32 reference (moetune.codegen.pallas_tpu.reference) equals the torch one on every layout,
activation and weight format, sentinel ids included."""

from __future__ import annotations

import pytest
import torch

jax = pytest.importorskip("jax")

from moetune.codegen.pallas_tpu._common import jax_experts, to_jax  # noqa: E402
from moetune.codegen.pallas_tpu.reference import experts_reference as jax_reference  # noqa: E402
from moetune.codegen.torch import experts_reference  # noqa: E402
from moetune.ir import Activation, MoEBlock, WeightFormat, WeightLayout  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

BLOCKS = {
    "standard": MoEBlock(E=6, k=2, D=32, F=16, weight_dtype="float32"),
    "transposed_bias": MoEBlock(E=5, k=3, D=16, F=24, weight_dtype="float32",
                                layout=WeightLayout(transposed=True, has_bias=True)),
    "interleaved_clamped": MoEBlock(E=4, k=2, D=16, F=8, weight_dtype="float32",
                                    layout=WeightLayout(interleaved=True),
                                    activation=Activation("clamped_swiglu", alpha=1.702, limit=7.0)),
    "weight_on_input": MoEBlock(E=4, k=2, D=16, F=8, weight_dtype="float32", weight_application="input"),
    "fp8_block": MoEBlock(E=4, k=2, D=256, F=128).with_weight_format(
        WeightFormat.fp8_block((128, 128), "float32", "bfloat16")),
}


@pytest.mark.parametrize("name", BLOCKS)
def test_the_jax_reference_is_the_torch_reference(name):
    block = BLOCKS[name]
    w = expert_tensors(block, seed=3)
    g = torch.Generator().manual_seed(1)
    T = 7
    x = torch.randn(T, block.D, generator=g)
    if block.weight_format.quantized:
        x = x.to(torch.bfloat16)
    ids = torch.randint(0, block.E, (T, block.k), generator=g)
    ids[0, 0] = -1  # a sentinel: contributes nothing
    ids[1, 1] = block.E
    wts = torch.softmax(torch.randn(T, block.k, generator=g), 1)
    want = experts_reference(block, x, ids, wts, w)
    got = jax_reference(block, to_jax(x), to_jax(ids.to(torch.int32)), to_jax(wts), jax_experts(w))
    torch.testing.assert_close(torch.from_dlpack(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("apply", ["output", "input"])
def test_a_sentinel_pair_drops_a_non_finite_value(apply):
    """A token routed only to sentinels gives zeros, as in the torch reference, even where its x holds a NaN or
    expert 0 (which a dense reference runs for a sentinel's pair) holds a NaN: the pair is dropped, not weighted
    by zero."""
    block = MoEBlock(E=4, k=2, D=16, F=8, weight_dtype="float32", weight_application=apply)
    w = expert_tensors(block, seed=2)
    x = torch.randn(3, block.D, generator=torch.Generator().manual_seed(0))
    x[0, 5] = float("nan")
    w.gate_up[0, 3, 1] = float("nan")
    ids = torch.tensor([[-1, block.E], [1, 2], [0, 3]])  # token 0: sentinels only; token 2: expert 0's NaN
    wts = torch.full((3, 2), 0.5)
    want = experts_reference(block, x, ids, wts, w)
    got = torch.from_dlpack(jax_reference(block, to_jax(x), to_jax(ids.to(torch.int32)), to_jax(wts),
                                          jax_experts(w)))
    assert torch.equal(want[0], torch.zeros(block.D)) and torch.isnan(want[2]).all()
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-5, atol=1e-5)
