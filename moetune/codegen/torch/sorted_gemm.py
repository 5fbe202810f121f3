"""grouped_gemm, sorted: sort the (token, expert) pairs by expert, one GEMM per active expert.

    order = argsort(expert ids)            pairs of one expert become contiguous rows
    for e with m_e > 0:  y[rows_e] = down[e] · act(gate_up[e] · x[rows_e])     two torch.mm
    combine (unsort_sum | index_add) in float32

The loop over active experts runs on the host: it reads the per-expert counts (`tolist()`). On
CPU there is no device to synchronise with, so this costs nothing beyond the Python loop; on a GPU
it would be a device-to-host sync, which is why the GPU backends and the `grouped_mm` variant do
not do it. Work is ∝ distinct experts × weights + T·k rows: each active expert's weights are read
once, at any number of rows.
"""

from __future__ import annotations

import torch

from ...ir import MoEBlock
from ..common import ExpertsFn, ExpertTensors, ParamSpace
from ._common import (
    COMBINES,
    GroupedGemmParams,
    expert_ffn,
    sorted_rows_cost,
    sorted_rows_fn,
)

SPACE = ParamSpace(GroupedGemmParams, (("impl", ("sorted_gemm",)), ("combine", COMBINES)))


def sorted_expert_rows(
    block: MoEBlock, w: ExpertTensors, xs_s: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """Expert-sorted rows xs_s [n, D] with counts[e] rows of expert e → y_s [n, D] (rows past the
    active experts, i.e. sentinels, are zero)."""
    y_s = xs_s.new_zeros(xs_s.shape)  # [n, D]
    start = 0
    for e, m in enumerate(counts):
        if m:
            y_s[start : start + m] = expert_ffn(block, w, e, xs_s[start : start + m])  # [m_e, D]
            start += m
    return y_s


def build(block: MoEBlock, params: GroupedGemmParams) -> ExpertsFn:
    return sorted_rows_fn(
        block, params.combine,
        lambda w, xs_s, e_s, counts: sorted_expert_rows(block, w, xs_s, counts[: block.E].tolist()),  # host loop
        "sorted_gemm",
    )


cost = sorted_rows_cost
