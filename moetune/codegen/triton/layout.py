"""Host side of the Triton kernels: the weights' strides, one call's launch arguments, shared constexprs,
and the checks of parameters against the target (shared memory of one block).

Weights are read in place through strides (`GateUpStrides`, `DownStrides`): the standard layout
gate_up [E, 2F, D] / down [E, D, F], transposed [E, D, 2F] / [E, F, D], gate|up halves or interleaved.
Dimension letters (see moetune/ir/block.py): E experts, k top-k, D hidden, F intermediate, T tokens,
P = T·k (token, expert) pairs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...ir import MoEBlock, UnsupportedSchedule
from ...targets import Target
from ..tensors import ExpertTensors

ACT_CODES = {"swiglu": 0, "clamped_swiglu": 1}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def flat_pairs(t: torch.Tensor) -> torch.Tensor:
    """ids or routing weights [T, k] as the [P] the kernels index by pair, contiguous: `reshape` alone returns a
    strided view where one exists (k = 1 or T = 1 of a non-contiguous tensor), which a kernel reading
    `ptr + pair` would misread; the copy, where one is made, is O(T·k)."""
    return t.reshape(-1).contiguous()


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ on the host (triton.cdiv is a constexpr function: slower to call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def check_pow2(owner: str, **fields: int) -> None:
    for name, v in fields.items():
        if not is_pow2(v):
            raise UnsupportedSchedule(f"{owner}.{name} = {v!r}: must be a power of two (Triton block size)")


def dot_smem_bytes(bm: int, bn: int, bk: int, stages: int, n_b: int, elem: int = 2) -> int:
    """Shared memory of a pipelined tl.dot loop: `stages` copies of the A tile and `n_b` B tiles."""
    return stages * (bm * bk + n_b * bk * bn) * elem


def check_smem(what: str, need: int, target: Target, knob: str) -> None:
    """Refuse `what` when it needs more shared memory than one block has on `target` (no limit: None)."""
    limit = target.smem_per_block
    if limit is not None and need > limit:
        raise UnsupportedSchedule(f"{what}: needs {need // 1024} KiB shared memory, limit {limit // 1024} KiB "
                                  f"on {target.name}; {knob}")


@dataclass(frozen=True)
class GateUpStrides:
    """Element strides of gate_up: gate row n, column k of expert e is at e·se + n·sn + k·sk;
    the up row n is `up` elements after the gate row n.  Bias: e·sbe + n·sbn, up at + bup."""

    se: int
    sn: int
    sk: int
    up: int
    sbe: int = 0
    sbn: int = 0
    bup: int = 0


@dataclass(frozen=True)
class DownStrides:
    """down row n (of D), column k (of F) of expert e at e·se + n·sn + k·sk; bias e·sbe + n·sbn."""

    se: int
    sn: int
    sk: int
    sbe: int = 0
    sbn: int = 0


def layout_strides(block: MoEBlock, w: ExpertTensors) -> tuple[GateUpStrides, DownStrides]:
    """Read the strides of the model's own tensors (views and non-contiguous tensors included)."""
    lay, F = block.layout, block.F
    gu, dn = w.gate_up, w.down
    if lay.transposed:  # gate_up [E, D, 2F], down [E, F, D]
        g_row, g_k = gu.stride(2), gu.stride(1)
        d_n, d_k = dn.stride(2), dn.stride(1)
    else:  # gate_up [E, 2F, D], down [E, D, F]
        g_row, g_k = gu.stride(1), gu.stride(2)
        d_n, d_k = dn.stride(1), dn.stride(2)
    g_n, g_up = (2 * g_row, g_row) if lay.interleaved else (g_row, F * g_row)
    sbe = sbn = bup = dbe = dbn = 0
    if lay.has_bias:
        b = w.gate_up_bias
        sbe, sbn, bup = b.stride(0), (2 if lay.interleaved else 1) * b.stride(1), (
            b.stride(1) if lay.interleaved else F * b.stride(1))
        dbe, dbn = w.down_bias.stride(0), w.down_bias.stride(1)
    return (GateUpStrides(gu.stride(0), g_n, g_k, g_up, sbe, sbn, bup),
            DownStrides(dn.stride(0), d_n, d_k, dbe, dbn))


