"""Pieces every torch CPU variant shares: routing pairs, per-layout projections, the combine.

Letters as in `moetune.ir.block`; S = T·k is the number of (token, expert) pairs of a call.

A variant computes, for pairs sorted or not,
    y_s = down[e_s] · act(gate_up[e_s] · x_{t_s})          (+ biases)        in the weight dtype
and the combine sums w_s · y_s back into token order in float32, then casts to x.dtype.
Ids outside [0, E) (expert-parallel sentinels) become the id E, get routing weight 0, and their
rows are forced to 0 (a kernel may leave them uninitialised): they contribute nothing.

Weights are the model's own tensors; `kn(...)` only returns views ([.., K, N] so that
rows @ view is the projection), so nothing here copies or repacks a weight. Block-quantised weights
(fp8_block) are read the same way: `expert_weights` dequantises only the experts a call selects
(moetune.codegen.quant, the one rule) into a transient copy in the compute dtype, and the variants bound
that copy as they bound their gathers (GATHER_WORKSPACE_BYTES).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from ...ir import DTYPE_BYTES, MoEBlock, UnsupportedSchedule
from ..quant import dequantize_blocks
from ..space import ParamSpace
from ..tensors import ExpertTensors
from .reference import apply_activation, split_gate_up

Combine = Literal["unsort_sum", "index_add"]
COMBINES: tuple[Combine, ...] = ("unsort_sum", "index_add")

# Bound on the gathered-weights workspace of the GEMV variants (gathered, hybrid's light part):
# chunk × one expert's weights must fit in it. Above it, the variant is refused with the reason.
FORMATS = ("none", "fp8_block")  # what every torch kernel reads: unquantised weights, FP8 blocks dequantised per call
GATHER_WORKSPACE_BYTES = 256 * 2**20
CHUNKS = (4, 16, 64, 256)  # pairs per gathered bmm the GEMV variants offer


def check_combine(owner: str, combine: str) -> None:
    if combine not in COMBINES:
        raise UnsupportedSchedule(f"{owner}.combine = {combine!r}: supported {', '.join(COMBINES)}")


def check_chunk(owner: str, chunk: int) -> None:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise UnsupportedSchedule(f"{owner}.chunk = {chunk!r}: need a positive int (pairs per gathered bmm)")


def copy_bytes_per_expert(block: MoEBlock) -> float:
    """Bytes of one expert's weights as a variant's transient copy holds them: the stored bytes for
    unquantised weights; for block-quantised ones the gathered values and scales, the float32 values,
    expanded scales and products of their dequantisation, and the copy in the compute dtype."""
    if not block.weight_format.quantized:
        return block.weight_bytes_per_expert
    n = 3 * block.D * block.F
    return block.weight_bytes_per_expert + n * (3 * 4 + DTYPE_BYTES[block.weight_format.compute_dtype])


def gather_refusal(block: MoEBlock, chunk: int) -> str | None:
    """None if `chunk` gathered expert copies fit the workspace bound, else the reason."""
    per_expert = copy_bytes_per_expert(block)
    need = chunk * per_expert
    if need <= GATHER_WORKSPACE_BYTES:
        return None
    fit = GATHER_WORKSPACE_BYTES // per_expert
    knob = f"lower chunk to ≤ {fit}" if fit >= 1 else "use grouped_gemm (one expert alone exceeds it)"
    return (
        f"block {block.name or block.signature_hash()}: gathered GEMV copies chunk={chunk} experts × "
        f"{per_expert / 2**20:.1f} MiB = {need / 2**20:.1f} MiB of weights, limit "
        f"{GATHER_WORKSPACE_BYTES / 2**20:.0f} MiB (GATHER_WORKSPACE_BYTES); {knob}"
    )


def gathered_space(kind: str, block: MoEBlock, params: type, choices: tuple) -> ParamSpace:
    """The space of a kind that gathers one expert's weights per chunk of pairs (stream_gemv, the hybrid's
    light part); UnsupportedSchedule with the reason where one expert's copy is over the workspace bound."""
    why = gather_refusal(block, 1)
    if why:
        raise UnsupportedSchedule(f"torch {kind} refused: {why}")
    return ParamSpace(params, choices)


