"""The pipeline: order, verify after every pass, identity, the failing pass named, traces, presets."""

import pytest
from pass_shapes import GPU_SHAPES, gpu_block

from moetune.ir import MoEBlock, ScheduledBlock, verify, verify_scheduled
from moetune.ir.trace import synthetic_trace
from moetune.passes.pipeline import PASSES, PassError, context, describe, run_pipeline, schedule_block
from moetune.passes.policy import Policy


@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_pipeline_verifies_after_every_pass(name):
    block = gpu_block(name, T_max=1024)
    steps = run_pipeline(block, target="h200")
    assert [n for n, _ in steps] == ["capture", "bucketing", "specialise", "roofline",
                                     "default_schedule"]
    assert steps[0][1] is block
    verify(steps[0][1])
    for _, ir in steps[1:]:
        verify_scheduled(ir)
    final = steps[-1][1]
    verify_scheduled(final, final=True)
    assert all(b.floor is not None and b.candidates and b.stats for b in final.buckets)
    assert final == schedule_block(block)


def test_every_pass_is_identity_on_its_own_output():
    block = gpu_block("qwen3-30b-a3b", T_max=512)
    ctx = context(block)
    steps = run_pipeline(block)
    for (name, fn), (_, ir) in zip(PASSES[1:], steps[2:], strict=True):
        assert fn(ir, ctx) is ir, name


def test_failing_pass_is_named_with_the_passes_before_it():
    block = MoEBlock(8, 2, 64, 32, T_max=16)
    with pytest.raises(PassError) as e:
        run_pipeline(block, "cpu", policy=Policy(gemv_max_heavy_rows=-1.0, hybrid_thresholds=()))
    msg = str(e.value)
    assert "pass 'specialise' failed (after capture → bucketing)" in msg and "every rule refused" in msg
    assert e.value.pass_name == "specialise" and e.value.before == ["capture", "bucketing"]


def test_trace_file_and_token_range(tmp_path):
    block = gpu_block("qwen3-30b-a3b")
    path = synthetic_trace(128, 8, tokens=5000, zipf=1.0).save(tmp_path / "z.npz")
    sb = schedule_block(block, trace=str(path), tokens=(1, 256))
    assert sb.block.T_max == 256 and sb.buckets[-1].hi == 256
    assert sb.buckets[0].stats.source == f"trace:{path}"
    with pytest.raises(Exception, match="E=16, k=4"):
        schedule_block(block, trace=synthetic_trace(16, 4, tokens=100))
    with pytest.raises(Exception, match="lo ≤ hi"):
        schedule_block(block, tokens=(0, 64))


def test_describe_lists_buckets_candidates_and_refusals():
    steps = run_pipeline(gpu_block("mixtral-8x7b", T_max=1024))
    text = describe(steps[-1][1])
    assert text.count("\n  [") == len(steps[-1][1].buckets)
    assert "stream_gemv" in text and "hybrid(R∈" in text and "✗ stream_gemv" in text
    assert describe(steps[0][1]) == str(steps[0][1])
    cpu = describe(run_pipeline(gpu_block("mixtral-8x7b", T_max=1024), "cpu")[-1][1])
    assert "✗ grouped_gemm: one-row regime up to T=1 on cpu" in cpu


def test_presets_run_through_the_pipeline():
    presets = pytest.importorskip("moetune.ir.presets")
    for name in GPU_SHAPES:
        block = presets.preset(name)
        assert (block.E, block.k, block.D, block.F) == GPU_SHAPES[name]
        sb = schedule_block(block, tokens=(1, 1024))
        assert isinstance(sb, ScheduledBlock) and verify_scheduled(sb, final=True)


def test_a_backend_without_the_preferred_kind_gets_no_hybrid_whose_threshold_is_out_of_reach():
    """In the one-row buckets the rules propose only stream_gemv; a backend with no such kernel gets its
    default from the kinds it offers, and a hybrid there would carry a threshold no expert reaches."""
    pytest.importorskip("jax")
    from moetune.codegen.pallas_tpu import PallasTpuBackend, grouped_gemm, hybrid

    class NoGemv(PallasTpuBackend):
        KINDS = (grouped_gemm.KIND, hybrid.KIND)

    block = MoEBlock(E=8, k=2, D=256, F=256, weight_dtype="bfloat16")
    sb = schedule_block(block, "tpu-v5e", tokens=(1, 16), backend=NoGemv())
    verify_scheduled(sb)
    for b in sb.buckets:
        s = b.schedule
        assert s.kind != "stream_gemv"
        assert s.kind != "hybrid" or s.row_threshold <= b.hi
    assert sb.buckets[0].hi == 1 and sb.buckets[0].schedule.kind == "grouped_gemm"
