"""MoE layers written the common ways, for the tests of moetune.jax.compile.

    ragged_experts    rows sorted by expert, group sizes, lax.ragged_dot for gate/up and down, unsorted,
                      the weighted sum over k (MaxText / Tokamax style)
    gathered_experts  w[ids] gathered per token and contracted with einsum
    MoE               a flax.nnx layer: a softmax top-k router and the experts in one of those styles,
                      gate/up fused [E, D, 2F] or apart [E, D, F] x2, down [E, F, D]; the activation
                      SwiGLU or GPT-OSS's clamped SwiGLU (`clamped`), gate/up halves or interleaved
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def clamped(gate, up, *, alpha: float = 1.702, limit: float = 7.0, up_limit: float | None = None):
    """GPT-OSS's clamped SwiGLU: (up + 1)·g·σ(alpha·g), g = min(gate, limit), up clamped to ±limit (±up_limit
    where given: a clamp the IR's one limit cannot express)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -(up_limit or limit), up_limit or limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def _gate_up(rows, gate_up, matmul, act, interleaved: bool):
    """act(gate, up) of rows times gate_up: one fused array [E, D, 2F] (halves, or gate and up interleaved)
    or (gate, up)."""
    if isinstance(gate_up, tuple):
        gate, up = (matmul(rows, w) for w in gate_up)
    elif interleaved:
        gu = matmul(rows, gate_up)
        gate, up = gu[..., 0::2], gu[..., 1::2]
    else:
        gate, up = jnp.split(matmul(rows, gate_up), 2, axis=-1)
    return act(gate, up)


def ragged_experts(x, ids, wts, gate_up, down, *, standard: bool = False, act=swiglu, interleaved: bool = False):
    """x [T, D], ids [T, k], wts [T, k]; weights [E, in, out] (or [E, out, in] with `standard`); act(gate, up)
    the activation."""
    T, k = ids.shape
    E = down.shape[0]
    flat = ids.reshape(-1)  # [T·k]
    order = jnp.argsort(flat)
    rows = x[order // k]  # [T·k, D], sorted by expert
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E]
    dims = jax.lax.RaggedDotDimensionNumbers((((1,), (2 if standard else 1,)), ((), ())), (0,), (0,))

    def matmul(a, w):
        return jax.lax.ragged_dot_general(a, w, sizes, dims)

    y = matmul(_gate_up(rows, gate_up, matmul, act, interleaved), down)  # [T·k, D]
    y = jnp.zeros_like(y).at[order].set(y).reshape(T, k, -1)  # unsorted: [T, k, D]
    return jnp.einsum("tkd,tk->td", y, wts)


def gathered_experts(x, ids, wts, gate_up, down, *, act=swiglu, interleaved: bool = False):
    """The same with each token's experts' weights gathered: w[ids] [T, k, in, out]."""
    def matmul(a, w):
        return jnp.einsum("td,tkdf->tkf" if a.ndim == 2 else "tkd,tkdf->tkf", a, w[ids])

    h = _gate_up(x, gate_up, matmul, act, interleaved)  # [T, k, F]
    y = jnp.einsum("tkf,tkfd->tkd", h, down[ids])
    return (y * wts[..., None]).sum(axis=1)


def route(logits, k: int, dtype):
    """Softmax over the experts, top-k, renormalised: (ids [T, k], weights [T, k] in `dtype`)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    wts, ids = jax.lax.top_k(probs, k)
    return ids, (wts / wts.sum(axis=-1, keepdims=True)).astype(dtype)


class MoE(nnx.Module):
    def __init__(self, D: int, F: int, E: int, k: int, *, seed: int = 0, style: str = "ragged",
                 fused: bool = True, dtype=jnp.float32, act=swiglu, interleaved: bool = False):
        rng = np.random.default_rng(seed)

        def param(shape, std):  # drawn on the host: no device program per initialiser
            return nnx.Param(jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype))

        self.k, self.style, self.fused, self.act, self.interleaved = k, style, fused, act, interleaved
        self.router = param((D, E), 1.0)
        if fused:
            self.w_gate_up = param((E, D, 2 * F), D ** -0.5)
        else:
            self.w_gate, self.w_up = param((E, D, F), D ** -0.5), param((E, D, F), D ** -0.5)
        self.w_down = param((E, F, D), F ** -0.5)

    def __call__(self, x):  # x [T, D]
        ids, wts = route(x @ self.router[...], self.k, x.dtype)
        gate_up = self.w_gate_up[...] if self.fused else (self.w_gate[...], self.w_up[...])
        experts = ragged_experts if self.style == "ragged" else gathered_experts
        return experts(x, ids, wts, gate_up, self.w_down[...], act=self.act, interleaved=self.interleaved)


class Decoder(nnx.Module):
    """Two MoE layers with residuals, the second with a dense shared expert added to the routed output."""

    def __init__(self, D: int, F: int, E: int, k: int, *, seed: int = 0):
        self.moe1 = MoE(D, F, E, k, seed=seed)
        self.moe2 = MoE(D, F, E, k, seed=seed + 1, style="gathered", fused=False)
        self.shared = nnx.Param(jnp.asarray(np.random.default_rng(seed + 2).standard_normal((D, D), np.float32)))

    def __call__(self, x):
        x = x + self.moe1(x)
        return x + self.moe2(x) + jax.nn.silu(x @ self.shared[...])
