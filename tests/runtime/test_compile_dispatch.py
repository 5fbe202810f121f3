"""Dispatcher: buckets resolved once, bisect on T, table entries with defaults for the gaps."""

from __future__ import annotations

import warnings

import pytest
import torch

from moetune.codegen.backend import get
from moetune.codegen.torch import GatheredParams, GroupedGemmParams, HybridParams, experts_reference
from moetune.ir import IRError, MoEBlock, Schedule
from moetune.passes.pipeline import context
from moetune.runtime.default import default_buckets
from moetune.runtime.dispatch import Dispatcher, DispatchWarning

TORCH = get("torch")
GEMM = Schedule("grouped_gemm", backend="torch", params=GroupedGemmParams("sorted_gemm", "unsort_sum"))
GEMV = Schedule("stream_gemv", backend="torch", params=GatheredParams(8))
HYB = Schedule("hybrid", row_threshold=3, backend="torch", params=HybridParams("grouped_mm", 8))


def block(E=16, k=4, D=64, F=40, T_max=256) -> MoEBlock:
    return MoEBlock(
        E=E, k=k, D=D, F=F, weight_dtype="float32", routing_weight_dtype="float32", T_max=T_max, name="b"
    )


def covers(ranges, T_max):
    return (
        ranges[0][0] == 1
        and ranges[-1][1] == T_max
        and all(b[0] == a[1] + 1 for a, b in zip(ranges, ranges[1:], strict=False))
    )


def test_default_buckets_cover_and_never_span_two_regimes():
    b = block(E=128, k=8, T_max=4096)
    ranges = default_buckets(b, TORCH, "cpu")
    assert covers(ranges, 4096)
    ctx = context(b, "cpu")
    for lo, hi in ranges:
        assert ctx.regime(lo) == ctx.regime(hi), (lo, hi)


def test_route_by_bisect_and_edges():
    b = block()
    d = Dispatcher.default(b, TORCH, buckets=[(1, 1), (2, 7), (8, 256)])
    assert [r.label for r in d.routes] == ["[1,1]", "[2,7]", "[8,256]"]
    for T, i in [(1, 0), (2, 1), (7, 1), (8, 2), (256, 2), (10_000, 2)]:  # above T_max: the last bucket
        assert d.index(T) == i and d.route(T) is d.routes[i]
    w_e = _tensors(b)
    assert d(torch.zeros(0, b.D), torch.zeros(0, b.k, dtype=torch.long), torch.zeros(0, b.k), w_e).shape == (
        0,
        b.D,
    )


def _tensors(b, seed=0):
    from moetune.codegen.tensors import ExpertTensors

    g = torch.Generator().manual_seed(seed)
    return ExpertTensors(
        torch.randn(b.E, 2 * b.F, b.D, generator=g) / 8, torch.randn(b.E, b.D, b.F, generator=g) / 6
    )


@pytest.mark.parametrize("T", [1, 2, 5, 8, 31, 300])
def test_every_bucket_computes_the_reference(T):
    b = block()
    d = Dispatcher.from_entries(b, TORCH, [(1, 1, GEMV), (2, 7, HYB), (8, 256, GEMM)])
    w = _tensors(b)
    x = torch.randn(T, b.D)
    ids = torch.stack([torch.randperm(b.E)[: b.k] for _ in range(T)])
    wt = torch.rand(T, b.k)
    torch.testing.assert_close(d(x, ids, wt, w), experts_reference(b, x, ids, wt, w), rtol=1e-5, atol=1e-5)


def test_full_table_no_warning_and_sources():
    b = block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = Dispatcher.from_entries(b, TORCH, [(8, 256, GEMM), (1, 1, GEMV), (2, 7, HYB)])  # any order
    assert [r.source for r in d.routes] == ["table"] * 3
    assert [r.schedule for r in d.routes] == [GEMV, HYB, GEMM]


def test_missing_buckets_one_warning_naming_them():
    b = block()
    with pytest.warns(DispatchWarning) as rec:
        d = Dispatcher.from_entries(b, TORCH, [(2, 7, HYB), (20, 40, GEMM)])
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "[1,1]" in msg and "[8," in msg and ",256]" in msg and "[2,7]" not in msg
    assert d.routes[0].lo == 1 and d.routes[-1].hi == 256
    assert {r.source for r in d.routes if (r.lo, r.hi) not in ((2, 7), (20, 40))} == {"default (no entry)"}
    assert [r.label for r in d.routes if r.source == "table"] == ["[2,7]", "[20,40]"]


def test_empty_entries_all_default_with_one_warning():
    with pytest.warns(DispatchWarning) as rec:
        d = Dispatcher.from_entries(block(), TORCH, [])
    assert len(rec) == 1 and all(r.source.startswith("default") for r in d.routes)


