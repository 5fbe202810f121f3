"""The float32 reference in JAX: moetune.codegen.torch.reference's computation on JAX arrays.

    out_t = Σ_j w_tj · down[e_tj] · act(gate[e_tj]·x_t, up[e_tj]·x_t)          (weight on the output)
    out_t = Σ_j down[e_tj] · act(gate[e_tj]·(w_tj x_t), up[e_tj]·(w_tj x_t))    (weight on the input)

Dense over the experts (a one-hot combine), jittable, every layout, activation and weight format of the IR;
block-quantised weights are dequantised by the rule of moetune.codegen.quant. It is what the "reference"
backend of moetune.jax runs and what the Pallas kernels' JAX-side tests compare with; the torch reference
stays the yardstick of the search.
"""

from __future__ import annotations

from ...ir import MoEBlock
from ._common import JaxExperts


def dequantize(q, scale, block: tuple[int, int]):
    """float32 [..., out, in] = q · scale per (r, c) block (scales beyond the matrix's blocks ignored)."""
    import jax.numpy as jnp

    out, cin = q.shape[-2:]
    r, c = block
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), r, axis=-2), c, axis=-1)[..., :out, :cin]
    return q.astype(jnp.float32) * s


def activate(block: MoEBlock, gu):
    """h [..., F] = act(gate, up) of gu [..., 2F] per the layout and activation, in gu's dtype."""
    if block.layout.interleaved:
        gate, up = gu[..., 0::2], gu[..., 1::2]
    else:
        gate, up = gu[..., : block.F], gu[..., block.F :]
    return gated(block, gate, up)


def gated(block: MoEBlock, gate, up):
    """act(gate, up) elementwise, per the block's activation (the kernels' epilogues call it too)."""
    import jax
    import jax.numpy as jnp

    act = block.activation
    if act.kind == "swiglu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, act.limit)
    up = jnp.clip(up, -act.limit, act.limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * act.alpha)


def matrices(block: MoEBlock, w: JaxExperts):
    """(gate_up [E, D, 2F], down [E, F, D]) in float32, whatever the stored layout and format."""
    import jax.numpy as jnp

    gu, dn = w.gate_up, w.down
    if block.weight_format.quantized:
        gu = dequantize(gu, w.gate_up_scale, block.weight_format.block)
        dn = dequantize(dn, w.down_scale, block.weight_format.block)
    gu, dn = gu.astype(jnp.float32), dn.astype(jnp.float32)
    if not block.layout.transposed:
        gu, dn = jnp.swapaxes(gu, 1, 2), jnp.swapaxes(dn, 1, 2)
    return gu, dn


def experts_reference(block: MoEBlock, x, ids, weights, w: JaxExperts):
    """float32 [T, D] of the routed experts for x [T, D], ids [T, k], weights [T, k]."""
    import jax.numpy as jnp

    gu_w, dn_w = matrices(block, w)
    valid = (ids >= 0) & (ids < block.E)
    e = jnp.where(valid, ids, 0)
    wt = jnp.where(valid, weights.astype(jnp.float32), 0.0)  # [T, k]
    xs = jnp.broadcast_to(x.astype(jnp.float32)[:, None, :], (*ids.shape, block.D))  # [T, k, D]
    if block.weight_application == "input":
        xs = xs * wt[..., None]
    gu = jnp.einsum("tkd,tkdf->tkf", xs, gu_w[e])
    if block.layout.has_bias:
        gu = gu + w.gate_up_bias.astype(jnp.float32)[e]
    h = activate(block, gu)
    y = jnp.einsum("tkf,tkfd->tkd", h, dn_w[e])
    if block.layout.has_bias:
        y = y + w.down_bias.astype(jnp.float32)[e]
    if block.weight_application == "output":
        y = y * wt[..., None]
    # a sentinel's pair is dropped, not weighted by zero: it ran expert 0 on its token, and a NaN or an infinity
    # there (in x or in expert 0's weights) times zero is NaN
    return jnp.where(valid[..., None], y, 0.0).sum(axis=1)