def chunks(block: MoEBlock) -> tuple[int, ...]:
    """The CHUNKS whose gathered copies fit the workspace bound (the smallest possible when none does)."""
    return tuple(c for c in CHUNKS if gather_refusal(block, c) is None) or (1,)


def grouped_mm_refusal(block: MoEBlock) -> str | None:
    """torch grouped_mm on CPU needs every row stride to be a multiple of 16 bytes (of the weights it
    multiplies: the compute dtype's copy for block-quantised weights)."""
    dt = block.weight_format.compute_dtype
    b = DTYPE_BYTES[dt]
    bad = [f"{n}={v} ({v * b} B)" for n, v in (("D", block.D), ("F", block.F)) if (v * b) % 16]
    if not bad:
        return None
    return (
        f"block {block.name or block.signature_hash()}: grouped_mm needs row strides that are multiples "
        f"of 16 bytes, got {', '.join(bad)} in {dt}; use impl=sorted_gemm"
    )


class Pairs(NamedTuple):
    """The T·k (token, expert) pairs of one call, in row-major [T, k] order."""

    tok: torch.Tensor  # [S] int64 token of each pair
    expert: torch.Tensor  # [S] int64 expert id; ids outside [0, E) → E
    weight: torch.Tensor  # [S] float32 routing weight; 0 where invalid
    valid: torch.Tensor  # [S] bool


def pairs(block: MoEBlock, ids: torch.Tensor, weights: torch.Tensor) -> Pairs:
    T, k = ids.shape
    ids = ids.reshape(-1).long()  # [S]
    valid = (ids >= 0) & (ids < block.E)  # [S]
    expert = torch.where(valid, ids, torch.full_like(ids, block.E))  # [S]
    wt = torch.where(
        valid, weights.reshape(-1).float(), torch.zeros((), dtype=torch.float32, device=ids.device)
    )
    tok = torch.arange(T, device=ids.device).repeat_interleave(k)  # [S]
    return Pairs(tok, expert, wt, valid)


