"""The float32 reference of the expert computation: the yardstick every kernel is checked against.

    out_t = Σ_j w_tj · down[e_tj] · act(gate[e_tj]·x_t, up[e_tj]·x_t)          (weight on the output)
    out_t = Σ_j down[e_tj] · act(gate[e_tj]·(w_tj x_t), up[e_tj]·(w_tj x_t))    (weight on the input)

Written for clarity, not speed: a loop over (token, expert) pairs done as one gathered bmm in fp32.
"""

from __future__ import annotations

import torch

from ...ir import Activation, MoEBlock
from ..common import ExpertTensors


def apply_activation(act: Activation, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """h = act(gate, up), elementwise, in the dtype of the inputs."""
    if act.kind == "swiglu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * gate * torch.sigmoid(gate * act.alpha)


def split_gate_up(block: MoEBlock, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2F] → gate [..., F], up [..., F] per the layout (halves or interleaved)."""
    if block.layout.interleaved:
        return gu[..., 0::2], gu[..., 1::2]
    return gu[..., : block.F], gu[..., block.F :]


def experts_reference(
    block: MoEBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors
) -> torch.Tensor:
    """Float32 result [T, D] of the routed experts for x [T, D], ids [T, k], weights [T, k].

    Ids outside [0, E) (expert-parallel sentinels) contribute nothing.
    """
    T, k = ids.shape
    x32 = x.float()
    valid = (ids >= 0) & (ids < block.E)  # [T, k]
    e = ids.clamp(0, block.E - 1).reshape(-1)  # [T·k]
    wt = torch.where(valid, weights.float(), torch.zeros((), dtype=torch.float32)).reshape(-1, 1)  # [T·k, 1]
    xs = x32.repeat_interleave(k, dim=0)  # [T·k, D]
    if block.weight_application == "input":
        xs = xs * wt
    gu_w = w.gate_up.float()[e]  # [T·k, 2F, D] or [T·k, D, 2F]
    dn_w = w.down.float()[e]  # [T·k, D, F] or [T·k, F, D]
    if block.layout.transposed:
        gu = torch.bmm(xs.unsqueeze(1), gu_w).squeeze(1)  # [T·k, 2F]
    else:
        gu = torch.bmm(gu_w, xs.unsqueeze(2)).squeeze(2)  # [T·k, 2F]
    if block.layout.has_bias:
        gu = gu + w.gate_up_bias.float()[e]
    h = apply_activation(block.activation, *split_gate_up(block, gu))  # [T·k, F]
    if block.layout.transposed:
        y = torch.bmm(h.unsqueeze(1), dn_w).squeeze(1)  # [T·k, D]
    else:
        y = torch.bmm(dn_w, h.unsqueeze(2)).squeeze(2)  # [T·k, D]
    if block.layout.has_bias:
        y = y + w.down_bias.float()[e]
    if block.weight_application == "output":
        y = y * wt
    else:
        y = y * valid.reshape(-1, 1)
    return y.view(T, k, block.D).sum(1)  # [T, D]
