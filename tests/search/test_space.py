"""The search space: the passes' candidates × the backend's ParamSpace, and the Optuna round trip."""

from __future__ import annotations

import optuna
import pytest
import toy_backend as tb

from moetune.codegen.backend import get
from moetune.ir import Bucket, CandidateSpace, MoEBlock, Refusal, Schedule, UnsupportedSchedule
from moetune.search.space import build_space, key


def kinds_of(space) -> dict:
    return {ks.kind: ks.row_thresholds for ks in space.kinds}


CROSS_CASES = [
    # (bucket, backend refusals, expected kinds → thresholds, expected refused kinds)
    (tb.bucket(1, 8), {}, {"grouped_gemm": (), "stream_gemv": (), "hybrid": (2, 4)}, set()),  # R=16 dropped
    (tb.bucket(1, 32), {}, {"grouped_gemm": (), "stream_gemv": (), "hybrid": (2, 4, 16)}, set()),
    (tb.bucket(1, 1), {}, {"grouped_gemm": (), "stream_gemv": ()}, {"hybrid"}),  # no R ≤ 1
    (tb.bucket(1, 8), {"stream_gemv": "no gemv kernel"}, {"grouped_gemm": (), "hybrid": (2, 4)},
     {"stream_gemv"}),
]


@pytest.mark.parametrize("bucket,refuse,kinds,refused", CROSS_CASES)
def test_space_crosses_candidates_with_backend_kinds(bucket, refuse, kinds, refused):
    be = tb.toy(f"toy-space-{len(refuse)}", refuse_kinds=refuse)
    space = build_space(tb.BLOCK, be, bucket)
    assert kinds_of(space) == kinds
    assert {k for k, _ in space.refusals} == refused
    for _, why in space.refusals:
        assert why  # every refusal carries its reason
    assert space.size() == sum(max(1, len(r)) * 9 for r in kinds.values())


def test_refusals_of_the_passes_are_kept():
    b = Bucket(1, 4, candidates=(CandidateSpace("stream_gemv"),),
               refusals=(Refusal("grouped_gemm", "grouped_gemm", "one-row regime"),))
    space = build_space(tb.BLOCK, tb.toy("toy-space-r"), b)
    assert ("grouped_gemm", "grouped_gemm: one-row regime") in space.refusals


def test_nothing_left_is_refused_with_every_reason():
    be = tb.toy("toy-space-none", refuse_kinds={"stream_gemv": "no gemv kernel"})
    b = Bucket(3, 7, candidates=(CandidateSpace("stream_gemv"),),
               refusals=(Refusal("grouped_gemm", "grouped_gemm", "one-row regime"),))
    with pytest.raises(UnsupportedSchedule, match=r"\[3,7\].*one-row regime.*no gemv kernel"):
        build_space(tb.BLOCK, be, b)


def test_grid_round_trips_through_optuna_params():
    space = build_space(tb.BLOCK, tb.toy("toy-space-grid"), tb.bucket(1, 8))
    points = list(space.grid())
    ok = [p for p in points if isinstance(p, Schedule)]
    refused = [p for p in points if isinstance(p, UnsupportedSchedule)]
    assert len(points) == space.size() == 36 and len(refused) == 4  # ToyParams(64, 3) per kind and R
    assert len({key(s) for s in ok}) == len(ok)
    for s in ok:
        params = space.params_of(s)
        assert space.schedule_of(params) == s
        trial = optuna.trial.FixedTrial(params)
        assert space.suggest(trial) == s
    outside = Schedule("hybrid", row_threshold=16, backend=ok[0].backend, params=tb.ToyParams())
    assert not space.contains(outside)


def test_every_bucket_of_the_passes_has_a_torch_space():
    from moetune.passes.pipeline import schedule_block

    block = MoEBlock(E=16, k=4, D=64, F=40, weight_dtype="float32", routing_weight_dtype="float32")
    sb = schedule_block(block, "cpu", tokens=(1, 1024))
    torch_be = get("torch")
    for b in sb.buckets:
        space = build_space(block, torch_be, b)
        assert space.size() >= 1
        assert {ks.kind for ks in space.kinds} <= {c.kind for c in b.candidates}
        for s in space.grid():
            assert isinstance(s, Schedule) and s.backend == "torch"
            torch_be.build(block, s)  # every point builds


