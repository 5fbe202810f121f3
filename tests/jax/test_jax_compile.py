"""moetune.jax.compile on MoE layers written the common ways (flax.nnx, ragged_dot and gathered-weight einsum,
gate/up fused or apart, both weight layouts): the same outputs as the original, moetune's marker in the
lowered program, the block read off the shapes; explain() says why what it does not recognise is left."""

from __future__ import annotations

import functools
import re
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402
import jax_layers as jl  # noqa: E402

import moetune.jax as mj  # noqa: E402
from moetune.ir import Activation  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
D, F, E, K = 16, 8, 6, 2


def _call(m, x):
    return m(x)


ORIGINAL = jax.jit(_call)  # what the compiled layers are compared with (the router's rounding as under jit)


@pytest.fixture(scope="module")
def layers():
    return {(style, fused): jl.MoE(D, F, E, K, style=style, fused=fused)
            for style in ("ragged", "gathered") for fused in (True, False)}


def _x(T: int, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(T).standard_normal((T, D), np.float32)).astype(dtype)


def _marker(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text(debug_info=True).count(f"{mj.SCOPE}/{mj.REFERENCE}")


@pytest.mark.parametrize("style", ["ragged", "gathered"])
@pytest.mark.parametrize("fused", [True, False])
def test_a_flax_moe_layer_is_replaced_and_gives_the_same_result(layers, style, fused):
    model = layers[style, fused]
    moe = jax.jit(mj.compile(_call))
    for T in (1, 5):  # each T a new trace
        x = _x(T)
        np.testing.assert_allclose(moe(model, x), ORIGINAL(model, x), rtol=1e-5, atol=1e-5)
    assert _marker(moe, model, _x(5)) > 0 and _marker(_call, model, _x(5)) == 0
    (found,) = mj.explain(_call, model, _x(5), print_=False)
    b = found.match.block
    assert (b.E, b.k, b.D, b.F, b.layout.transposed, b.weight_dtype) == (E, K, D, F, True, "float32")
    assert ("apart" in str(found)) == (not fused)


def test_the_compiled_layer_runs_the_backend_it_is_given(layers):
    """compile(fn, backend=…) hands the backend to moetune.jax.experts: the lowered program names its schedule."""
    import jax_kernels as jk

    jk.registered()
    model = layers["ragged", True]
    moe = mj.compile(_call, backend=jk.NAME)
    x = _x(3)
    np.testing.assert_allclose(moe(model, x), ORIGINAL(model, x), rtol=1e-5, atol=1e-5)
    text = jax.jit(moe).lower(model, x).as_text(debug_info=True)
    kind = mj.route(mj.explain(_call, model, x, print_=False)[0].match.block, 3, backend=jk.NAME).schedule.kind
    assert f"{mj.SCOPE}/{jk.NAME}.{kind}/" in text


def test_standard_layout_weights_in_plain_jax():
    """Weights [E, out, in] (transformers' layout) contracted by ragged_dot_general over their last axis."""
    rng = np.random.default_rng(1)
    gate_up = jnp.asarray(rng.standard_normal((E, 2 * F, D), np.float32)) * D ** -0.5
    down = jnp.asarray(rng.standard_normal((E, D, F), np.float32)) * F ** -0.5
    router = jnp.asarray(rng.standard_normal((D, E), np.float32))

    def layer(x, router, gate_up, down):
        ids, wts = jl.route(x @ router, K, x.dtype)
        return jl.ragged_experts(x, ids, wts, gate_up, down, standard=True)

    x = _x(7)
    moe = mj.compile(layer)
    np.testing.assert_allclose(moe(x, router, gate_up, down), jax.jit(layer)(x, router, gate_up, down), rtol=1e-5,
                               atol=1e-5)
    (found,) = mj.explain(layer, x, router, gate_up, down, print_=False)
    assert not found.match.block.layout.transposed


def test_two_layers_and_a_shared_expert():
    """Both MoE layers are replaced; the dense shared expert and the residuals run as they are."""
    model = jl.Decoder(D, F, E, K, seed=2)
    moe = mj.compile(_call)
    x = _x(6)
    np.testing.assert_allclose(moe(model, x), ORIGINAL(model, x), rtol=1e-5, atol=1e-5)
    found = mj.explain(_call, model, x, print_=False)
    assert [f.match is not None for f in found] == [True, True]
    assert _marker(moe, model, x) > 0


def test_bfloat16_layer():
    model = jl.MoE(D, F, E, K, seed=3, dtype=jnp.bfloat16)
    x = _x(9, jnp.bfloat16)
    got = mj.compile(_call)(model, x)
    assert got.dtype == jnp.bfloat16
    want = np.asarray(ORIGINAL(model, x), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * max(1, np.abs(want).max()))
    (found,) = mj.explain(_call, model, x, print_=False)
    assert found.match.block.weight_dtype == "bfloat16"


def test_a_closure_over_the_weights_works_too(layers):
    """Weights captured by a closure are constants of the trace: read as they are."""
    model = layers["ragged", True]
    moe = mj.compile(lambda x: model(x))
    x = _x(4)
    np.testing.assert_allclose(moe(x), ORIGINAL(model, x), rtol=1e-5, atol=1e-5)
    assert _marker(moe, x) > 0


@pytest.mark.parametrize("style", ["ragged", "gathered"])
@pytest.mark.parametrize("fused, interleaved", [(True, False), (True, True), (False, False)])
def test_a_gpt_oss_clamped_swiglu_layer_is_replaced_with_its_alpha_and_limit(style, fused, interleaved):
    """(up + 1)·g·σ(alpha·g), g = min(gate, limit), up clipped to ±limit: alpha and limit read off the trace."""
    act = functools.partial(jl.clamped, alpha=1.5, limit=2.5)
    model = jl.MoE(D, F, E, K, seed=4, style=style, fused=fused, act=act, interleaved=interleaved)
    moe = jax.jit(mj.compile(_call))
    for T in (1, 6):
        x = _x(T) * 4  # gate and up rows past the limit
        np.testing.assert_allclose(moe(model, x), ORIGINAL(model, x), rtol=1e-5, atol=1e-5)
    assert _marker(moe, model, _x(6)) > 0
    (found,) = mj.explain(_call, model, _x(6), print_=False)
    b = found.match.block
    assert (b.activation.kind, b.activation.alpha, b.activation.limit) == ("clamped_swiglu", 1.5, 2.5)
    assert b.layout.interleaved == interleaved and (b.E, b.k, b.D, b.F) == (E, K, D, F)


def test_gpt_oss_constants_in_float32_are_read_as_the_ir_holds_them():
    """alpha = 1.702 and limit = 7 as GPT-OSS has them (1.702 is not a float32): the IR's float, the same output."""
    model = jl.MoE(D, F, E, K, seed=6, act=jl.clamped, interleaved=True)
    x = _x(5) * 8
    np.testing.assert_allclose(mj.compile(_call)(model, x), ORIGINAL(model, x), rtol=1e-5, atol=1e-5)
    (found,) = mj.explain(_call, model, x, print_=False)
    assert found.match.block.activation == Activation("clamped_swiglu", alpha=1.702, limit=7.0)


def ragged_weights_on_the_input(x, router, gate_up, down):
    """Σ_j expert_j(w_j·x): each sorted row scaled by its routing weight, the results summed unweighted."""
    ids, wts = jl.route(x @ router, K, x.dtype)
    order, rows, sizes = _sorted(x, ids)
    rows = rows * wts.reshape(-1)[order][:, None]
    gate, up = jnp.split(jax.lax.ragged_dot(rows, gate_up, sizes), 2, axis=-1)
    y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down, sizes)
    return jnp.zeros_like(y).at[order].set(y).reshape(x.shape[0], K, D).sum(1)