def check_call(block: MoEBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """x [T, D] with a contiguous hidden dimension, ids and weights [T, k]; UnsupportedSchedule names the
    tensor and both shapes (the weights: `ExpertTensors.check`)."""
    if x.dim() != 2 or x.shape[1] != block.D:
        raise UnsupportedSchedule(f"x has shape {tuple(x.shape)}, block needs [T, {block.D}]")
    T = x.shape[0]
    if tuple(ids.shape) != (T, block.k) or tuple(weights.shape) != (T, block.k):
        raise UnsupportedSchedule(
            f"ids {tuple(ids.shape)} / weights {tuple(weights.shape)}: need [{T}, {block.k}]")
    if x.stride(1) != 1:
        raise UnsupportedSchedule(f"x stride {x.stride()}: the hidden dimension must be contiguous")


@dataclass(frozen=True)
class CallArgs:
    """What every launcher derives from one call: sizes, the weights' strides and bias pointers, the
    flat routing weights and the constexprs all kernels share (from `call_args`)."""

    T: int
    P: int
    gs: GateUpStrides
    ds: DownStrides
    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    weights: torch.Tensor  # [P]
    meta: dict


def call_args(block: MoEBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              w: ExpertTensors, memo: dict) -> CallArgs:
    """Check one call's shapes and gather the launch arguments every kernel needs.

    `memo` (one dict per built kernel) keeps what the weights' shapes, strides and dtypes and x's
    dtype decide (the weight shape check, strides, constexprs), keyed by exactly those: a call with
    the same weights skips that host work. Tensors are never kept."""
    check_call(block, x, ids, weights)
    gu, dn, gb, db = w.gate_up, w.down, w.gate_up_bias, w.down_bias
    key = (x.dtype, gu.dtype, gu.shape, gu.stride(), dn.dtype, dn.shape, dn.stride(),
           None if gb is None else (gb.shape, gb.stride()), None if db is None else (db.shape, db.stride()))
    hit = memo.get(key)
    if hit is None:
        w.check(block)
        gs, ds = layout_strides(block, w)
        hit = gs, ds, dict(K_TOP=block.k, BLOCK_E=max(16, next_pow2(block.E)), **consts(block, x, w))
        if len(memo) >= 16:  # weights swapped many times over: start afresh
            memo.clear()
        memo[key] = hit
    gs, ds, meta = hit
    T = x.shape[0]
    gb, db = bias_args(block, w)
    return CallArgs(T, T * block.k, gs, ds, gb, db, flat_pairs(weights), meta)


def act_args(block: MoEBlock) -> tuple[float, float]:
    """(alpha, limit) of the activation as kernel scalars (0 where it has none)."""
    act = block.activation
    return float(act.alpha or 0.0), float(act.limit or 0.0)


def bias_args(block: MoEBlock, w: ExpertTensors):
    """(gate_up bias, down bias) pointers; the weights themselves stand in when there is no bias."""
    if block.layout.has_bias:
        return w.gate_up_bias, w.down_bias
    return w.gate_up, w.down


def consts(block: MoEBlock, x: torch.Tensor, w: ExpertTensors) -> dict:
    """Constexprs every kernel shares; UPCAST: bf16 tl.dot is wrong when interpreted, so upcast there."""
    bf16 = torch.bfloat16 in (x.dtype, w.gate_up.dtype, w.down.dtype)
    return dict(ACT=ACT_CODES[block.activation.kind], HAS_BIAS=block.layout.has_bias,
                W_IN=block.weight_application == "input", UPCAST=interpreting() and bf16)


def tma_refusal(block: MoEBlock) -> str | None:
    """Why the TMA operand path cannot run this block (None: it can)."""
    lay = block.layout
    if lay.transposed or lay.interleaved:
        return ("tma reads gate_up as [E·2F, D] (gate rows, then up rows, hidden dimension contiguous): "
                f"the standard layout only, this block's is {'transposed' if lay.transposed else 'interleaved'}")
    wb = 4 if block.weight_dtype == "float32" else 2
    for name, n in (("D", block.D), ("F", block.F)):
        if n * wb % 16:
            return f"tma rows must be multiples of 16 bytes: {name} = {n} × {wb} B is not"
    return None
