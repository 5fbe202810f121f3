"""grouped_gemm: sort the (token, expert) pairs by expert, then one GEMM per expert's contiguous rows.

    order = sort(expert ids); counts by scatter_add         pairs of one expert become contiguous rows
    impl sorted_gemm: for e with m_e > 0:  y[rows_e] = down[e] · act(gate_up[e] · x[rows_e])   two torch.mm
    impl grouped_mm:  offs = cumsum(counts[:E]) as int32
                      gu  = grouped_mm(x_s [S, D], gate_up as [E, D, 2F] view, offs)   (+ gate_up_bias[e_s])
                      y_s = grouped_mm(act(gu) [S, F], down as [E, F, D] view, offs)   (+ down_bias[e_s])
    combine (unsort_sum | index_add) in float32

sorted_gemm's loop over active experts runs on the host: it reads the per-expert counts (`tolist()`).
On CPU there is no device to synchronise with, so this costs nothing beyond the Python loop; on a GPU it
would be a device-to-host sync, which is why the GPU backends and `grouped_mm` do not do it.

`torch.nn.functional.grouped_mm` runs on CPU in fp32, bf16 and fp16; it takes int32 offsets (cumulative
row ends; empty groups allowed), no bias, and row strides that are multiples of 16 bytes — a block whose
D or F breaks that is refused with the reason. Rows after offs[-1] (the sentinel tail) are left
uninitialised by the kernel and forced to zero in the combine. Nothing in grouped_mm reads a device value
on the host, so on a GPU it would stay capturable.

Work is ∝ distinct experts × weights + T·k rows: each active expert's weights are read once, at any
number of rows.

Block-quantised (fp8_block) weights: sorted_gemm dequantises each active expert's matrices before its two
torch.mm; grouped_mm reads the active experts on the host and runs one grouped_mm per group of them whose
dequantised copies fit GATHER_WORKSPACE_BYTES (a host sync, as sorted_gemm's loop: CPU only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...passes.stats import uniform_distinct
from ...targets import Target
from ..contract import KernelKind, sources
from ..space import ParamSpace
from ..tensors import ExpertsFn, ExpertTensors
from ._common import (
    COMBINES,
    FORMATS,
    GATHER_WORKSPACE_BYTES,
    Combine,
    activate,
    activation_bytes,
    check_combine,
    combine_sorted,
    compute_dtype,
    copy_bytes_per_expert,
    empty_out,
    expert_ffn,
    expert_weights,
    ffn_flops,
    grouped_mm_refusal,
    input_rows,
    kn,
    pairs,
    sort_pairs,
)

SOURCES = ("grouped_gemm.py", "_common.py", "reference.py")

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm


@dataclass(frozen=True)
class GroupedGemmParams:
    """Parameters of the torch grouped_gemm kind (pairs sorted by expert, GEMM per expert).

    impl     sorted_gemm: a host loop of torch.mm over the active experts' contiguous rows
             grouped_mm:  one torch.nn.functional.grouped_mm over int32 offsets, no host sync
    combine  unsort_sum:  un-permute the rows, sum the k rows of each token (view(T, k, D).sum)
             index_add:   scatter-add the sorted rows into token order (no un-permute)
    """

    impl: Literal["sorted_gemm", "grouped_mm"] = "sorted_gemm"
    combine: Combine = "unsort_sum"

    def __post_init__(self) -> None:
        if self.impl not in ("sorted_gemm", "grouped_mm"):
            raise UnsupportedSchedule(
                f"GroupedGemmParams.impl = {self.impl!r}: supported sorted_gemm, grouped_mm"
            )
        check_combine("GroupedGemmParams", self.combine)


def impls(block: MoEBlock) -> tuple[str, ...]:
    """The GEMM implementations that run `block` (grouped_mm needs 16-byte row strides)."""
    return ("sorted_gemm",) if grouped_mm_refusal(block) else ("sorted_gemm", "grouped_mm")


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(GroupedGemmParams, (("impl", impls(block)), ("combine", COMBINES)))


def default_params(block: MoEBlock, T: int, target: Target) -> GroupedGemmParams:
    """grouped_mm where it runs (no host loop: as fast as the loop or slightly faster on CPU)."""
    return GroupedGemmParams(impls(block)[-1], "index_add")


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


def grouped_expert_rows(
    block: MoEBlock, w: ExpertTensors, xs_s: torch.Tensor, e_s: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Expert-sorted rows xs_s [n, D], their expert ids e_s [n] (sentinel E allowed at the tail) and
    rows per expert counts [E] → y_s [n, D] (tail rows undefined)."""
    if block.weight_format.quantized:
        return _grouped_dequantized_rows(block, w, xs_s, counts)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] cumulative row ends
    e_c = e_s.clamp(max=block.E - 1)  # [n] in-bounds bias gather for the tail
    gu = _grouped_mm(xs_s, kn(block, w.gate_up), offs=offs)  # [n, 2F]
    if w.gate_up_bias is not None:
        gu = gu + w.gate_up_bias.index_select(0, e_c)
    h = activate(block, gu).contiguous()  # [n, F]
    y_s = _grouped_mm(h, kn(block, w.down), offs=offs)  # [n, D]
    if w.down_bias is not None:
        y_s = y_s + w.down_bias.index_select(0, e_c)
    return y_s


