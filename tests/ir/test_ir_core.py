"""The IR's own invariants: MoEBlock, Schedule, ScheduledBlock, symbolic rows."""

import dataclasses

import pytest
import torch

from moetune.codegen import ExpertTensors
from moetune.codegen.torch import experts_reference
from moetune.ir import (
    Activation,
    Bucket,
    ExpertRows,
    IRError,
    MoEBlock,
    Router,
    Schedule,
    ScheduledBlock,
    SymInt,
    WeightLayout,
    verify_scheduled,
)


def _block(**kw):
    base = dict(E=8, k=2, D=64, F=40, weight_dtype="float32", routing_weight_dtype="float32")
    base.update(kw)
    return MoEBlock(**base)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(k=9), "k"),
        (dict(E=0), "E"),
        (dict(F=-1), "F"),
        (dict(weight_dtype="float64"), "weight_dtype"),
        (dict(router=Router("sigmoid_grouped_topk", n_group=3, topk_group=1, score_bias=True)), "router.n_group"),
        (dict(E=16, k=8, router=Router("sigmoid_grouped_topk", n_group=4, topk_group=1)), "router.topk_group"),
        (dict(weight_application="both"), "weight_application"),
    ],
)
def test_block_verify_names_the_field(changes, field):
    with pytest.raises(IRError) as ei:
        _block(**changes)
    assert ei.value.field == field


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Activation("gelu"), "kind"),
        (lambda: Activation("clamped_swiglu", alpha=1.7), "alpha/limit"),
        (lambda: Activation("swiglu", limit=7.0), "alpha/limit"),
        (lambda: Router("softmax_topk", score_bias=True), "score_bias/n_group"),
        (lambda: Router("topk_softmax", scaling=0.0), "scaling"),
        (lambda: SymInt("T", 5, 2), "lo..hi"),
    ],
)
def test_node_checks(make, field):
    with pytest.raises(IRError) as ei:
        make()
    assert ei.value.field == field


def test_signature_tracks_numerics_not_names():
    a, b = _block(name="layer0"), _block(name="layer7")
    assert a.signature() == b.signature() and a.signature_hash() == b.signature_hash()
    for change in (dict(F=48), dict(weight_dtype="bfloat16"), dict(layout=WeightLayout(transposed=True)),
                   dict(activation=Activation("clamped_swiglu", alpha=1.702, limit=7.0)),
                   dict(weight_application="input"), dict(routing_weight_dtype="bfloat16")):
        assert _block(**change).signature_hash() != a.signature_hash(), change
    assert dataclasses.replace(a, F=40) == a


def test_expert_rows_constraints():
    rows = _block().rows
    assert isinstance(rows, ExpertRows)
    rows.check([2, 0, 0, 0, 0, 0, 0, 2], tokens=2)
    with pytest.raises(IRError, match="Σ m_e"):
        rows.check([1, 0, 0, 0, 0, 0, 0, 2], tokens=2)
    with pytest.raises(IRError, match="m_e"):
        rows.check([4, 0, 0, 0, 0, 0, 0, 0], tokens=2)


@dataclasses.dataclass(frozen=True)
class _Params:
    block_n: int = 64


@dataclasses.dataclass
class _Mutable:
    block_n: int = 64


def test_schedule_checks():
    Schedule("hybrid", row_threshold=4)
    Schedule("stream_gemv", backend="triton", params=_Params())
    for kw, field in [
        (dict(kind="hybrid"), "row_threshold"),
        (dict(kind="stream_gemv", row_threshold=4), "row_threshold"),
        (dict(kind="dense"), "kind"),
        (dict(kind="stream_gemv", backend="triton", params=_Mutable()), "params"),
        (dict(kind="stream_gemv", backend="triton", params={"block_n": 64}), "params"),
        (dict(kind="stream_gemv", params=_Params()), "backend"),
    ]:
        with pytest.raises(IRError) as ei:
            Schedule(**kw)
        assert ei.value.field == field


def test_scheduled_block_cover():
    b = _block(T_max=64)
    gemv = Schedule("stream_gemv")
    ok = ScheduledBlock(b, (Bucket(1, 4, schedule=gemv), Bucket(5, 64, schedule=Schedule("grouped_gemm"))))
    assert verify_scheduled(ok, final=True) is ok
    assert ok.bucket_for(5).lo == 5
    cases = [
        ((Bucket(1, 4), Bucket(6, 64)), False, "gap"),
        ((Bucket(1, 4), Bucket(4, 64)), False, "overlap"),
        ((Bucket(1, 4), Bucket(5, 32)), False, "T_max"),
        ((Bucket(1, 4, schedule=gemv), Bucket(5, 64)), True, "no schedule"),
        ((Bucket(1, 4, schedule=Schedule("hybrid", row_threshold=8)), Bucket(5, 64)), False, "reach"),
    ]
    for buckets, final, msg in cases:
        with pytest.raises(IRError, match=msg):
            verify_scheduled(ScheduledBlock(b, buckets), final=final)