def gathered_weights_on_the_input(x, router, gate_up, down):
    ids, wts = jl.route(x @ router, K, x.dtype)
    xw = x[:, None, :] * wts[..., None]  # [T, k, D]
    gate, up = jnp.split(jnp.einsum("tkd,tkdf->tkf", xw, gate_up[ids]), 2, axis=-1)
    return jnp.einsum("tkf,tkfd->tkd", jl.clamped(gate, up, alpha=1.5, limit=2.5), down[ids]).sum(1)


@pytest.mark.parametrize("fn, kind", [(ragged_weights_on_the_input, "swiglu"),
                                      (gathered_weights_on_the_input, "clamped_swiglu")])
def test_routing_weights_on_the_input_are_read_as_such(fn, kind):
    args = (_x(7) * 3, *_weights())
    np.testing.assert_allclose(mj.compile(fn)(*args), jax.jit(fn)(*args), rtol=1e-5, atol=1e-5)
    assert _marker(mj.compile(fn), *args) > 0
    (found,) = [f for f in mj.explain(fn, *args, print_=False) if f.match is not None]
    assert (found.match.block.weight_application, found.match.block.activation.kind) == ("input", kind)
    assert "routing weights on the input" in str(found)


def test_an_alpha_held_in_an_array_is_read_too():
    """alpha a jnp scalar the activation closes over: a constant of the trace, read like a literal."""
    alpha = jnp.float32(1.25)
    act = functools.partial(jl.clamped, alpha=alpha, limit=3.0)
    model = jl.MoE(D, F, E, K, seed=7, style="gathered", act=act)
    x = _x(4) * 4
    np.testing.assert_allclose(mj.compile(_call)(model, x), ORIGINAL(model, x), rtol=1e-5, atol=1e-5)
    (found,) = mj.explain(_call, model, x, print_=False)
    assert found.match.block.activation == Activation("clamped_swiglu", alpha=1.25, limit=3.0)