def input_rows(
    block: MoEBlock, x: torch.Tensor, tok: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """x rows of the given pairs [n, D] in the weight dtype; scaled by the routing weight when the
    block applies it on the input side."""
    xs = x.index_select(0, tok)  # [n, D]
    if block.weight_application == "input":
        xs = xs.float() * weight.unsqueeze(1)  # [n, D]
    return xs.to(dtype)


def kn(block: MoEBlock, w: torch.Tensor) -> torch.Tensor:
    """View of a weight ([E, N, K] standard or [E, K, N] transposed) as [.., K, N]; no copy."""
    return w if block.layout.transposed else w.transpose(-2, -1)


def activate(block: MoEBlock, gu: torch.Tensor) -> torch.Tensor:
    """[n, 2F] → [n, F] per the layout (halves / interleaved) and the activation."""
    return apply_activation(block.activation, *split_gate_up(block, gu))


def expert_weights(block: MoEBlock, w: ExpertTensors, which: str, experts: int | torch.Tensor) -> torch.Tensor:
    """`which` ("gate_up" | "down") of expert `experts` (an int: [N, K]) or experts ids [c] ([c, N, K]), in
    the stored layout: a view of the model's tensor (int) or a gathered copy (ids); block-quantised weights
    dequantised with their block scales (moetune.codegen.quant) into a transient copy in the compute dtype."""
    t = getattr(w, which)
    pick = (lambda a: a[experts]) if isinstance(experts, int) else (lambda a: a.index_select(0, experts))
    fmt = block.weight_format
    if not fmt.quantized:
        return pick(t)
    scale = getattr(w, f"{which}_scale")
    return dequantize_blocks(pick(t), pick(scale), fmt.block).to(getattr(torch, fmt.compute_dtype))


def expert_ffn(block: MoEBlock, w: ExpertTensors, e: int, xs: torch.Tensor) -> torch.Tensor:
    """One expert on its rows: xs [m, D] → [m, D], two torch.mm on views of the model's tensors (on the
    expert's dequantised copy for block-quantised weights)."""
    gu = xs @ kn(block, expert_weights(block, w, "gate_up", e))  # [m, 2F]
    if w.gate_up_bias is not None:
        gu = gu + w.gate_up_bias[e]
    h = activate(block, gu)  # [m, F]
    y = h @ kn(block, expert_weights(block, w, "down", e))  # [m, D]
    if w.down_bias is not None:
        y = y + w.down_bias[e]
    return y


def combine_sorted(
    how: Combine,
    block: MoEBlock,
    T: int,
    k: int,
    y_s: torch.Tensor,
    order: torch.Tensor,
    p: Pairs,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Rows in expert-sorted order y_s [S, D] → out [T, D] (float32 sum, then out_dtype)."""
    valid_s = p.valid.index_select(0, order).unsqueeze(1)  # [S, 1]
    y_s = torch.where(valid_s, y_s.float(), torch.zeros((), dtype=torch.float32, device=y_s.device))  # [S, D]
    if block.weight_application == "output":
        y_s = y_s * p.weight.index_select(0, order).unsqueeze(1)  # [S, D]
    if how == "index_add":
        out = torch.zeros((T, y_s.shape[1]), dtype=torch.float32, device=y_s.device)  # [T, D]
        out.index_add_(0, p.tok.index_select(0, order), y_s)
        return out.to(out_dtype)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)  # [S]
    return y_s.index_select(0, inv).view(T, k, -1).sum(1).to(out_dtype)  # [T, D]


def combine_pairs(
    block: MoEBlock, T: int, k: int, y: torch.Tensor, p: Pairs, out_dtype: torch.dtype
) -> torch.Tensor:
    """Rows in pair order y [S, D] → out [T, D]."""
    y = torch.where(p.valid.unsqueeze(1), y.float(), torch.zeros((), dtype=torch.float32, device=y.device))
    if block.weight_application == "output":
        y = y * p.weight.unsqueeze(1)  # [S, D]
    return y.view(T, k, -1).sum(1).to(out_dtype)  # [T, D]


def sort_pairs(p: Pairs, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [S], expert ids in sorted order [S], rows per expert counts [E+1]) without host sync.

    Sentinels (id E) sort to the tail; counts[E] is their number.
    """
    e_s, order = torch.sort(p.expert, stable=True)  # [S], [S]
    counts = torch.zeros(E + 1, dtype=torch.int64, device=e_s.device)
    counts.scatter_add_(0, e_s, torch.ones_like(e_s))  # [E+1]
    return order, e_s, counts


def empty_out(x: torch.Tensor) -> torch.Tensor:
    return x.new_zeros((0, x.shape[1]))


def compute_dtype(block: MoEBlock, w: ExpertTensors) -> torch.dtype:
    """The dtype the GEMMs run in: the weights' own, or the compute dtype of block-quantised weights."""
    if block.weight_format.quantized:
        return getattr(torch, block.weight_format.compute_dtype)
    return w.gate_up.dtype


# ---------------------------------------------------------------- cost model (flops, bytes) ----


def ffn_flops(block: MoEBlock, rows: float) -> float:
    """Flops of `rows` expert rows: two GEMMs (2·D·2F + 2·F·D per row) plus the activation."""
    return rows * (6.0 * block.D * block.F + 4.0 * block.F)


def activation_bytes(block: MoEBlock, tokens: int) -> float:
    """Bytes of x, the intermediate rows and the output for T tokens (in the compute dtype)."""
    b = DTYPE_BYTES[block.weight_format.compute_dtype]
    S = tokens * block.k
    return b * (tokens * block.D + S * (block.D + 3 * block.F + block.D) + tokens * block.D)
