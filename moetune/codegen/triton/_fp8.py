"""Triton jit helpers shared by the FP8 kernel files (stream_gemv_fp8.py, grouped_gemm_fp8.py, hybrid_fp8.py),
and the host view of their block scales.

Block scales (moetune.codegen.quant, ir.WeightFormat): float32 as stored, or ue8m0 (torch.float8_e8m0fnu) read
as its bytes and widened in registers (`_ue8m0`, the one decode of the format). e4m3 rounding of activations
(quant.quantize_rows' rule, `_quant_groups`) and its interpreter forms (`_round_e4m3`, `_round_bf16`,
`_widen_e4m3`): interpreted (TRITON_INTERPRET=1, EMULATE), Triton's float → e4m3 and float → bf16 casts do
not round to nearest and its e4m3 → float cast widens the NaN bytes to ±480, so values are rounded in fp32
arithmetic first and then cast exactly; compiled, the conversion instructions round to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ir import UnsupportedSchedule


def block_scales(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A scale tensor as the kernels read it, and whether it is ue8m0: float32 as it is, ue8m0
    (float8_e8m0fnu, or its bytes) as bytes."""
    if t.dtype == torch.float32:
        return t, False
    if t.element_size() == 1:
        return t.view(torch.uint8), True
    raise UnsupportedSchedule(f"block scales of dtype {t.dtype}: float32 or float8_e8m0fnu (ue8m0)")


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| ≤ 448 or NaN) rounded to the nearest e4m3 value (ties to even, subnormals kept), in fp32
    arithmetic: the interpreter's float → e4m3 cast is exact only on the e4m3 grid."""
    bits = v.to(tl.int32, bitcast=True)
    ex = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # the binade (the subnormals share 2^-6's step)
    step = ((ex - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(ex − 3): 3 mantissa bits
    r = ((v / step + 12582912.0) - 12582912.0) * step  # 1.5·2^23: round to an integer multiple, ties to even
    r = tl.where(r == 0, v * 0.0, r)  # the sign of a value rounded to zero
    return tl.where(v != v, v, r)


@triton.jit
def _round_bf16(v):
    """fp32 v rounded to the nearest bf16 value (ties to even), kept in fp32: the interpreter's float → bf16
    cast truncates."""
    bits = v.to(tl.int32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, r)


@triton.jit
def _to_e4m3(v, EMULATE: tl.constexpr):
    """fp32 v → e4m3 (values beyond ±448 saturate; NaN stays NaN: compiled, min / max return the other operand
    of a NaN, so the clamp propagates NaN explicitly)."""
    v = tl.clamp(v, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if EMULATE:
        q = _round_e4m3(v).to(tl.float8e4nv)
        bits = tl.where(v != v, 0x7F, q.to(tl.uint8, bitcast=True))  # the cast does not keep NaN
        return bits.to(tl.float8e4nv, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def _max_nan(a, b):
    """max that keeps NaN (torch.amax's; compiled tl.max drops it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quant_groups(v, R: tl.constexpr, W: tl.constexpr, G: tl.constexpr, EMULATE: tl.constexpr):
    """v [R, W] fp32 → (q [R, W] e4m3, s [R, W // G] fp32), per row and G columns: s = amax / 448 (1 for a
    zero group), q = v · (1 / s) rounded to e4m3 (quant.quantize_rows). The two quotients are per group and
    correctly rounded (div_rn: Triton's `/` on fp32 is the approximate division); a correctly rounded
    division per value would cost more than the product."""
    v3 = tl.reshape(v, [R, W // G, G])
    amax = tl.reduce(tl.abs(v3), 2, _max_nan)  # [R, W // G]: NaN in a group makes its scale NaN
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = _to_e4m3(v3 * tl.math.div_rn(1.0, s)[:, :, None], EMULATE)
    return tl.reshape(q, [R, W]), s


@triton.jit
def _widen_e4m3(b):
    """e4m3 b → fp32 with its NaN bytes (0x7F, 0xFF) as NaN: the interpreter's cast widens them to ±480."""
    v = b.to(tl.float32)
    nan = (v.to(tl.int32, bitcast=True) | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where((b.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, nan, v)


@triton.jit
def _ue8m0(raw):
    """ue8m0 scale bytes (read as uint8) → fp32, as torch's float8_e8m0fnu widens them: b → 2^(b − 127), exact;
    b = 0 → 2^-127 (an fp32 subnormal), b = 255 → NaN."""
    b = raw.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(ptr, mask, UE8M0: tl.constexpr):
    """Block scales at `ptr` as fp32: fp32 values, or ue8m0 bytes (`_ue8m0`); masked lanes 1 (ue8m0) or 0."""
    if UE8M0:
        s = _ue8m0(tl.load(ptr, mask=mask, other=127))
    else:
        s = tl.load(ptr, mask=mask, other=0.0)
    return s
