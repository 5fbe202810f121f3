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
    activation_bytes,
    combine_sorted,
    empty_out,
    expected_distinct,
    ffn_flops,
    grouped_mm_refusal,
    input_rows,
    kn,
    pairs,
    sort_pairs,
    weight_dtype,
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
    combine = params.combine

    def grouped_mm(
        x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors
    ) -> torch.Tensor:
        T, k = ids.shape
        if T == 0:
            return empty_out(x)
        p = pairs(block, ids, weights)
        order, e_s, counts = sort_pairs(p, block.E)  # [S], [S], [E+1]
        offs = torch.cumsum(counts[: block.E], 0, dtype=torch.int32)  # [E]
        xs_s = input_rows(
            block, x, p.tok.index_select(0, order), p.weight.index_select(0, order), weight_dtype(w)
        )  # [S, D]
        y_s = grouped_expert_rows(block, w, xs_s, e_s, offs)  # [S, D]
        return combine_sorted(combine, block, T, k, y_s, order, p, x.dtype)

    return grouped_mm


def cost(block: MoEBlock, params: GroupedGemmParams, tokens: int) -> tuple[float, float]:
    """(flops, bytes): as sorted_gemm; each distinct expert's weights read once."""
    S = tokens * block.k
    distinct = expected_distinct(block.E, block.k, tokens)
    b = distinct * block.weight_bytes_per_expert + activation_bytes(block, tokens) + S * 16
    if params.combine == "unsort_sum":
        b += 2 * S * block.D * 4
    return ffn_flops(block, S), b
