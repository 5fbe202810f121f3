"""The jax suite's CPU-checkable parts: its bad arguments and a machine without a GPU are one line and exit 2;
its two JAX functions (moetune's, in Pallas' interpreter, and the ragged_dot one) match the float32
reference; its records carry the floor's percentage and the ratios of the same cell; the table has a line
per record."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("jax")

from test_bench import bench  # noqa: E402

from bench import jax as J  # noqa: E402
from moetune.codegen.pallas_gpu._common import INTERPRET_ENV  # noqa: E402
from moetune.codegen.pallas_tpu._common import jax_experts, to_jax  # noqa: E402
from moetune.codegen.torch import experts_reference, worst_error  # noqa: E402
from moetune.ir import MoEBlock  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402


@pytest.mark.parametrize("args,what", [(("--tokens", "1,0"), "--tokens"), (("--tokens", "a"), "--tokens"),
                                       (("--shapes", "qwen3-30b-a3b,nope"), "nope"), (("--reps", "10"), "--reps"),
                                       (("--frobnicate",), "--frobnicate")])
def test_bad_arguments_are_one_line_and_exit_2(args, what):
    out = bench("jax", *args)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and what in out.stderr, out.stderr


def test_without_a_gpu_it_says_so_and_exits_2():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    out = bench("jax", "--tokens", "1")
    assert out.returncode == 2 and "no CUDA device" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def _inputs(block: MoEBlock, T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = expert_tensors(block, seed=seed)
    x = torch.randn(T, block.D, generator=gen).to(w.gate_up.dtype)
    ids = torch.stack([torch.randperm(block.E, generator=gen)[:block.k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, block.k, generator=gen), dim=1).to(x.dtype)
    return x, ids, wts, w


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_ragged_dot_experts_match_the_reference(dtype):
    block = MoEBlock(E=8, k=2, D=64, F=32, weight_dtype=dtype, routing_weight_dtype=dtype)
    x, ids, wts, w = _inputs(block, 5)
    ids[1, 1] = -1  # a sentinel: weight 0
    out = J.ragged_fn(block)(to_jax(x), to_jax(ids.to(torch.int32)), to_jax(wts), *J.ragged_weights(jax_experts(w)))
    assert worst_error(torch.from_dlpack(out), experts_reference(block, x, ids, wts, w)) <= 1


@pytest.mark.parametrize("T", [1, 40])  # the default's two regimes: the streaming GEMV, the grouped GEMM
def test_moetune_fn_is_the_jitted_default_and_matches_the_reference(monkeypatch, T):
    monkeypatch.setenv(INTERPRET_ENV, "1")
    block = MoEBlock(E=8, k=2, D=64, F=32, weight_dtype="bfloat16", routing_weight_dtype="bfloat16")
    assert J.moetune_schedule(block, T)[0].kind == ("stream_gemv" if T == 1 else "grouped_gemm")
    x, ids, wts, w = _inputs(block, T, seed=T)
    args = (to_jax(x), to_jax(ids.to(torch.int32)), to_jax(wts), jax_experts(w))
    fn = J.moetune_fn(block, T)  # moetune.jax.experts, jitted: its lowered program names the kernel it runs
    assert worst_error(torch.from_dlpack(fn(*args)), experts_reference(block, x, ids, wts, w)) <= 1
    text = fn.lower(*args).as_text(debug_info=True)
    assert f"moetune_experts/pallas_gpu.{J.moetune_schedule(block, T)[0].kind}" in text


@pytest.mark.parametrize("T", [1, 12])
def test_the_triton_route_runs_the_tables_schedule_through_xla(tmp_path, T):
    """moetune_fn on the triton backend: moetune.jax.experts at an XLA FFI call (interpreted Triton here),
    right against the reference, its lowered program naming the triton kernel kind; with no entry in the
    table the runtime default at T runs, and the record's schedule says so."""
    block = MoEBlock(E=8, k=2, D=64, F=32, name="bench-jax-xla")
    x, ids, wts, w = _inputs(block, T, seed=T)
    args = (to_jax(x), to_jax(ids.to(torch.int32)), to_jax(wts), jax_experts(w))
    table = str(tmp_path / "empty.sqlite")
    fn = J.moetune_fn(block, T, backend="triton", table=table)
    with pytest.warns(Warning, match="no usable entry"):
        got = fn(*args)
    assert worst_error(torch.from_dlpack(got), experts_reference(block, x, ids, wts, w)) <= 1
    assert "moetune_experts/triton." in fn.lower(*args).as_text(debug_info=True)
    assert J.xla_schedule(block, T, table).startswith("default (no entry): triton:")


def test_records_carry_the_floor_share_and_the_ratios_of_their_cell():
    block = MoEBlock(E=8, k=2, D=64, F=32)
    recs = [J.record("s", block, 1, "moetune-jax", 10.0, time_us=20.0, pipelined_us=5.0, compile_s=1.5,
                     schedule="x"),
            J.record("s", block, 1, "moetune-jax:hybrid", 10.0, error="RuntimeError: boom"),
            J.record("s", block, 1, "ragged_dot", 10.0, time_us=50.0),
            J.record("s", block, 1, "moetune-torch", 10.0, time_us=10.0, host_us=30.0),
            J.record("s", block, 8, "moetune-jax", 40.0, time_us=80.0),  # another cell: no ratios from the first
            J.record("s", block, 8, "ragged_dot", 40.0, error="XlaRuntimeError: out of memory")]
    J.add_ratios(recs)
    first = recs[0]
    assert first["pct_floor"] == 50.0 and (first["E"], first["k"], first["D"], first["F"]) == (8, 2, 64, 32)
    # like for like: host-timed against host-launched and ragged_dot, pipelined against the graph replay
    assert (first["vs_ragged_dot"], first["vs_torch_graph"], first["vs_torch_host"]) == (2.5, 2.0, 1.5)
    assert "pct_floor" not in recs[1] and "vs_ragged_dot" not in recs[1]
    assert recs[4]["pct_floor"] == 50.0 and not {"vs_ragged_dot", "vs_torch_graph"} & set(recs[4])
    text = J.table(recs).splitlines()
    assert len(text) == 2 + len(recs)
    assert "boom" in text[3] and "out of memory" in text[7] and " 2.50 " in text[2]


def test_time_jax_checks_before_it_times():
    """A function within the bound is timed (compile time, reps, the timer's method recorded); a wrong one is
    recorded with its error and not timed."""
    import jax

    from moetune.search.timing import JaxTimer

    block = MoEBlock(E=8, k=2, D=64, F=32)
    x, ids, wts, w = _inputs(block, 3)
    case = (to_jax(x), to_jax(ids.to(torch.int32)), to_jax(wts), *J.ragged_weights(jax_experts(w)))
    ref = experts_reference(block, x, ids, wts, w)
    good = J.time_jax(J.ragged_fn(block), [case], ref, JaxTimer(reps=50, flush_bytes=1 << 20))
    assert good["worst_err"] <= 1 and good["reps"] == 50 and good["time_us"] > 0 and good["compile_s"] > 0
    assert good["method"] == JaxTimer.name and "error" not in good and good["pipelined_us"] >= 0
    wrong = jax.jit(lambda *a: J.ragged_fn(block)(*a) * 1.1)
    bad = J.time_jax(wrong, [case], ref, JaxTimer(reps=50, flush_bytes=1 << 20))
    assert "not timed" in bad["error"] and "time_us" not in bad and bad["worst_err"] > 1
