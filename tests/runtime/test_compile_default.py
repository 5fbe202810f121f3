"""The default heuristic: rows per active expert → schedule kind, guarded by the backend's cost."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetune.codegen.backend import get
from moetune.codegen.torch.backend import TorchBackend
from moetune.ir import MoEBlock, Schedule, UnsupportedSchedule
from moetune.runtime.default import (
    default_kind,
    default_schedule,
    representative_tokens,
    rows_per_active,
    uniform_distinct,
)

TORCH = get("torch")


def block(E=128, k=8, D=1024, F=512, dtype="bfloat16", T_max=4096) -> MoEBlock:
    return MoEBlock(E=E, k=k, D=D, F=F, weight_dtype=dtype, routing_weight_dtype=dtype, T_max=T_max, name="b")


class StreamingBackend(TorchBackend):
    """The torch kernels with a device-style cost: the GEMV streams each selected expert once, no copy."""

    name = "streaming-test"

    def cost(self, blk, schedule, tokens):
        flops, moved = super().cost(blk, schedule, tokens)
        if schedule.kind == "stream_gemv":
            moved = uniform_distinct(blk.E, blk.k, tokens) * blk.weight_bytes_per_expert
        if schedule.kind == "hybrid":
            moved = uniform_distinct(blk.E, blk.k, tokens) * blk.weight_bytes_per_expert * 1.1
        return flops, moved


class RefusingBackend(TorchBackend):
    name = "refusing-test"

    def kinds(self, blk):
        return {k: f"{k} not built for this test" for k in ("grouped_gemm", "stream_gemv", "hybrid")}


def test_uniform_distinct_matches_simulation():
    E, k, T = 16, 4, 9
    g = torch.Generator().manual_seed(0)
    sims = [len({int(e) for _ in range(T) for e in torch.randperm(E, generator=g)[:k]}) for _ in range(400)]
    assert uniform_distinct(E, k, T) == pytest.approx(sum(sims) / len(sims), rel=0.03)
    assert uniform_distinct(E, k, 0) == 0


@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (128, 8), (512, 10)])
def test_rows_per_active_grows_from_one_to_Tk_over_E(E, k):
    b = block(E=E, k=k)
    assert rows_per_active(b, 1) == pytest.approx(1.0)
    rows = [rows_per_active(b, T) for T in (1, 2, 4, 16, 64, 256, 4096)]
    assert rows == sorted(rows)
    assert rows[-1] == pytest.approx(4096 * k / E, rel=1e-3)
    with pytest.raises(ValueError):
        rows_per_active(b, 0)


@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (128, 8), (512, 10)])
def test_regime_kinds_progress_with_T(E, k):
    """One row per active expert streams weights (stream_gemv), two or more rows share each weight
    read (grouped_gemm); one switch in between and never back; no hybrid under uniform routing."""
    b = block(E=E, k=k)
    kinds = []
    for T in range(1, 4097):
        kind, R = default_kind(b, T)
        rows = rows_per_active(b, T)
        assert R is None and kind in ("stream_gemv", "grouped_gemm"), (T, kind, R)
        if rows <= 1.05:
            assert kind == "stream_gemv", (T, rows)
        if rows >= 2:
            assert kind == "grouped_gemm", (T, rows)
        kinds.append(kind)
    switch = kinds.index("grouped_gemm")
    assert set(kinds[:switch]) == {"stream_gemv"} and set(kinds[switch:]) == {"grouped_gemm"}


def test_device_style_backend_follows_the_regime():
    """A backend whose cost favours the GEMV runs what default_kind names, on both sides of its switch."""
    be = StreamingBackend()
    b = block()
    assert default_schedule(b, be, 1).kind == "stream_gemv"
    last_gemv = max(T for T in range(1, 4096) if default_kind(b, T)[0] == "stream_gemv")
    assert default_schedule(b, be, last_gemv).kind == "stream_gemv"
    assert default_schedule(b, be, last_gemv + 1).kind == "grouped_gemm"
    assert default_schedule(b, be, 4096).kind == "grouped_gemm"


class NoGemvBackend(StreamingBackend):
    name = "no-gemv-test"

    def kinds(self, blk):
        return {**super().kinds(blk), "stream_gemv": "no GEMV kernel in this test"}


def test_refused_gemv_falls_back_to_hybrid_with_a_threshold():
    sch = default_schedule(block(), NoGemvBackend(), 1)
    assert sch.kind == "hybrid" and sch.row_threshold >= 2


@pytest.mark.parametrize("T", [1, 3, 16, 4096])
def test_torch_backend_stays_on_gemm_since_its_gather_copies_weights(T):
    """The torch GEMV gathers T·k copies: its cost is 3× the loop's at one row per expert."""
    sch = default_schedule(block(), TORCH, T)
    assert sch.kind == "grouped_gemm" and sch.backend == "torch"
    assert sch.params.impl == "grouped_mm"
    assert TORCH.build(block(), sch) is not None


def test_torch_default_on_misaligned_block_uses_the_loop():
    sch = default_schedule(block(D=200, F=37, dtype="float16"), TORCH, 64)
    assert sch.kind == "grouped_gemm" and sch.params.impl == "sorted_gemm"


def test_refused_kinds_fall_back_and_all_refused_is_an_error():
    huge = block(D=8192, F=16384)  # 768 MiB per expert: no gathered copy fits
    assert TORCH.kinds(huge)["stream_gemv"]
    assert default_schedule(huge, StreamingBackend(), 1).kind == "grouped_gemm"
    with pytest.raises(UnsupportedSchedule, match="refuses every kind.*not built for this test"):
        default_schedule(block(), RefusingBackend(), 1)


def test_default_schedules_verify_and_build_in_every_bucket():
    from moetune.runtime.dispatch import default_buckets

    be = StreamingBackend()
    for b in (block(E=16, k=4, D=64, F=40, dtype="float32"), block(E=512, k=10, D=64, F=40)):
        for lo, hi in default_buckets(b):
            T = representative_tokens(lo, hi)
            assert lo <= T <= hi
            sch = default_schedule(b, be, T)
            assert isinstance(sch, Schedule) and dataclasses.is_dataclass(sch.params)
            if sch.kind == "hybrid":
                assert sch.row_threshold <= hi
            be.build(b, sch)
