"""moetune.jax.experts on the torch-facing backends (torch, triton) through the XLA FFI: against the torch
float32 reference in every weight format, under jit; the triton entries of a dispatch table serve the JAX
path unchanged; the lowered program holds the FFI call inside moetune's scope."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import moetune.jax as mj  # noqa: E402
from moetune.codegen.pallas_tpu._common import to_jax  # noqa: E402
from moetune.codegen.quant import activation_group  # noqa: E402
from moetune.codegen.torch import experts_reference  # noqa: E402
from moetune.codegen.torch.tolerance import worst_error  # noqa: E402
from moetune.codegen.triton import GemvParams  # noqa: E402
from moetune.ir import MoEBlock, Schedule, WeightFormat, WeightLayout  # noqa: E402
from moetune.jax.xla_call import XlaBridged  # noqa: E402
from moetune.runtime.dispatch import DispatchWarning  # noqa: E402
from moetune.runtime.entry import DispatchEntry  # noqa: E402
from moetune.runtime.table import DispatchTable  # noqa: E402
from moetune.runtime.versions import Versions  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402
from tests.codegen.triton_cases import DEV as DEVICE  # noqa: E402  (cpu, interpreted; with MOETUNE_TEST_GPU=1: cuda)

BLOCKS = {
    "f32": MoEBlock(E=6, k=2, D=32, F=16, weight_dtype="float32", routing_weight_dtype="float32", T_max=64),
    "bf16_transposed_bias": MoEBlock(E=5, k=3, D=16, F=24, layout=WeightLayout(transposed=True, has_bias=True),
                                     T_max=64),
    "f32_k1": MoEBlock(E=3, k=1, D=8, F=8, weight_dtype="float32", T_max=64),
    "fp8_block": MoEBlock(E=4, k=2, D=256, F=128, T_max=64).with_weight_format(WeightFormat.fp8_block((128, 128))),
}
ROUTINGS = ("random", "sentinels", "one_hot")


def _case(block: MoEBlock, T: int, routing: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, block.D, generator=g).to(getattr(torch, block.weight_format.compute_dtype))
    ids = torch.stack([torch.randperm(block.E, generator=g)[:block.k] for _ in range(T)]).to(torch.int32)
    if routing == "sentinels":
        ids[0, 0] = -1
        ids[-1, -1] = block.E
    if routing == "one_hot":
        ids[:, 0] = 1  # one expert takes every token; most experts get no row
    wts = torch.softmax(torch.randn(T, block.k, generator=g), 1).to(getattr(torch, block.routing_weight_dtype))
    return x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE)


def _jitted(block, backend, **kw):
    def f(x, i, t, gu, dn, gus, dns, gub, dnb):
        return mj.experts(x, i, t, gu, dn, block=block, backend=backend, gate_up_scale=gus, down_scale=dns,
                          gate_up_bias=gub, down_bias=dnb, **kw)

    return jax.jit(f)


def _args(case, w):
    return tuple(to_jax(a) for a in (*case, w.gate_up, w.down, w.gate_up_scale, w.down_scale, w.gate_up_bias,
                                     w.down_bias))


def _check(block, backend, T, routing, seed=0, **kw):
    w = expert_tensors(block, DEVICE, seed=seed + 1)
    case = _case(block, T, routing, seed)
    out = _jitted(block, backend, **kw)(*_args(case, w))
    assert out.shape == (T, block.D) and out.dtype == jnp.dtype(block.weight_format.compute_dtype)
    x, ids, wts = case
    sch = mj.route(block, T, backend=backend, table=kw.get("table"), target=kw.get("target")).schedule
    group = activation_group(sch.params) if sch is not None else None  # w8a8: its rounding's reference and bound
    tf32 = backend == "triton" and DEVICE != "cpu"  # compiled, Triton's float32 tl.dot rounds its inputs to TF32
    ref = experts_reference(block, x, ids.long(), wts, w, group)
    err = worst_error(torch.from_dlpack(out), ref, a8=group is not None, tf32=tf32)
    assert err <= 1.0, (backend, T, routing, err)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("name", BLOCKS)
def test_the_torch_backend_runs_under_jit_through_xla(name, routing):
    for T in (1, 7):
        _check(BLOCKS[name], "torch", T, routing, seed=T)


@pytest.mark.parametrize("name", ["f32", "fp8_block"])
def test_the_triton_kernels_run_under_jit_through_xla(name):
    """GEMV and grouped GEMM (the defaults at T = 1 and at T = 24 on these blocks)."""
    block = BLOCKS[name]
    kinds = {mj.route(block, T, backend="triton").schedule.kind for T in (1, 24)}
    assert kinds == {"stream_gemv", "grouped_gemm"}
    for T, routing in ((1, "random"), (24, "one_hot"), (24, "sentinels")):
        _check(block, "triton", T, routing, seed=T)


def test_a_torch_backend_is_bridged_and_keeps_its_own_name_and_target():
    be = mj.jax_backend("triton")
    assert isinstance(be, XlaBridged) and be.name == "triton" and be.target.name == be._backend.target.name
    assert mj.jax_backend("triton") is be  # one object per backend: its routes are built once


def _triton_entry(block, bucket, schedule, target):
    v = Versions.current("triton", DEVICE)
    return DispatchEntry.of(target=target, block=block, bucket=bucket, time_us=1.0,
                            schedule=dataclasses.replace(schedule, backend="triton"), versions=v)


def test_the_tables_triton_entries_serve_the_jax_path_unchanged(tmp_path):
    block = BLOCKS["f32"]
    gemv = Schedule("stream_gemv", backend="triton", params=GemvParams(block_n=16, block_k=32, num_warps=2))
    path, target = tmp_path / "t.sqlite", "cpu" if DEVICE == "cpu" else mj.jax_backend("triton").target.name
    with DispatchTable(path) as t:
        t.put_all([_triton_entry(block, (1, 64), gemv, target)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)  # the entry covers every T: nothing to say
        r = mj.route(block, 3, table=str(path), backend="triton", target=target)
        assert (r.source, r.schedule) == ("table", gemv)
        _check(block, "triton", 3, "random", table=str(path), target=target)
        w = expert_tensors(block, DEVICE, seed=1)
        text = _jitted(block, "triton", table=str(path), target=target).lower(
            *_args(_case(block, 3, "random"), w)).as_text(debug_info=True)
    assert f"{mj.SCOPE}/triton.stream_gemv" in text and "buffer" in text.lower()


@pytest.mark.skipif(not os.environ.get("MOETUNE_TEST_GPU") or not torch.cuda.is_available(),
                    reason="XLA records the call into a CUDA graph on a GPU: MOETUNE_TEST_GPU=1 on a GPU machine")
@pytest.mark.parametrize("name", ["f32", "fp8_block"])
def test_the_recorded_call_replays_each_calls_inputs(name):  # pragma: no cover - GPU only
    """A program in which the call's output is a temporary (x + experts(x), widened), so that XLA records it into a
    CUDA graph and replays it at the same addresses, run over several routings in turn and again: each result is
    that routing's, never a replay of another's; GEMV and grouped GEMM."""
    block = BLOCKS[name]
    w = expert_tensors(block, "cuda", seed=1)
    wj = [None if a is None else to_jax(a) for a in (w.gate_up, w.down, w.gate_up_scale, w.down_scale)]

    @jax.jit
    def f(x, i, t, gu, dn, gus, dns):
        y = mj.experts(x, i, t, gu, dn, block=block, backend="triton", gate_up_scale=gus, down_scale=dns)
        return x.astype(jnp.float32) + y.astype(jnp.float32)

    for T in (1, 24):
        cases = [tuple(a.cuda() for a in _case(block, T, "random", seed=s)) for s in range(4)]
        sch = mj.route(block, T, backend="triton").schedule
        for _ in range(3):
            for x, ids, wts in cases:
                got = torch.from_dlpack(f(to_jax(x), to_jax(ids), to_jax(wts), *wj)) - x.float()
                group = activation_group(sch.params)
                ref = experts_reference(block, x, ids.long(), wts, w, group)
                err = worst_error(got.to(x.dtype), ref, tf32=True, a8=group is not None)
                assert err <= 1.0, (T, err)


def test_a_call_site_recorded_again_and_again_says_so_once():
    """XLA records a call anew whenever its buffers move (many calls in flight): past RERECORD_WARN recordings the
    site says so, once, naming the block."""
    from moetune.jax import xla_call

    site, other = (xla_call._CallSite(lambda *a: None, n) for n in ("qwen3-30b-a3b", "mixtral-8x7b"))
    before = xla_call.recordings()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3 * xla_call.RERECORD_WARN):
            site.recorded()
        other.recorded()
    said = [w for w in seen if issubclass(w.category, DispatchWarning)]
    assert len(said) == 1 and "qwen3-30b-a3b" in str(said[0].message) \
        and f"{xla_call.RERECORD_WARN} times" in str(said[0].message) \
        and "xla_cmd_buffer_trace_cache_size" in str(said[0].message)
    assert xla_call.recordings() - before == 3 * xla_call.RERECORD_WARN + 1  # every site's, counted together
