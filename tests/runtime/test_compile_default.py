"""The runtime's defaults are the pass pipeline's schedules with the backend's refusals, costs and
parameters; `explain --passes` prints what a compiled model runs at every T."""

from __future__ import annotations

import dataclasses
import re

import pytest

from moetune.codegen.backend import get
from moetune.codegen.torch import TorchBackend
from moetune.ir import IRError, MoEBlock, Schedule
from moetune.ir.explain import format_ir
from moetune.ir.presets import PRESETS, preset
from moetune.passes.pipeline import run_pipeline
from moetune.passes.policy import representative_tokens
from moetune.passes.stats import uniform_distinct
from moetune.runtime.default import default_at, default_buckets, default_plan
from moetune.runtime.dispatch import Dispatcher

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


class NoGemvBackend(StreamingBackend):
    name = "no-gemv-test"

    def kinds(self, blk):
        return {**super().kinds(blk), "stream_gemv": "no GEMV kernel in this test"}


class RefusingBackend(TorchBackend):
    name = "refusing-test"

    def kinds(self, blk):
        return {k: f"{k} not built for this test" for k in ("grouped_gemm", "stream_gemv", "hybrid")}


def test_device_style_backend_streams_in_the_one_row_regime_and_tiles_beyond():
    be, b = StreamingBackend(), block()
    plan = default_plan(b, be, "h200")
    assert default_at(b, be, "h200", 1).kind == "stream_gemv"
    assert default_at(b, be, "h200", 4096).kind == "grouped_gemm"
    from moetune.passes.pipeline import context

    ctx = context(b, "h200")
    for bk in plan.buckets:  # the regime at the bucket's representative T decides
        want = "stream_gemv" if ctx.regime(representative_tokens(bk.lo, bk.hi)) == "one_row" else "grouped_gemm"
        assert bk.schedule.kind == want, bk.label


def test_refused_gemv_falls_back_to_hybrid_with_the_policys_threshold():
    sch = default_at(block(), NoGemvBackend(), "h200", 1)
    assert sch.kind in ("hybrid", "grouped_gemm")
    if sch.kind == "hybrid":
        assert sch.row_threshold >= 2


@pytest.mark.parametrize("T", [1, 3, 16, 4096])
def test_torch_backend_stays_on_gemm_since_its_gather_copies_weights(T):
    sch = default_at(block(), TORCH, "cpu", T)
    assert sch.kind == "grouped_gemm" and sch.backend == "torch"
    assert sch.params.impl == "grouped_mm"
    assert TORCH.build(block(), sch) is not None


def test_torch_default_on_misaligned_block_uses_the_loop():
    sch = default_at(block(D=200, F=37, dtype="float16"), TORCH, "cpu", 64)
    assert sch.kind == "grouped_gemm" and sch.params.impl == "sorted_gemm"


def test_all_refused_is_an_error_naming_the_reasons():
    with pytest.raises(Exception, match="refuses every kind.*not built for this test"):
        default_plan(block(), RefusingBackend(), "cpu")


def test_default_schedules_verify_and_build_in_every_bucket():
    be = StreamingBackend()
    for b in (block(E=16, k=4, D=64, F=40, dtype="float32"), block(E=512, k=10, D=64, F=40)):
        for lo, hi in default_buckets(b, be, "h200"):
            sch = default_at(b, be, "h200", representative_tokens(lo, hi))
            assert isinstance(sch, Schedule) and dataclasses.is_dataclass(sch.params)
            if sch.kind == "hybrid":
                assert sch.row_threshold <= hi
            be.build(b, sch)


def _explained(text: str) -> list[tuple[int, int, str]]:
    """(lo, hi, schedule text) of every bucket `format_ir` prints."""
    out, cur = [], None
    for line in text.splitlines():
        m = re.match(r"\s+\[(\d+),(\d+)\]", line)
        if m:
            cur = (int(m.group(1)), int(m.group(2)))
        m = re.match(r"\s+schedule: (.*)$", line)
        if m:
            out.append((*cur, m.group(1)))
    return out


@pytest.mark.parametrize("target,backend", [("h200", "triton"), ("cpu", "torch")])
@pytest.mark.parametrize("name", list(PRESETS))
def test_what_explain_prints_is_what_a_compiled_model_runs(name, target, backend):
    """For every preset and T = 1 … 4096: the schedule `explain --passes` prints for T's bucket is the
    schedule the compiled model's dispatcher runs at T (no table)."""
    be = get(backend)
    b = preset(name)
    if all(be.kinds(b).values()):
        pytest.skip(f"{backend} has no kernel for {b.weight_format} weights in this tree: {be.kinds(b)}")
    final = run_pipeline(b, target, backend=be)[-1][1]
    printed = _explained(format_ir(final))
    assert [(lo, hi) for lo, hi, _ in printed] == [(bk.lo, bk.hi) for bk in final.buckets]
    d = Dispatcher.default(b, be, target=target)
    runs = {r.label: r.schedule.describe() for r in d.routes}
    for T in range(1, 4097):
        lo, hi, text = next(p for p in printed if p[0] <= T <= p[1])
        assert d.route(T).label == f"[{lo},{hi}]", T
        assert runs[f"[{lo},{hi}]"] == text, (T, text)


def test_default_at_outside_the_range_uses_the_last_bucket():
    b = block(T_max=64)
    assert default_at(b, TORCH, "cpu", 10_000) == default_plan(b, TORCH, "cpu").buckets[-1].schedule
    with pytest.raises(IRError):
        representative_tokens(0, 3)
