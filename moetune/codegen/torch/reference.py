"""The float32 reference of the expert computation: the yardstick every kernel is checked against.

    out_t = Σ_j w_tj · down[e_tj] · act(gate[e_tj]·x_t, up[e_tj]·x_t)          (weight on the output)
    out_t = Σ_j down[e_tj] · act(gate[e_tj]·(w_tj x_t), up[e_tj]·(w_tj x_t))    (weight on the input)

Written for clarity, not speed: a loop over the experts in fp32. Block-quantised weights (fp8_block) are
dequantised to float32 expert by expert (moetune.codegen.quant): the reference of an FP8 block is the
float32 computation on the weights the FP8 values and scales stand for. A w8a8 schedule (activations
quantised per 1 × group, `act_group`) is held to the same computation with each GEMM's input rows through
that rule first (`quantize_rows`): its products see the rounded values, and so does its reference.
"""

from __future__ import annotations

import torch

from ...ir import Activation, MoEBlock
from ..quant import dequantize_blocks, fake_quantize_rows
from ..tensors import ExpertTensors


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


def expert_matrix(block: MoEBlock, m: torch.Tensor, scales: torch.Tensor | None, e: int) -> torch.Tensor:
    """Expert e's matrix `m` (gate_up[e] or down[e]) in float32, dequantised with its block scales when the
    block's weights are block-quantised."""
    if not block.weight_format.quantized:
        return m.float()
    return dequantize_blocks(m, scales[e], block.weight_format.block)


def experts_reference(
    block: MoEBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors,
    act_group: int | None = None,
) -> torch.Tensor:
    """Float32 result [T, D] of the routed experts for x [T, D], ids [T, k], weights [T, k].

    Computed expert by expert: each selected expert's weights are widened to float32 once and multiply
    all of its rows (no per-row copy of the weights). Ids outside [0, E) (expert-parallel sentinels)
    contribute nothing. `act_group`: the w8a8 rule's group; x's rows (before a weight on the input, which
    scales a row's products) and the hidden rows are quantised per 1 × act_group and back.
    """
    quant = (lambda a: fake_quantize_rows(a, act_group)) if act_group else (lambda a: a)
    out = torch.zeros(x.shape[0], block.D, dtype=torch.float32, device=x.device)  # [T, D]
    valid = (ids >= 0) & (ids < block.E)  # [T, k]
    tr = block.layout.transposed
    for e in torch.unique(ids[valid]).tolist():
        tok, pos = torch.where(ids == e)  # the m rows routed to expert e
        xs = quant(x[tok].float())  # [m, D]
        wt = weights[tok, pos].float()[:, None]  # [m, 1]
        if block.weight_application == "input":
            xs = xs * wt
        gu_w = expert_matrix(block, w.gate_up[e], w.gate_up_scale, e)  # [2F, D] or [D, 2F]
        gu = xs @ (gu_w if tr else gu_w.t())  # [m, 2F]
        if block.layout.has_bias:
            gu = gu + w.gate_up_bias[e].float()
        h = quant(apply_activation(block.activation, *split_gate_up(block, gu)))  # [m, F]
        dn_w = expert_matrix(block, w.down[e], w.down_scale, e)  # [D, F] or [F, D]
        y = h @ (dn_w if tr else dn_w.t())  # [m, D]
        if block.layout.has_bias:
            y = y + w.down_bias[e].float()
        if block.weight_application == "output":
            y = y * wt
        out.index_add_(0, tok, y)
    return out
