"""The block-quantisation rule (moetune.codegen.quant): what FP8 checkpoints, the references and the kernels
agree on."""

from __future__ import annotations

import math

import pytest
import torch

from moetune.codegen import quant

BLOCK = (32, 16)


def test_a_block_scale_is_its_amax_over_448_and_the_round_trip_is_e4m3_close():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 70, 50, generator=gen)  # partial last blocks on both axes
    q, s = quant.quantize_blocks(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (3, math.ceil(70 / 32), math.ceil(50 / 16)) == (3, *quant.scale_shape(70, 50, BLOCK))
    amax = w[1, 32:64, 16:32].abs().max()
    assert s[1, 1, 1].item() == pytest.approx(amax.item() / 448, rel=1e-6)
    back = quant.dequantize_blocks(q, s, BLOCK)
    assert back.shape == w.shape
    # e4m3 keeps 3 mantissa bits: each value within half an ulp of its own magnitude (plus the subnormal step)
    rel = (back - w).abs() / (w.abs() + quant.expand_scales(s, (70, 50), BLOCK) * 2 ** -9)
    assert rel.max().item() <= 2 ** -4 + 1e-6
    assert (back.abs() <= quant.expand_scales(s, (70, 50), BLOCK) * 448 * (1 + 1e-6)).all()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_the_rule_is_correctly_rounded_on_every_device(device):
    """Scales are amax / 448 correctly rounded (float64's quotient rounded once to float32), and the e4m3
    bytes and scales of 16-bit activations are the CPU's on every device: ties of 16-bit inputs are common,
    so a scale one ulp off rounds some of them the other way."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 1024, generator=gen) * torch.logspace(-3, 3, 1024)).to(torch.bfloat16)
    amax = quant.block_amax(x, (1, 128))
    s = quant.scales_from_amax(amax.to(device)).cpu()
    assert torch.equal(s, (amax.double() / 448).float())
    q, qs = quant.quantize_rows(x.to(device), 128)
    q0, qs0 = quant.quantize_rows(x, 128)
    assert torch.equal(qs.cpu(), qs0) and torch.equal(q.cpu().view(torch.uint8), q0.view(torch.uint8))


def test_a_zero_block_gets_scale_one():
    w = torch.zeros(32, 16)
    w[0, 0] = 0.0
    q, s = quant.quantize_blocks(w, BLOCK)
    assert s.item() == 1.0 and (q.float() == 0).all()


@pytest.mark.skipif(quant.UE8M0 is None, reason="this torch has no float8_e8m0fnu")
def test_ue8m0_scales_are_powers_of_two_that_never_overflow_e4m3():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 64, generator=gen) * 3
    q, s = quant.quantize_blocks(w, BLOCK, "ue8m0")
    assert s.dtype == quant.UE8M0
    f = s.float()
    assert torch.equal(f, torch.exp2(torch.log2(f).round()))
    assert (f >= quant.block_amax(w, BLOCK) / 448).all()  # rounded up: |w| / scale ≤ 448
    assert torch.isfinite(q.float()).all()
    back = quant.dequantize_blocks(q, s, BLOCK)
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + f.repeat_interleave(32, 0).repeat_interleave(16, 1) * 2 ** -9).all()


def test_gate_up_halves_are_quantised_apart_and_equal_one_matrix_in_whole_blocks():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(4, 2 * 64, 48, generator=gen)  # F = 64, a multiple of the block rows
    q, s = quant.quantize_gate_up(w, BLOCK)
    q1, s1 = quant.quantize_blocks(w, BLOCK)
    assert torch.equal(q.float(), q1.float()) and torch.equal(s, s1)
    assert tuple(s.shape[1:]) == quant.gate_up_scale_shape(64, 48, BLOCK)
    w = torch.randn(2, 2 * 40, 48, generator=gen)  # F = 40: each half has a partial last block of its own
    q, s = quant.quantize_gate_up(w, BLOCK)
    assert tuple(s.shape[1:]) == quant.gate_up_scale_shape(40, 48, BLOCK) == (4, 3)
    back = quant.dequantize_gate_up(q, s, BLOCK)
    assert (back - w).abs().max() <= w.abs().max() * 2 ** -4


def test_e4m3_edge_values_dequantise_exactly_and_nan_propagates():
    vals = torch.tensor([448.0, -448.0, 2 ** -9, -(2 ** -9), 2 ** -6, 0.0, float("nan")])
    q = vals.to(torch.float8_e4m3fn).reshape(1, -1)
    s = torch.tensor([[0.5]])
    back = quant.dequantize_blocks(q, s, (1, 8))
    assert torch.equal(back[0, :6], vals[:6] * 0.5)  # ±448, subnormals and zero are exact in e4m3
    assert math.isnan(back[0, 6].item())
    big = torch.tensor([[1e6, -1e6, 1.0, 0.0]])
    qb, sb = quant.quantize_blocks(big, (1, 4))
    assert qb.float().abs().max().item() == 448.0  # the block's amax maps to 448


def test_activation_rows_are_quantised_per_group():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=gen)
    x[2, 128:] *= 100  # one group far larger than its neighbour: its own scale
    q, s = quant.quantize_rows(x, 128)
    assert tuple(s.shape) == (5, 2)
    assert s[2, 1].item() == pytest.approx(x[2, 128:].abs().max().item() / 448, rel=1e-6)
    assert s[2, 0].item() == pytest.approx(x[2, :128].abs().max().item() / 448, rel=1e-6)
    fq = quant.fake_quantize_rows(x, 128)
    assert ((fq - x).abs() <= x.abs() * 2 ** -4 + s.repeat_interleave(128, 1) * 2 ** -9).all()
