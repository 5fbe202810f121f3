"""The direct launch path (moetune/codegen/triton/launch.py): its key is never coarser than Triton's own
specialisation (CPU, against the installed Triton's specialiser), and on a GPU a kernel launched past
Triton's dispatch computes what Triton's dispatch launches, also for a new specialisation (a misaligned
x, another T), in a CUDA graph, and under a launch hook."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("moetune.codegen.triton")
from triton_cases import ON_GPU, SCHEDULES, make_problem, within  # noqa: E402

from moetune.codegen.torch.reference import experts_reference  # noqa: E402
from moetune.codegen.triton import BACKEND, launch  # noqa: E402


def _key(a):
    return launch._Site.key_of((a,))[0]


def _samples():
    """Arguments by Python type: a launch site's position keeps its type (launch.py's doc)."""
    buf = torch.zeros(64, dtype=torch.float16)
    tensors = [buf, buf[1:], buf[4:], buf[8:], buf.float(), buf.float()[1:], buf.float()[4:], buf.to(torch.int32),
               buf.to(torch.int32)[2:], buf.to(torch.bfloat16)[8:], torch.nn.Parameter(buf.float())]
    ints = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**32, 2**63 - 16, 2**63, 2**64 - 16]
    return [tensors, ints, [True, False], [0.0, 1.5, -2.0], [None]]


def test_the_key_is_never_coarser_than_tritons_specialisation():
    """Two arguments of one type with one key get one specialisation from Triton's own specialiser, with
    and without value specialisation (do_not_specialize), so one cached kernel is the one Triton's
    dispatch picks."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    same = 0
    for group in _samples():
        for a, b in itertools.combinations(group, 2):
            if _key(a) != _key(b):
                continue
            same += 1
            for specialize in (True, False):
                sa = native(BaseBackend, a, False, specialize, True)
                sb = native(BaseBackend, b, False, specialize, True)
                assert sa == sb, f"{a!r} and {b!r}: one key {_key(a)}, Triton {sa} vs {sb}"
    assert same >= 3  # tensors of one dtype and alignment share a key (the test compares something)


def test_a_tensor_is_keyed_by_dtype_and_alignment_only():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert _key(buf) == _key(buf[8:]) == _key(torch.ones(3, dtype=torch.bfloat16))
    assert len({_key(buf), _key(buf[1:]), _key(buf.half()), _key(buf.float())}) == 4


gpu = pytest.mark.skipif(not ON_GPU, reason="the direct launch path runs on a CUDA GPU only")


@pytest.fixture
def dispatches(monkeypatch):
    """Counts launches through Triton's JIT dispatch (JITFunction.run, wrapped, still called)."""
    from triton.runtime.jit import JITFunction

    seen = []
    real = JITFunction.run

    def run(self, *args, **kwargs):
        seen.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", run)
    return seen


@gpu
@pytest.mark.parametrize("sched", list(SCHEDULES), ids=list(SCHEDULES))
def test_direct_launch_computes_what_tritons_dispatch_does(sched, dispatches, monkeypatch):
    monkeypatch.setattr(launch, "_SITES", {})  # every key new: the first call goes through Triton
    block, x, ids, weights, w = make_problem(16, 4, 256, 192, 24, "uniform", torch.bfloat16, {})
    fn = BACKEND.build(block, SCHEDULES[sched])
    ref = experts_reference(block, x, ids, weights, w)
    first = fn(x, ids, weights, w)  # compiles; every launch through Triton's dispatch
    n_first = len(dispatches)
    assert n_first > 0
    again = fn(x, ids, weights, w)
    tma = getattr(SCHEDULES[sched].params, "tma", False)
    # TMA's two GEMM launches stay with Triton (descriptors); its routing, gather and combine do not
    assert len(dispatches) - n_first == (2 if tma else 0), "a launch went through Triton's dispatch again"
    monkeypatch.setattr(launch, "DIRECT", False)
    through_triton = fn(x, ids, weights, w)
    monkeypatch.setattr(launch, "DIRECT", True)
    assert torch.equal(again, through_triton) and torch.equal(first, again)
    assert within(again, ref)

    # a new specialisation: x 2 bytes off 16-byte alignment, another T (P) with fresh values
    block2, x2, ids2, weights2, _ = make_problem(16, 4, 256, 192, 7, "one_hot_expert", torch.bfloat16, {}, seed=3)
    store = torch.empty(x2.numel() + 1, dtype=x2.dtype, device=x2.device)
    xm = store[1:].view_as(x2)
    xm.copy_(x2)
    assert xm.data_ptr() % 16 != 0
    for _ in range(2):  # the first through Triton (a new key), the second direct
        out = fn(xm, ids2, weights2, w)
        assert within(out, experts_reference(block2, x2, ids2, weights2, w))


@gpu
def test_direct_launches_are_captured_in_a_cuda_graph():
    block, x, ids, weights, w = make_problem(16, 4, 256, 192, 6, "uniform", torch.bfloat16, {})
    fn = BACKEND.build(block, SCHEDULES["gemv_routed_expert_split"])
    fn(x, ids, weights, w)  # compile and cache outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x, ids, weights, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(x, ids, weights, w)
    _, x2, ids2, weights2, _ = make_problem(16, 4, 256, 192, 6, "zero_rows", torch.bfloat16, {}, seed=5)
    x.copy_(x2)
    ids.copy_(ids2)
    weights.copy_(weights2)
    g.replay()
    torch.cuda.synchronize()
    assert within(out, experts_reference(block, x2, ids2, weights2, w))


@gpu
def test_a_launch_hook_sees_every_launch():
    """With a launch hook registered (a profiler), every launch goes through Triton's dispatch, which hands
    the hook its launch metadata."""
    from triton import knobs

    block, x, ids, weights, w = make_problem(16, 4, 256, 192, 6, "uniform", torch.bfloat16, {})
    fn = BACKEND.build(block, SCHEDULES["gemm_m16"])
    fn(x, ids, weights, w)
    seen = []
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a HookChain (newer Triton) or a plain attribute
        chain.add(seen.append)
    else:
        knobs.runtime.launch_enter_hook = seen.append
    try:
        fn(x, ids, weights, w)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(seen.append)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 4 and all(m is not None for m in seen)  # route, gate/up, down, combine