def test_neighbours_differ_in_one_knob_nearest_values_first_a_refused_move_with_another_knob_lowered():
    space = build_space(tb.BLOCK, tb.toy("toy-space-nb"), tb.bucket(1, 8))
    s = Schedule("hybrid", row_threshold=2, backend="toy-space-nb", params=tb.ToyParams(tile=64, stages=2))
    got = [(n.row_threshold, n.params.tile, n.params.stages) for n in space.neighbours(s)]
    # R 4; tile 32 (next to 64); stages 1; stages 3, refused by ToyParams at tile 64, taken with tile 32 (a knob
    # one value away, lower first); tile 16
    assert sorted(got[:3]) == [(2, 32, 2), (2, 64, 1), (4, 64, 2)]
    assert got[3:] == [(2, 32, 3), (2, 16, 2)]
    assert all(n.kind == s.kind and space.contains(n) for n in space.neighbours(s))
    outside = Schedule("hybrid", row_threshold=16, backend="toy-space-nb", params=tb.ToyParams())
    assert space.neighbours(outside) == []


def test_neighbours_on_the_triton_space_reach_split_k_from_the_tma_default():
    """The case the local search exists for (mixtral-8x7b T = 634…1024): the TMA default's split-K and
    two-dot twins are one knob away."""
    import dataclasses

    from moetune.codegen.triton import BACKEND
    from moetune.ir.presets import preset
    from moetune.passes.pipeline import schedule_block

    block = preset("mixtral-8x7b")
    bucket = next(b for b in schedule_block(block, "h200", tokens=(1, 1024)).buckets if b.lo <= 806 <= b.hi)
    space = build_space(block, BACKEND, bucket)
    d = BACKEND.default(block, "grouped_gemm", 806)
    nb = space.neighbours(d)
    assert d.params.tma and d.params.one_dot and d.params.split_k == 2
    for knob in (dict(split_k=1), dict(split_k=4), dict(one_dot=False)):
        assert dataclasses.replace(d, params=dataclasses.replace(d.params, **knob)) in nb
    for n in nb:  # one knob, or a refused one taken with another knob one value lower
        moved = [f.name for f in dataclasses.fields(d.params) if getattr(n.params, f.name) != getattr(d.params, f.name)]
        assert len(moved) in (1, 2), moved
        if len(moved) == 2:  # the move alone is refused
            assert not all(_admitted(BACKEND, block, d, **{m: getattr(n.params, m)}) for m in moved), moved


def _admitted(backend, block, s, **knobs) -> bool:
    import dataclasses

    try:
        backend.space(block, s.kind).admit(dataclasses.replace(s.params, **knobs))
    except UnsupportedSchedule:
        return False
    return True


def test_a_wider_fp8_k_step_is_a_neighbour_with_a_stage_less():
    """From the shipped FP8 winner at qwen3.5-397b-a17b T = 4 (16-row tiles, 128-column K steps, 4 stages), the
    gate/up's 256-column K step does not fit the shared memory at 4 stages: the local search takes it with 3;
    64-column w8a8 tiles need h quantised in its own pass: it takes them with h_pass."""
    import dataclasses

    from moetune.codegen.triton import BACKEND
    from moetune.ir import WeightFormat
    from moetune.ir.presets import preset
    from moetune.passes.pipeline import schedule_block

    block = preset("qwen3.5-397b-a17b").with_weight_format(WeightFormat.fp8_block())
    bucket = next(b for b in schedule_block(block, "h200", tokens=(1, 1024)).buckets if b.lo <= 4 <= b.hi)
    space = build_space(block, BACKEND, bucket)
    p = BACKEND.space(block, "grouped_gemm").make(block_m=16, block_n=128, block_k=128, group_m=1, num_stages=4,
                                                   down_block_n=128, down_block_k=128, down_stages=4,
                                                   act_quant="fp8_1x128", tma=True, pdl=True)
    s = Schedule("grouped_gemm", backend="triton", params=p)
    nb = space.neighbours(s)
    wide = dataclasses.replace(p, block_k=256, num_stages=3)
    assert dataclasses.replace(s, params=wide) in nb
    assert dataclasses.replace(s, params=dataclasses.replace(p, block_k=256)) not in nb
    assert dataclasses.replace(s, params=dataclasses.replace(p, down_block_k=256)) in nb  # it fits at 4
    # 64-column gate/up tiles, refused with h quantised in the epilogue, taken with h's own pass
    assert dataclasses.replace(s, params=dataclasses.replace(p, block_n=64, h_pass=True)) in nb
