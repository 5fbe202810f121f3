"""grouped_gemm through torch's grouped GEMM: one call per projection, no host sync.

    order = sort(expert ids); counts by scatter_add; offs = cumsum(counts[:E]) as int32
    gu  = grouped_mm(x_s [S, D], gate_up as [E, D, 2F] view, offs)        (+ gate_up_bias[e_s])
    y_s = grouped_mm(act(gu) [S, F], down as [E, F, D] view, offs)       (+ down_bias[e_s])
    combine (unsort_sum | index_add) in float32

`torch.nn.functional.grouped_mm` runs on CPU in fp32, bf16 and fp16 (torch 2.13); it takes int32
offsets (cumulative row ends; empty groups allowed), no bias, and row strides that are multiples
of 16 bytes — a block whose D or F breaks that is refused with the reason. Rows after offs[-1]
(the sentinel tail) are left uninitialised by the kernel and forced to zero in the combine.
Nothing here reads a device value on the host, so on a GPU this variant would stay capturable.
"""

from __future__ import annotations

import torch

from ...ir import MoEBlock, UnsupportedSchedule
from ..common import ExpertsFn, ExpertTensors, ParamSpace
from ._common import (
    COMBINES,
    GroupedGemmParams,
    activate,
    grouped_mm_refusal,
    kn,
    sorted_rows_cost,
    sorted_rows_fn,
)

SPACE = ParamSpace(GroupedGemmParams, (("impl", ("grouped_mm",)), ("combine", COMBINES)))

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm


def grouped_expert_rows(
    block: MoEBlock, w: ExpertTensors, xs_s: torch.Tensor, e_s: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """Expert-sorted rows xs_s [n, D], their expert ids e_s [n] (sentinel E allowed at the tail) and
    int32 cumulative row ends offs [E] → y_s [n, D] (tail rows undefined)."""
    e_c = e_s.clamp(max=block.E - 1)  # [n] in-bounds bias gather for the tail
    gu = _grouped_mm(xs_s, kn(block, w.gate_up), offs=offs)  # [n, 2F]
    if w.gate_up_bias is not None:
        gu = gu + w.gate_up_bias.index_select(0, e_c)
    h = activate(block, gu).contiguous()  # [n, F]
    y_s = _grouped_mm(h, kn(block, w.down), offs=offs)  # [n, D]
    if w.down_bias is not None:
        y_s = y_s + w.down_bias.index_select(0, e_c)
    return y_s


def build(block: MoEBlock, params: GroupedGemmParams) -> ExpertsFn:
    why = grouped_mm_refusal(block)
    if why:
        raise UnsupportedSchedule(why)

    def rows(w: ExpertTensors, xs_s: torch.Tensor, e_s: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts[: block.E], 0, dtype=torch.int32)  # [E]
        return grouped_expert_rows(block, w, xs_s, e_s, offs)  # [S, D]

    return sorted_rows_fn(block, params.combine, rows, "grouped_mm")


cost = sorted_rows_cost