def _grouped_dequantized_rows(
    block: MoEBlock, w: ExpertTensors, xs_s: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """grouped_mm over block-quantised weights: the active experts (counts > 0, read on the host) in
    groups whose dequantised copies fit GATHER_WORKSPACE_BYTES, one grouped_mm per group over its
    contiguous rows; rows past the active experts (sentinels) are zero."""
    y_s = xs_s.new_zeros(xs_s.shape)  # [n, D]
    active = counts.nonzero().squeeze(1)  # [n_a] expert ids with rows, ascending
    if not active.numel():
        return y_s
    group = max(1, int(GATHER_WORKSPACE_BYTES // copy_bytes_per_expert(block)))
    ends = torch.cumsum(counts, 0)  # [E] row end of each expert
    for g in range(0, active.numel(), group):
        ids = active[g : g + group]  # [c]
        lo, hi = int(ends[ids[0]] - counts[ids[0]]), int(ends[ids[-1]])
        offs = torch.cumsum(counts.index_select(0, ids), 0, dtype=torch.int32)  # [c]
        gu = _grouped_mm(xs_s[lo:hi], kn(block, expert_weights(block, w, "gate_up", ids)), offs=offs)  # [m, 2F]
        h = activate(block, gu).contiguous()  # [m, F]
        y_s[lo:hi] = _grouped_mm(h, kn(block, expert_weights(block, w, "down", ids)), offs=offs)  # [m, D]
    return y_s


ExpertRows = Callable[[ExpertTensors, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def build(block: MoEBlock, schedule: Schedule) -> ExpertsFn:
    params = schedule.params
    if params.impl == "grouped_mm":
        why = grouped_mm_refusal(block)
        if why:
            raise UnsupportedSchedule(why)

        def rows(w: ExpertTensors, xs_s: torch.Tensor, e_s: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return grouped_expert_rows(block, w, xs_s, e_s, counts[: block.E])  # [S, D]
    else:

        def rows(w: ExpertTensors, xs_s: torch.Tensor, e_s: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return sorted_expert_rows(block, w, xs_s, counts[: block.E].tolist())  # host loop

    return _sorted_rows_fn(block, params.combine, rows, params.impl)


def _sorted_rows_fn(block: MoEBlock, combine: Combine, expert_rows: ExpertRows, name: str) -> ExpertsFn:
    """The ExpertsFn: sort the pairs by expert, run `expert_rows(w, xs_s [S, D], e_s [S], counts [E+1])
    → y_s [S, D]` over the expert-sorted rows, combine back to token order."""

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        T, k = ids.shape
        if T == 0:
            return empty_out(x)
        p = pairs(block, ids, weights)
        order, e_s, counts = sort_pairs(p, block.E)  # [S], [S], [E+1]
        xs_s = input_rows(
            block, x, p.tok.index_select(0, order), p.weight.index_select(0, order), compute_dtype(block, w)
        )  # [S, D]
        y_s = expert_rows(w, xs_s, e_s, counts)  # [S, D]
        return combine_sorted(combine, block, T, k, y_s, order, p, x.dtype)

    run.__name__ = run.__qualname__ = name
    return run


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): T·k rows of FFN; each distinct expert's weights read once; int64 ids and order;
    the float32 un-permute when the combine is unsort_sum."""
    S = tokens * block.k
    b = uniform_distinct(block.E, block.k, tokens) * block.weight_bytes_per_expert
    b += activation_bytes(block, tokens) + S * 16
    if schedule.params.combine == "unsort_sum":
        b += 2 * S * block.D * 4
    return ffn_flops(block, S), b


KIND = KernelKind("grouped_gemm", GroupedGemmParams, space, default_params, build, cost,
                  sources(__file__, SOURCES), formats=FORMATS)