def test_refused_entry_falls_back_and_is_named():
    b = block(D=37, F=19)  # grouped_mm needs 16-byte strides
    bad = Schedule("grouped_gemm", backend="torch", params=GroupedGemmParams("grouped_mm"))
    with pytest.warns(DispatchWarning, match=r"\[1,256\].*refused.*16 bytes"):
        d = Dispatcher.from_entries(b, TORCH, [(1, 256, bad)])
    assert d.routes[0].schedule.params.impl == "sorted_gemm"


def test_overlapping_entries_raise():
    with pytest.raises(IRError, match="overlapping"):
        Dispatcher.from_entries(block(), TORCH, [(1, 8, GEMV), (8, 256, GEMM)])


def test_custom_default_factory_fills_gaps():
    seen = []

    def factory(lo, hi):
        seen.append((lo, hi))
        return GEMM

    with pytest.warns(DispatchWarning):
        d = Dispatcher.from_entries(block(), TORCH, [(1, 1, GEMV)], default_factory=factory)
    assert seen and all(lo >= 2 for lo, _ in seen)
    assert all(r.schedule == GEMM for r in d.routes[1:])


def test_gaps_are_rejected_in_hand_built_routes():
    from moetune.runtime.dispatch import Route

    fn = TORCH.build(block(), GEMM)
    with pytest.raises(IRError, match="gap"):
        Dispatcher(block(), TORCH, [Route(1, 4, GEMM, "x", fn), Route(6, 256, GEMM, "x", fn)])


class _CannotBuild(type(TORCH)):
    name = "cannot-build-test"

    def build(self, blk, schedule):
        from moetune.ir import UnsupportedSchedule

        raise UnsupportedSchedule(f"{self.name} builds nothing")


def test_default_the_backend_cannot_build_runs_torch_with_one_warning():
    b = block()
    with pytest.warns(DispatchWarning, match=r"cannot-build-test cannot build its default.*\[1,1\]") as rec:
        d = Dispatcher.default(b, _CannotBuild())
    assert len(rec) == 1
    assert all(r.source == "default, torch fallback" and r.schedule.backend == "torch" for r in d.routes)
    w = _tensors(b)
    x, ids, wt = (
        torch.randn(3, b.D),
        torch.stack([torch.randperm(b.E)[: b.k] for _ in range(3)]),
        torch.rand(3, b.k),
    )
    torch.testing.assert_close(d(x, ids, wt, w), experts_reference(b, x, ids, wt, w), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------- a kernel that refuses the call's tensors


def strided_weights(b: MoEBlock, gen: torch.Generator):
    """Expert weights that are views with a padded expert stride (no [E·rows, cols] matrix): the
    pointer kernels read them, a TMA descriptor cannot."""
    from moetune.codegen.tensors import ExpertTensors

    gu = (torch.randn(b.E, 2 * b.F + 8, b.D, generator=gen) * b.D**-0.5)[:, : 2 * b.F]
    dn = (torch.randn(b.E, b.D + 8, b.F, generator=gen) * b.F**-0.5)[:, : b.D]
    assert gu.stride(0) != 2 * b.F * gu.stride(1) and dn.stride(0) != b.D * dn.stride(1)
    return ExpertTensors(gu, dn)


@pytest.mark.parametrize("T,source", [(5, "table"), (300, "default")])
def test_a_route_whose_kernel_refuses_the_call_falls_back_once(T, source):
    pytest.importorskip("triton")
    from moetune.codegen.triton import BACKEND as TRITON
    from moetune.codegen.triton import GemmParams

    b = block(E=4, k=2, D=64, F=48, T_max=512)
    gen = torch.Generator().manual_seed(T)
    w = strided_weights(b, gen)
    x = torch.randn(T, b.D, generator=gen)
    ids = torch.stack([torch.randperm(b.E, generator=gen)[: b.k] for _ in range(T)])
    wt = torch.softmax(torch.randn(T, b.k, generator=gen), -1)
    if source == "table":  # a tuned TMA entry
        tma = Schedule("grouped_gemm", backend="triton", params=GemmParams(
            block_m=16, block_n=32, block_k=32, down_block_n=32, down_block_k=32, tma=True))
        d = Dispatcher.from_entries(b, TRITON, [(1, 512, tma)])
    else:  # 150 rows per expert: the backend's own default is the TMA path
        d = Dispatcher.default(b, TRITON, buckets=[(1, 255), (256, 512)])
        assert d.route(T).schedule.params.tma
    with pytest.warns(DispatchWarning, match="refused a call") as rec:
        out = d(x, ids, wt, w)
    assert len(rec) == 1
    want = "torch" if source == "default" else "triton"
    assert d.route(T).schedule.backend == want and not getattr(d.route(T).schedule.params, "tma", False)
    ref = experts_reference(b, x, ids, wt, w)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d(x, ids, wt, w)  # the replacement serves from now on, silently