# ------------------------------------------------------------------------------ left as they are


def _weights(seed=5):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32) * std)
                 for shape, std in (((D, E), 1.0), ((E, D, 2 * F), D ** -0.5), ((E, F, D), F ** -0.5)))


def _sorted(x, ids):
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    return order, x[order // K], jnp.bincount(flat, length=E).astype(jnp.int32)


def _unsorted(y, order, wts):
    return jnp.einsum("tkd,tk->td", jnp.zeros_like(y).at[order].set(y).reshape(*wts.shape, -1), wts)


def no_activation(x, router, gate_up, down):
    ids, wts = jl.route(x @ router, K, x.dtype)
    order, rows, sizes = _sorted(x, ids)
    h = jax.lax.ragged_dot(rows, gate_up[..., :F], sizes)
    return _unsorted(jax.lax.ragged_dot(h, down, sizes), order, wts)


def relu_activation(x, router, gate_up, down):
    ids, wts = jl.route(x @ router, K, x.dtype)
    order, rows, sizes = _sorted(x, ids)
    gate, up = jnp.split(jax.lax.ragged_dot(rows, gate_up, sizes), 2, axis=-1)
    return _unsorted(jax.lax.ragged_dot(jax.nn.relu(gate) * up, down, sizes), order, wts)


def clamp_with_two_limits(x, router, gate_up, down):
    """gate ≤ 2.5 but up within ±1.5: the IR's clamped SwiGLU has one limit for both."""
    ids, wts = jl.route(x @ router, K, x.dtype)
    act = functools.partial(jl.clamped, alpha=1.702, limit=2.5, up_limit=1.5)
    return jl.ragged_experts(x, ids, wts, gate_up, down, act=act, interleaved=True)


def weights_on_both(x, router, gate_up, down):
    ids, wts = jl.route(x @ router, K, x.dtype)
    order, rows, sizes = _sorted(x, ids)
    rows = rows * wts.reshape(-1)[order][:, None]
    gate, up = jnp.split(jax.lax.ragged_dot(rows, gate_up, sizes), 2, axis=-1)
    return _unsorted(jax.lax.ragged_dot(jax.nn.silu(gate) * up, down, sizes), order, wts)


def scaled_expert_outputs(x, router, gate_up, down):
    """Each expert's result scaled by 2.5 before the weighted sum: more than the experts' sum."""
    ids, wts = jl.route(x @ router, K, x.dtype)
    order, rows, sizes = _sorted(x, ids)
    gate, up = jnp.split(jax.lax.ragged_dot(rows, gate_up, sizes), 2, axis=-1)
    return _unsorted(jax.lax.ragged_dot(jax.nn.silu(gate) * up, down, sizes) * 2.5, order, wts)


def dense_mlp(x, router, gate_up, down):
    gate, up = jnp.split(x @ gate_up[0], 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ down[0]


@pytest.mark.parametrize("fn, reason", [
    (no_activation, r"ragged_dot at eqn \d+: left as is: its input is the output of ragged_dot at eqn \d+ "
                    r"with no activation between"),
    (relu_activation, r"not silu\(gate\)·up \(SwiGLU\)"),
    (clamp_with_two_limits, r"nor the clamped SwiGLU .* for an alpha and a limit among its constants "
                            r"\['-1.5', '1', '1.5', '1.702', '2.5'\]"),
    (weights_on_both, r"the routing weights weight the rows before the experts and, at eqn \d+, their results "
                      r"after them"),
    (scaled_expert_outputs, r"is not the weighted sum of the experts' results: eqn \d+ applies mul by 2.5"),
    (dense_mlp, r"no ragged_dot and no einsum of gathered expert weights"),
])
def test_what_is_not_an_expert_ffn_is_left_as_it_is_and_explain_says_why(fn, reason, capsys):
    args = (_x(5), *_weights())
    found = mj.explain(fn, *args)
    assert all(f.match is None for f in found)
    assert any(re.search(reason, str(f)) for f in found), [str(f) for f in found]
    assert "0 expert FFN(s) replaced" in capsys.readouterr().out
    with pytest.warns(UserWarning, match="no expert FFN found"):
        moe = mj.compile(fn)
        got = moe(*args)
    np.testing.assert_array_equal(got, jax.jit(fn)(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _marker(moe, *args) == 0
