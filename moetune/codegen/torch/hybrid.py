"""hybrid: experts with ≥ R rows run one GEMM over their rows, the rest gathered GEMVs.

    order, counts = sort pairs by expert                    (R = Schedule.row_threshold)
    heavy experts (m_e ≥ R): GEMM over their contiguous rows  (impl: sorted_gemm loop | grouped_mm)
    light experts (m_e < R): their rows in chunks of gathered bmm (as stream_gemv)
    combine (unsort_sum) in float32

Skewed routing at middle token counts gives a few hot experts many rows and most one row; the
hybrid reads each hot expert's weights once for all its rows and pays the gather only for the
light ones. Splitting the pairs reads the counts on the host (`tolist()`, `nonzero`): free on
CPU, a sync on a GPU, where the device backends do the split on the device instead.
Refused with the reason when the light part's gather workspace exceeds GATHER_WORKSPACE_BYTES,
or when impl=grouped_mm and the block's strides do not suit torch's grouped GEMM. Block-quantised
(fp8_block) weights are dequantised per expert or per chunk, as in grouped_gemm and stream_gemv.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...targets import Target
from ..contract import KernelKind, sources
from ..space import ParamSpace
from ..tensors import ExpertsFn, ExpertTensors
from ._common import (
    FORMATS,
    activation_bytes,
    check_chunk,
    chunks,
    combine_sorted,
    compute_dtype,
    copy_bytes_per_expert,
    empty_out,
    ffn_flops,
    gather_refusal,
    gathered_space,
    grouped_mm_refusal,
    input_rows,
    pairs,
    sort_pairs,
)
from .grouped_gemm import grouped_expert_rows, impls, sorted_expert_rows
from .stream_gemv import gathered_expert_rows, pair_chunk

SOURCES = ("hybrid.py", "grouped_gemm.py", "stream_gemv.py", "_common.py", "reference.py")


@dataclass(frozen=True)
class HybridParams:
    """heavy: how the experts with ≥ R rows are computed; chunk: light pairs per gathered bmm."""

    heavy: Literal["sorted_gemm", "grouped_mm"] = "sorted_gemm"
    chunk: int = 32

    def __post_init__(self) -> None:
        if self.heavy not in ("sorted_gemm", "grouped_mm"):
            raise UnsupportedSchedule(
                f"HybridParams.heavy = {self.heavy!r}: supported sorted_gemm, grouped_mm"
            )
        check_chunk("HybridParams", self.chunk)


def refusal(block: MoEBlock) -> str | None:
    """Why the hybrid cannot run `block`: its light part's gathered copy of one expert over the bound."""
    return gather_refusal(block, 1)


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return gathered_space("hybrid", block, HybridParams, (("heavy", impls(block)), ("chunk", chunks(block))))


def default_params(block: MoEBlock, T: int, target: Target) -> HybridParams:
    """The sorted GEMM loop for the heavy experts; the light pairs in one gathered bmm where it fits."""
    return HybridParams("sorted_gemm", pair_chunk(space(block, target).choices[1][1], block, T))


def build(block: MoEBlock, schedule: Schedule) -> ExpertsFn:
    params, row_threshold = schedule.params, schedule.row_threshold
    why = gather_refusal(block, params.chunk)
    if why is None and params.heavy == "grouped_mm":
        why = grouped_mm_refusal(block)
    if why:
        raise UnsupportedSchedule(why)
    if not isinstance(row_threshold, int) or row_threshold < 2:
        raise UnsupportedSchedule(f"hybrid row_threshold = {row_threshold!r}: need an int ≥ 2")
    R, chunk, heavy_impl, E = row_threshold, params.chunk, params.heavy, block.E

    def hybrid(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        T, k = ids.shape
        if T == 0:
            return empty_out(x)
        p = pairs(block, ids, weights)
        order, e_s, counts = sort_pairs(p, E)  # [S], [S], [E+1]
        xs_s = input_rows(
            block, x, p.tok.index_select(0, order), p.weight.index_select(0, order), compute_dtype(block, w)
        )  # [S, D]
        rows_e = counts[e_s.clamp(max=E - 1)]  # [S] rows of each pair's expert
        is_heavy = (rows_e >= R) & (e_s < E)  # [S]
        is_light = (rows_e < R) & (e_s < E)  # [S]
        y_s = xs_s.new_zeros(xs_s.shape)  # [S, D]
        heavy_idx = is_heavy.nonzero().squeeze(1)  # [n_h] (host sync: fine on CPU)
        if heavy_idx.numel():
            heavy_counts = torch.where(counts[:E] >= R, counts[:E], torch.zeros_like(counts[:E]))  # [E]
            xs_h = xs_s.index_select(0, heavy_idx)  # [n_h, D], still expert-sorted
            if heavy_impl == "grouped_mm":
                y_h = grouped_expert_rows(block, w, xs_h, e_s.index_select(0, heavy_idx), heavy_counts)
            else:
                y_h = sorted_expert_rows(block, w, xs_h, heavy_counts.tolist())
            y_s.index_copy_(0, heavy_idx, y_h.to(y_s.dtype))
        light_idx = is_light.nonzero().squeeze(1)  # [n_l]
        if light_idx.numel():
            y_l = gathered_expert_rows(
                block, w, xs_s.index_select(0, light_idx), e_s.index_select(0, light_idx), chunk
            )  # [n_l, D]
            y_s.index_copy_(0, light_idx, y_l.to(y_s.dtype))
        return combine_sorted("unsort_sum", block, T, k, y_s, order, p, x.dtype)

    return hybrid


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes) under uniform routing, m_e ~ Binomial(T, k/E): heavy experts' weights read once,
    light pairs gathered (read, copy, read)."""
    row_threshold = schedule.row_threshold
    S = tokens * block.k
    heavy_share, heavy_rows_share = binomial_tail(tokens, block.k / block.E, row_threshold)
    heavy_e = block.E * heavy_share  # expected experts with m_e ≥ R
    light_rows = max(0.0, S - block.E * heavy_rows_share)
    b = (
        heavy_e * block.weight_bytes_per_expert
        + light_rows * (block.weight_bytes_per_expert + 2.0 * copy_bytes_per_expert(block))
        + activation_bytes(block, tokens)
        + 2 * S * block.D * 4
    )
    return ffn_flops(block, S), b


def binomial_tail(n: int, q: float, r: int) -> tuple[float, float]:
    """(P[m ≥ r], E[m · 1{m ≥ r}]) for m ~ Binomial(n, q), in log space (no overflow at large n)."""
    if n <= 0 or r > n:
        return 0.0, 0.0
    if q >= 1.0:
        return 1.0, float(n)
    lq, l1q, ln = math.log(q), math.log1p(-q), math.lgamma(n + 1)
    p_tail = m_tail = 0.0
    for m in range(max(r, 0), n + 1):
        pm = math.exp(ln - math.lgamma(m + 1) - math.lgamma(n - m + 1) + m * lq + (n - m) * l1q)
        p_tail += pm
        m_tail += m * pm
    return min(p_tail, 1.0), m_tail


KIND = KernelKind("hybrid", HybridParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=refusal, formats=FORMATS)
