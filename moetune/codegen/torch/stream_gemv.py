"""stream_gemv: one gathered GEMV per (token, expert) pair, no sort, no padding rows.

    for each chunk of `chunk` pairs (in [T, k] order):
        Wgu = gate_up[e_c]  [c, D, 2F] view-gathered copy       (index_select: the workspace)
        gu  = bmm(x_c [c, 1, D], Wgu)                          (+ gate_up_bias[e_c])
        y_c = bmm(act(gu) [c, 1, F], down[e_c] [c, F, D])       (+ down_bias[e_c])
    combine: y.view(T, k, D).sum(1) in float32

This is the decode regime's schedule: with one row per active expert there is nothing to batch,
and every selected expert's weights are touched once. On CPU the price is the gather: it copies
chunk × (3·D·F) weights per step, so a block whose chunk of copies exceeds GATHER_WORKSPACE_BYTES is
refused with the reason (lower `chunk`). Block-quantised (fp8_block) weights are gathered as stored and
dequantised per chunk (`expert_weights`). The chunk loop runs over T·k, a host-side shape: no sync.
Sentinel ids are clamped for the gather and their rows zeroed in the combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...targets import Target
from ..contract import KernelKind, sources
from ..space import ParamSpace
from ..tensors import ExpertsFn, ExpertTensors
from ._common import (
    FORMATS,
    activate,
    activation_bytes,
    check_chunk,
    chunks,
    combine_pairs,
    compute_dtype,
    copy_bytes_per_expert,
    empty_out,
    expert_weights,
    ffn_flops,
    gather_refusal,
    gathered_space,
    input_rows,
    kn,
    pairs,
)

SOURCES = ("stream_gemv.py", "_common.py", "reference.py")


@dataclass(frozen=True)
class GatheredParams:
    """chunk: (token, expert) pairs per gathered bmm; workspace = chunk × one expert's weights."""

    chunk: int = 32

    def __post_init__(self) -> None:
        check_chunk("GatheredParams", self.chunk)


def refusal(block: MoEBlock) -> str | None:
    """Why the gathered GEMV cannot run `block`: one expert's copy over the workspace bound."""
    return gather_refusal(block, 1)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return gathered_space("stream_gemv", block, GatheredParams, (("chunk", chunks(block)),))


def default_params(block: MoEBlock, T: int, target: Target) -> GatheredParams:
    """One gathered bmm for all T·k pairs when the workspace allows it, else the largest chunk that fits."""
    return GatheredParams(pair_chunk(space(block, target).choices[0][1], block, T))


def pair_chunk(allowed: tuple[int, ...], block: MoEBlock, T: int) -> int:
    """The smallest of the `allowed` chunks that holds T·k pairs (one bmm), else the largest."""
    return next((c for c in allowed if c >= max(1, T * block.k)), allowed[-1])


def gathered_expert_rows(
    block: MoEBlock, w: ExpertTensors, xs: torch.Tensor, e: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Rows xs [n, D] with expert ids e [n] (all in [0, E)) → y [n, D], chunk pairs per bmm."""
    out = []
    for s in range(0, xs.shape[0], chunk):
        e_c = e[s : s + chunk]  # [c]
        # gather in the stored layout (a plain row copy; dequantised for block-quantised weights), then
        # view as [c, K, N]: bmm takes the view
        gu_w = kn(block, expert_weights(block, w, "gate_up", e_c))  # [c, D, 2F]
        gu = torch.bmm(xs[s : s + chunk].unsqueeze(1), gu_w).squeeze(1)  # [c, 2F]
        if w.gate_up_bias is not None:
            gu = gu + w.gate_up_bias.index_select(0, e_c)
        h = activate(block, gu)  # [c, F]
        dn_w = kn(block, expert_weights(block, w, "down", e_c))  # [c, F, D]
        y = torch.bmm(h.unsqueeze(1), dn_w).squeeze(1)  # [c, D]
        if w.down_bias is not None:
            y = y + w.down_bias.index_select(0, e_c)
        out.append(y)
    return out[0] if len(out) == 1 else torch.cat(out)


def build(block: MoEBlock, schedule: Schedule) -> ExpertsFn:
    params = schedule.params
    why = gather_refusal(block, params.chunk)
    if why:
        raise UnsupportedSchedule(why)
    chunk = params.chunk

    def gathered(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        T, k = ids.shape
        if T == 0:
            return empty_out(x)
        p = pairs(block, ids, weights)
        xs = input_rows(block, x, p.tok, p.weight, compute_dtype(block, w))  # [S, D]
        y = gathered_expert_rows(block, w, xs, p.expert.clamp(max=block.E - 1), chunk)  # [S, D]
        return combine_pairs(block, T, k, y, p, x.dtype)

    return gathered


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): every pair reads its expert's weights, writes the copy and reads it again."""
    S = tokens * block.k
    per_pair = block.weight_bytes_per_expert + 2.0 * copy_bytes_per_expert(block)
    return ffn_flops(block, S), S * per_pair + activation_bytes(block, tokens)


KIND = KernelKind("stream_gemv", GatheredParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, formats=FORMATS)
