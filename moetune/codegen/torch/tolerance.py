"""One place for how close a kernel's result must be to the float32 reference, per dtype."""

from __future__ import annotations

import torch

from ..quant import activation_group

_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}
_A8 = (6e-2, 6e-2)  # w8a8 against the reference on the same rounded activations (tolerances' doc)


def tolerances(dtype: torch.dtype, *, tf32: bool = False, a8: bool = False) -> tuple[float, float]:
    """(rtol, atol) for comparing a `dtype` kernel output against the float32 reference.

    float32: accumulation order only; with `tf32` (a GPU kernel whose float32 matrix products round
    their inputs to TF32's 10 mantissa bits, as Triton's tl.dot does) the float16 bounds.
    bfloat16 / float16: the inputs, the gate/up rows, the hidden rows and the output are rounded to the
    dtype (8 / 11 mantissa bits) around float32-accumulated GEMMs. `atol` is in units of the output's
    scale, max(1, max|ref|): a rounding error of the hidden row reaches every output element of its
    token, small ones included.
    `a8`: a schedule that quantises its activations to float8_e4m3fn per 1×G group (w8a8, `act_quant`),
    compared with `experts_reference(..., act_group=G)`, whose products see the same rounded x and h. What
    is left beyond the dtype's rounding: an element of h on an e4m3 rounding boundary may round to the other
    neighbour where the kernel computed it in another order or stored it in 16 bits first (one e4m3 step,
    up to 2⁻³ of that element), a few elements of a row. Between implementations of different activation
    rules (transformers' FP8 experts, w8a8 per 1×128, against a w8a16 result) the bound is the same figure
    taken as the whole rounding's at the models' sizes: each compared with its own rule's reference is the
    sharper check. Weight-only FP8 schedules keep the dtype's bound: their reference is the float32
    computation on the dequantised weights, exact up to the dtype.
    """
    if a8:
        return _A8
    if dtype not in _TOL:
        raise KeyError(f"no tolerance for {dtype}; known: {', '.join(str(d) for d in _TOL)}")
    return _TOL[torch.float16 if tf32 and dtype == torch.float32 else dtype]


def accuracy(params) -> str:
    """What a schedule's result is checked to, in words (`moetune explain --passes` prints it under each
    schedule of an FP8 block)."""
    group = activation_group(params)
    if group is not None:
        rtol, atol = _A8
        return (f"activations quantised to float8_e4m3fn per 1x{group} group "
                f"(w8a8): checked to rtol {rtol:g}, atol {atol:g} of the output's scale against float32 on the "
                "same rounded activations")
    return "activations in the model's dtype: checked to the dtype's bound against float32"


def worst_error(out: torch.Tensor, ref: torch.Tensor, *, tf32: bool = False, a8: bool = False) -> float:
    """max |out − ref| / (atol·scale + rtol·|ref|) with `tolerances(out.dtype, tf32=, a8=)`: ≤ 1 means within.

    NaN or inf in `out` where `ref` is finite counts as infinitely wrong."""
    if out.shape != ref.shape:
        raise ValueError(f"shape {tuple(out.shape)} against the reference's {tuple(ref.shape)}")
    if out.numel() == 0:
        return 0.0
    rtol, atol = tolerances(out.dtype, tf32=tf32, a8=a8)
    ref = ref.float()
    scale = max(1.0, ref.abs().max().item())
    err = (out.float() - ref).abs() / (atol * scale + rtol * ref.abs())
    return float("inf") if not torch.isfinite(err).all() else err.max().item()
