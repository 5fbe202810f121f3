"""moetune.jax.experts against the torch float32 reference: every layout, activation and weight format, in
float32, bfloat16 and FP8 (block scales), sentinel ids, k = 1, one hot expert, T = 0; jitted; bad calls refused
with the reason; the backends a machine without TPU or GPU has."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import moetune.jax as mj  # noqa: E402
from moetune.codegen.pallas_tpu._common import to_jax  # noqa: E402
from moetune.codegen.torch import experts_reference  # noqa: E402
from moetune.codegen.torch.tolerance import worst_error  # noqa: E402
from moetune.ir import Activation, IRError, MoEBlock, UnsupportedSchedule, WeightFormat, WeightLayout  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

BLOCKS = {
    "f32": MoEBlock(E=6, k=2, D=32, F=16, weight_dtype="float32", routing_weight_dtype="float32"),
    "bf16_transposed_bias": MoEBlock(E=5, k=3, D=16, F=24, layout=WeightLayout(transposed=True, has_bias=True)),
    "bf16_interleaved_clamped": MoEBlock(E=4, k=2, D=16, F=8, layout=WeightLayout(interleaved=True),
                                         activation=Activation("clamped_swiglu", alpha=1.702, limit=7.0)),
    "f32_weight_on_input": MoEBlock(E=4, k=2, D=16, F=8, weight_dtype="float32", weight_application="input"),
    "f32_k1": MoEBlock(E=3, k=1, D=8, F=8, weight_dtype="float32"),
    "fp8_block": MoEBlock(E=4, k=2, D=256, F=128).with_weight_format(WeightFormat.fp8_block((128, 128))),
}
ROUTINGS = ("random", "sentinels", "one_hot")


def _case(block: MoEBlock, T: int, routing: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, block.D, generator=g).to(getattr(torch, block.weight_format.compute_dtype))
    ids = torch.stack([torch.randperm(block.E, generator=g)[:block.k] for _ in range(T)]) if T else \
        torch.zeros(0, block.k, dtype=torch.int64)
    if routing == "sentinels" and T:
        ids[0, 0] = -1
        ids[-1, -1] = block.E  # expert-parallel sentinels: contribute nothing
    if routing == "one_hot":
        ids[:, 0] = 1  # one expert takes every token
    wts = torch.softmax(torch.randn(T, block.k, generator=g), 1).to(getattr(torch, block.routing_weight_dtype))
    return x, ids, wts


def _run(block, x, ids, wts, w, **kw):
    return mj.experts(to_jax(x), to_jax(ids), to_jax(wts), to_jax(w.gate_up), to_jax(w.down), block=block,
                      gate_up_scale=to_jax(w.gate_up_scale), down_scale=to_jax(w.down_scale),
                      gate_up_bias=to_jax(w.gate_up_bias), down_bias=to_jax(w.down_bias), **kw)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("name", BLOCKS)
def test_experts_match_the_torch_reference(name, routing):
    block = BLOCKS[name]
    w = expert_tensors(block, seed=3)
    x, ids, wts = _case(block, 5, routing)
    out = _run(block, x, ids, wts, w, backend="reference")
    assert out.dtype == jnp.dtype(block.weight_format.compute_dtype) and out.shape == (5, block.D)
    got = torch.from_dlpack(out)
    assert worst_error(got, experts_reference(block, x, ids, wts, w)) <= 1.0


def test_sentinel_ids_contribute_nothing():
    block = BLOCKS["f32"]
    w = expert_tensors(block, seed=1)
    x, ids, wts = _case(block, 4, "random")
    out = torch.from_dlpack(_run(block, x, ids, wts, w))
    ids_off = ids.clone()
    ids_off[:, 1] = -1  # the second expert of every token dropped ...
    dropped = torch.from_dlpack(_run(block, x, ids_off, wts, w))
    wts_off = wts.clone()
    wts_off[:, 1] = 0  # ... is the same as giving it no weight
    torch.testing.assert_close(dropped, torch.from_dlpack(_run(block, x, ids, wts_off, w)), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(dropped, out)


def test_jit_and_zero_tokens():
    block = BLOCKS["fp8_block"]
    w = expert_tensors(block, seed=2)
    run = jax.jit(lambda x, i, t, gu, dn, gus, dns: mj.experts(x, i, t, gu, dn, block=block, gate_up_scale=gus,
                                                                down_scale=dns))
    for T in (1, 3):
        x, ids, wts = _case(block, T, "random", seed=T)
        out = run(*(to_jax(a) for a in (x, ids.to(torch.int32), wts, w.gate_up, w.down, w.gate_up_scale,
                                        w.down_scale)))
        assert worst_error(torch.from_dlpack(out), experts_reference(block, x, ids, wts, w)) <= 1.0
    x, ids, wts = _case(block, 0, "random")
    out = _run(block, x, ids, wts, w)
    assert out.shape == (0, block.D) and out.dtype == jnp.bfloat16


def test_a_preset_name_is_a_block():
    """A preset's shapes, checked without allocating its weights (jax.eval_shape)."""
    from moetune.ir.presets import preset

    b = preset("qwen3-30b-a3b")
    S = jax.ShapeDtypeStruct
    out = jax.eval_shape(lambda x, i, t, gu, dn: mj.experts(x, i, t, gu, dn, block="qwen3-30b-a3b"),
                         S((3, b.D), jnp.bfloat16), S((3, b.k), jnp.int32), S((3, b.k), jnp.bfloat16),
                         S((b.E, 2 * b.F, b.D), jnp.bfloat16), S((b.E, b.D, b.F), jnp.bfloat16))
    assert out.shape == (3, b.D) and out.dtype == jnp.bfloat16
    with pytest.raises(IRError, match=r"down.*needs \(128, 2048, 768\)"):
        jax.eval_shape(lambda x, i, t, gu, dn: mj.experts(x, i, t, gu, dn, block="qwen3-30b-a3b"),
                       S((3, b.D), jnp.bfloat16), S((3, b.k), jnp.int32), S((3, b.k), jnp.bfloat16),
                       S((b.E, 2 * b.F, b.D), jnp.bfloat16), S((b.E, b.F, b.D), jnp.bfloat16))