@pytest.mark.parametrize("layout", [WeightLayout(), WeightLayout(transposed=True, interleaved=True, has_bias=True)])
@pytest.mark.parametrize("application", ["output", "input"])
def test_reference_matches_a_plain_loop(layout, application):
    """The reference against the definition written as a loop over (token, slot)."""
    g = torch.Generator().manual_seed(0)
    act = Activation("clamped_swiglu", alpha=1.702, limit=7.0) if layout.has_bias else Activation()
    b = _block(layout=layout, activation=act, weight_application=application)
    E, D, F, T, k = b.E, b.D, b.F, 5, b.k
    w = ExpertTensors(
        torch.randn(*layout.gate_up_shape(E, D, F), generator=g) / D**0.5,
        torch.randn(*layout.down_shape(E, D, F), generator=g) / F**0.5,
        torch.randn(E, 2 * F, generator=g) if layout.has_bias else None,
        torch.randn(E, D, generator=g) if layout.has_bias else None,
    )
    w.check(b)
    x = torch.randn(T, D, generator=g)
    ids = torch.tensor([[0, 3], [3, 3 - 3], [7, 8], [1, 2], [5, 6]])  # 8 is an out-of-range sentinel
    wt = torch.rand(T, k, generator=g)
    out = experts_reference(b, x, ids, wt, w)
    ref = torch.zeros(T, D)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e >= E:
                continue
            xin = x[t] * wt[t, j] if application == "input" else x[t]
            W1 = w.gate_up[e].T if layout.transposed else w.gate_up[e]  # [2F, D]
            gu = W1 @ xin + (w.gate_up_bias[e] if layout.has_bias else 0)
            g_, u_ = (gu[0::2], gu[1::2]) if layout.interleaved else (gu[:F], gu[F:])
            if act.kind == "swiglu":
                h = torch.nn.functional.silu(g_) * u_
            else:
                g_, u_ = g_.clamp(max=7.0), u_.clamp(-7.0, 7.0)
                h = (u_ + 1) * g_ * torch.sigmoid(1.702 * g_)
            W2 = w.down[e].T if layout.transposed else w.down[e]  # [D, F]
            y = W2 @ h + (w.down_bias[e] if layout.has_bias else 0)
            ref[t] += y * wt[t, j] if application == "output" else y
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_expert_tensors_shape_check_names_tensor():
    b = _block()
    w = ExpertTensors(torch.zeros(8, 64, 80), torch.zeros(8, 64, 40))
    with pytest.raises(IRError, match="gate_up"):
        w.check(b)


def test_weight_format_seam():
    """The block names its weight format; unquantised formats keep the signature they always had and a
    quantised one is a different dispatch key with its scales counted in the bytes."""
    from moetune.ir import WeightFormat

    b = MoEBlock(E=8, k=2, D=256, F=128)
    assert b.weight_format == WeightFormat("bfloat16") and not b.weight_format.quantized
    assert "w=bfloat16 " in b.signature()
    assert b.replace(weight_dtype="float32").weight_format.dtype == "float32"
    fmt = WeightFormat("float8_e4m3fn", "fp8_block", (128, 128), "float32")
    q = MoEBlock(E=8, k=2, D=256, F=128, weight_dtype="float8_e4m3fn", weight_format=fmt)
    assert q.signature_hash() != b.signature_hash()
    assert fmt.compute_dtype == "bfloat16"
    scales = 4 * (2 * 1 * 2 + 2 * 1)  # gate_up [256, 256] → 2×2 blocks, down [256, 128] → 2×1, fp32 each
    assert q.weight_bytes_per_expert == 3 * 256 * 128 + scales
    with pytest.raises(IRError, match="weight_format stores float8_e4m3fn"):
        MoEBlock(E=8, k=2, D=256, F=128, weight_format=fmt)
    with pytest.raises(IRError, match="fp8_block weights are float8_e4m3fn"):
        WeightFormat("bfloat16", "fp8_block", (128, 128), "float32")
    with pytest.raises(IRError, match="need \\(rows, cols\\)"):
        WeightFormat("float8_e4m3fn", "fp8_block", (128,), "float32")
    with pytest.raises(IRError, match="supported: float32, ue8m0"):
        WeightFormat("float8_e4m3fn", "fp8_block", (128, 128), "float16")
