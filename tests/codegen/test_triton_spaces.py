"""The Triton backend's heuristic default of every kind is a point of its own search space, so every
tuning study tries it first (moetune.search.study.default_schedules skips a default outside the space)."""

from __future__ import annotations

import pytest

pytest.importorskip("moetune.codegen.triton")
from moetune.codegen.triton import BACKEND, hybrid  # noqa: E402
from moetune.ir import MoEBlock  # noqa: E402
from moetune.ir.presets import PRESETS, preset  # noqa: E402
from moetune.passes.pipeline import schedule_block  # noqa: E402
from moetune.search.space import build_space  # noqa: E402
from moetune.search.study import default_schedules  # noqa: E402

KINDS = ("stream_gemv", "grouped_gemm", "hybrid")
TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 4096)
BLOCKS = [preset(name) for name in PRESETS] + [
    MoEBlock(E=E, k=k, D=512, F=256) for E, k in ((8, 1), (8, 2), (16, 4), (64, 6), (256, 9), (512, 16))]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"E{b.E}k{b.k}D{b.D}F{b.F}")
def test_every_default_is_a_point_of_its_space(block):
    for kind in KINDS:
        for T in TOKENS:
            s = BACKEND.default(block, kind, T)
            for name, values in BACKEND.space(block, kind).choices:
                v = getattr(s.params, name)
                assert v in values, f"{kind} default at T={T}: {name} = {v!r} outside {values}"
            if kind == "hybrid":
                assert s.row_threshold in hybrid.ROW_THRESHOLDS


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3.5-397b-a17b"])
def test_each_bucket_study_starts_from_every_kinds_default(name):
    """In every bucket the passes make, the first schedules a study enqueues include the backend's
    default of each kind the bucket offers (mixtral-8x7b T=8…36: the 16-row stream_gemv default was
    outside the space, so the tuner never timed the bench's fastest variant there)."""
    block = preset(name)
    for b in schedule_block(block, "h200", tokens=(1, 1024)).buckets:
        space = build_space(block, BACKEND, b)
        T = (b.lo + b.hi) // 2
        first = default_schedules(block, BACKEND, space, T)
        assert sorted(s.kind for s in first) == sorted(ks.kind for ks in space.kinds), b.label