@pytest.mark.parametrize("bad, match", [
    ("x", r"x = \(5, 31\).*need \[T, D = 32\]"),
    ("ids", r"topk_ids.*need integer \[T = 5, k = 2\]"),
    ("x_dtype", r"x.dtype = 'bfloat16'.*computes in float32"),
    ("weights_dtype", r"gate_up.dtype = 'bfloat16'"),
    ("scale", r"gate_up_scale.*has none"),
])
def test_bad_calls_are_refused_with_the_reason(bad, match):
    block = BLOCKS["f32"]
    w = expert_tensors(block, seed=0)
    x, ids, wts = (to_jax(a) for a in _case(block, 5, "random"))
    gu, dn, scale = to_jax(w.gate_up), to_jax(w.down), None
    if bad == "x":
        x = x[:, :31]
    elif bad == "ids":
        ids = ids.astype(jnp.float32)
    elif bad == "x_dtype":
        x = x.astype(jnp.bfloat16)
    elif bad == "weights_dtype":
        gu = gu.astype(jnp.bfloat16)
    else:
        scale = jnp.ones((6, 1, 1))
    with pytest.raises(IRError, match=match):
        mj.experts(x, ids, wts, gu, dn, block=block, gate_up_scale=scale)


def test_backends_of_a_machine_without_tpu_or_gpu(monkeypatch):
    monkeypatch.delenv("MOETUNE_PALLAS_INTERPRET", raising=False)
    assert mj.jax_backend(None) == mj.REFERENCE
    with pytest.raises(UnsupportedSchedule, match="pallas_tpu.*not usable here: no TPU and MOETUNE_PALLAS_INTERPRET"):
        mj.jax_backend("pallas_tpu")
    assert mj.jax_backend("torch").name == "torch"  # its torch kernels, through the XLA FFI
    with pytest.raises(UnsupportedSchedule, match="'no_such' is not installed"):
        mj.jax_backend("no_such")


def test_the_gpu_backend_is_looked_up_by_name():
    """pallas_gpu is another package's backend: where it is registered it is used, else the error says so."""
    from moetune.codegen.backend import _MODULES

    if "pallas_gpu" not in _MODULES:
        with pytest.raises(UnsupportedSchedule, match="'pallas_gpu' is not installed in this moetune"):
            mj.jax_backend("pallas_gpu")
    else:
        try:
            be = mj.jax_backend("pallas_gpu")
        except UnsupportedSchedule as e:
            assert "pallas_gpu" in str(e)
        else:
            assert be.name == "pallas_gpu"


def test_importing_moetune_imports_no_jax():
    code = "import sys, moetune, moetune.runtime.compiled; assert 'jax' not in sys.modules; import moetune.jax; " \
           "assert 'jax' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
