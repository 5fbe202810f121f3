"""FP8 block quantisation: the one definition every kernel, reference, test and checkpoint writer uses.

Weights (scheme fp8_block, as DeepSeek-V3 and Qwen3-FP8 publish them and transformers' FP8Experts holds
them): a matrix [out, in] of float8_e4m3fn values `q` and one dequantisation multiplier per
(rows, cols) block, `scale_inv` [⌈out/rows⌉, ⌈in/cols⌉]:

    w[i, j] ≈ q[i, j] · scale_inv[i // rows, j // cols]
    scale_inv = amax(|w| over the block) / 448          (float32; ue8m0: rounded up to a power of two)

Activations (the w8a8 schedules): each row quantised per group of `group` consecutive channels, the
same scales with a 1 × group block, the values multiplied by the scale's reciprocal (`quantize_rows`). A
zero block gets scale 1 (its values are zeros). A schedule names its activation rule as `act_quant`: "none"
(weight-only, w8a16) or "fp8_1x<group>" (`act_group`).
"""

from __future__ import annotations

import re

import torch

from ..ir import UnsupportedSchedule

ACT_QUANT = re.compile(r"fp8_1x(\d+)$")


def act_group(act_quant: str) -> int | None:
    """Channels per activation scale of `act_quant` ("fp8_1x128" → 128; "none" → None)."""
    if act_quant == "none":
        return None
    m = ACT_QUANT.match(act_quant)
    if m is None:
        raise UnsupportedSchedule(f"act_quant = {act_quant!r}: 'none' or 'fp8_1x<group>'")
    return int(m.group(1))


def activation_group(params) -> int | None:
    """`act_group` of a schedule's parameters (None where they quantise no activations or have no such field)."""
    return act_group(getattr(params, "act_quant", "none"))

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
UE8M0 = getattr(torch, "float8_e8m0fnu", None)  # power-of-two scales in one byte (torch ≥ 2.7)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(out: int, cols_in: int, block: tuple[int, int]) -> tuple[int, int]:
    """[⌈out/rows⌉, ⌈in/cols⌉]: one matrix's scales."""
    return cdiv(out, block[0]), cdiv(cols_in, block[1])


def gate_up_scale_shape(F: int, D: int, block: tuple[int, int]) -> tuple[int, int]:
    """[2·⌈F/rows⌉, ⌈D/cols⌉]: a fused gate_up's scales, each half in whole blocks of its own (equal to
    scale_shape(2F, D) when rows divides F)."""
    return 2 * cdiv(F, block[0]), cdiv(D, block[1])


def _pad_to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [..., out, in] zero-padded to whole blocks."""
    out, cin = w.shape[-2:]
    po, pi = cdiv(out, block[0]) * block[0] - out, cdiv(cin, block[1]) * block[1] - cin
    return torch.nn.functional.pad(w, (0, pi, 0, po)) if po or pi else w


def block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |w| over each (rows, cols) block of w [..., out, in] → [..., ⌈out/rows⌉, ⌈in/cols⌉] float32."""
    p = _pad_to_blocks(w.float(), block)
    *lead, o, i = p.shape
    return p.reshape(*lead, o // block[0], block[0], i // block[1], block[1]).abs().amax(dim=(-3, -1))


def expand_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Per-block scales [..., nb_out, nb_in] → one per element [..., out, in] (float32)."""
    s = scale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return s[..., : shape[0], : shape[1]]


def scales_from_amax(amax: torch.Tensor, scale_dtype: str = "float32") -> torch.Tensor:
    """The dequantisation multiplier of blocks with max |w| `amax`: amax / 448, 1 for an all-zero block;
    ue8m0 rounds it up to a power of two (so no value overflows ±448) and stores it as float8_e8m0fnu."""
    # a tensor divisor: torch on CUDA computes tensor / number as a product with the number's reciprocal, which
    # differs from the correctly rounded quotient in the last bit (and e4m3 ties of 16-bit inputs then round the
    # other way); tensor / tensor is correctly rounded on every device
    s = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    if scale_dtype == "float32":
        return s
    if scale_dtype != "ue8m0":
        raise ValueError(f"scale dtype {scale_dtype!r}: float32 or ue8m0")
    if UE8M0 is None:
        raise ValueError(f"ue8m0 scales need torch.float8_e8m0fnu (torch ≥ 2.7), this is torch {torch.__version__}")
    return torch.exp2(torch.ceil(torch.log2(s))).to(UE8M0)


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 v clamped to ±448 and rounded to nearest e4m3 by the cast."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int],
                    scale_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [..., out, in], scale_inv [..., nb_out, nb_in]) of w [..., out, in] (any float).

    Values are divided by their block's scale, clamped to ±448 and rounded to nearest by the cast."""
    out, cin = w.shape[-2:]
    scale = scales_from_amax(block_amax(w, block), scale_dtype)
    return _to_e4m3(w.float() / expand_scales(scale, (out, cin), block)), scale


def quantize_gate_up(w: torch.Tensor, block: tuple[int, int],
                     scale_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """A fused gate_up [..., 2F, D] quantised as checkpoints store it: the gate and up halves each in whole
    blocks of their own, the two results concatenated (scales [..., 2·⌈F/rows⌉, ⌈D/cols⌉])."""
    F = w.shape[-2] // 2
    qg, sg = quantize_blocks(w[..., :F, :], block, scale_dtype)
    qu, su = quantize_blocks(w[..., F:, :], block, scale_dtype)
    return torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2)


def dequantize_gate_up(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [..., 2F, D] of a fused gate_up whose halves have their own scale rows (`quantize_gate_up`)."""
    F = q.shape[-2] // 2
    nb = scale_inv.shape[-2] // 2
    return torch.cat([dequantize_blocks(q[..., :F, :], scale_inv[..., :nb, :], block),
                      dequantize_blocks(q[..., F:, :], scale_inv[..., nb:, :], block)], dim=-2)


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [..., out, in] = q · scale_inv per block (scales beyond the matrix's blocks are ignored)."""
    return q.float() * expand_scales(scale_inv, tuple(q.shape[-2:]), block)


def quantize_rows(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-`group`-channel quantisation of activations x [M, K]: (q e4m3 [M, K], scale [M, ⌈K/group⌉]
    float32), the w8a8 rule: x ≈ q · scale. The scale as the weights' (amax / 448, 1 for a zero group); the
    values multiplied by its reciprocal (1 / scale, rounded once), then clamped and rounded to e4m3: one
    division per group and a product per value (the kernels' `_quant_groups` computes the same, bit for bit)."""
    block = (1, group)
    scale = scales_from_amax(block_amax(x, block))
    recip = torch.ones_like(scale) / scale
    return _to_e4m3(x.float() * expand_scales(recip, tuple(x.shape[-2:]), block)), scale


def fake_quantize_rows(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x through the w8a8 activation rule and back, float32: what a w8a8 kernel's products see."""
    q, s = quantize_rows(x, group)
    return dequantize_blocks(q, s, (1, group))
