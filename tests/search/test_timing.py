"""Timers: the CPU timer's median, rotation and thread handling; the fake timer; the JAX timer; the CUDA timer on
a GPU."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import toy_backend as tb

from moetune.search.objective import expert_tensors, make_cases
from moetune.search.timing import (
    Case,
    CpuTimer,
    CudaGraphTimer,
    CuptiUnavailable,
    FakeTimer,
    JaxTimer,
    KernelSumTimer,
    NotCapturable,
    cupti_reachable,
    routing_mean,
    timer_for,
)


def cases(n: int = 4, T: int = 3):
    return make_cases(tb.BLOCK, expert_tensors(tb.BLOCK), T, n, torch.Generator().manual_seed(0))


def test_cpu_timer_takes_the_median_and_rotates_the_routings():
    cs = cases(4)
    seen = []
    slow = {id(cs[0].x)}  # one routing in four is slow: the median must not see it

    def fn(x, ids, weights, w):
        seen.append(id(x))
        time.sleep(0.02 if id(x) in slow else 0.002)
        return x

    t = CpuTimer(warmup=2, reps=12, max_time_s=5.0)(fn, cs)
    assert t.reps == 12 and len(seen) == 14
    assert all(a != b for a, b in zip(seen, seen[1:], strict=False))  # never the same routing twice in a row
    assert {id(c.x) for c in cs} == set(seen)
    assert 0.002 <= t.median_s < 0.01
    assert t.spread_s >= 0


def test_cpu_timer_stops_at_its_time_cap():
    calls = []

    def fn(x, ids, weights, w):
        calls.append(1)
        time.sleep(0.01)

    t = CpuTimer(warmup=0, reps=1000, max_time_s=0.05)(fn, cases(2))
    assert 3 <= t.reps < 20  # at least its minimum of 3 reps, far fewer than the 1000 asked for
    assert len(calls) < 40


def test_cpu_timer_runs_on_its_threads_and_restores_them():
    before = torch.get_num_threads()
    inside = []
    CpuTimer(warmup=0, reps=2, threads=1)(lambda *a: inside.append(torch.get_num_threads()), cases(2))
    assert inside == [1, 1] and torch.get_num_threads() == before


def test_fake_timer_runs_the_kernel_once_and_reports_the_cost():
    calls = []
    s = tb.toy("toy-timing").default(tb.BLOCK, "stream_gemv", 1)
    t = FakeTimer(tb.cost)(lambda *a: calls.append(1), cases(2), s)
    assert calls == [1] and t.median_s == tb.cost(s)


def test_timer_for_the_device():
    from moetune.codegen.backend import get

    assert isinstance(timer_for("cpu"), CpuTimer)
    assert isinstance(timer_for("cuda:0"), CudaGraphTimer)
    assert isinstance(timer_for("cuda:0", get("triton")), CudaGraphTimer)
    pallas = get("pallas_tpu")  # a backend whose kernels are JAX programs: no torch graph can hold them
    assert isinstance(timer_for("cuda:0", pallas), KernelSumTimer) and isinstance(timer_for("cpu", pallas), CpuTimer)


def test_the_kernel_sum_needs_cupti_and_says_so():
    if cupti_reachable():
        pytest.skip("CUPTI is reachable here")
    with pytest.raises(CuptiUnavailable, match="CUPTI is not reachable"):
        KernelSumTimer(reps=50, flush_bytes=1 << 10)(lambda *a: a[0], cases(1))
    with pytest.raises(ValueError, match="at least 50"):
        KernelSumTimer(reps=10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA timing needs a CUDA device")
def test_the_kernel_sum_agrees_with_the_graph_replay():  # pragma: no cover - GPU only
    if not cupti_reachable():
        pytest.skip("CUPTI is not reachable (JAX's CUDA build)")
    block = tb.BLOCK.replace(weight_dtype="bfloat16", routing_weight_dtype="bfloat16", D=1024, F=512)
    w = expert_tensors(block, "cuda")
    cs = make_cases(block, w, 4, 8, torch.Generator().manual_seed(0))
    from moetune.search.baseline import baseline_fn

    fn, _ = baseline_fn(block, "batched_mm")
    graph = CudaGraphTimer(reps=100)(fn, cs).median_s
    t = KernelSumTimer(reps=100)(fn, cs)
    assert t.reps == 100 and len(t.times_s) == 5 and t.spread_s == t.times_s[-1] - t.times_s[0]
    assert 0.5 * graph < t.median_s <= 1.1 * graph  # the kernels alone: at most the replay, gaps excluded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph timing needs a CUDA device")
def test_cuda_graph_timer_on_a_gpu():  # pragma: no cover - GPU only
    block = tb.BLOCK.replace(weight_dtype="bfloat16", routing_weight_dtype="bfloat16")
    w = expert_tensors(block, "cuda")
    cs = make_cases(block, w, 4, 8, torch.Generator().manual_seed(0))
    from moetune.search.baseline import baseline_fn

    fn, _ = baseline_fn(block, "batched_mm")
    t = CudaGraphTimer(reps=20, warmup=2)(fn, cs)
    assert 0 < t.median_s < 0.1 and t.host_median_s is not None
    assert len(t.times_s) == 20 and t.median_s == pytest.approx(routing_mean(t.times_s, len(cs)))
    shared = CudaGraphTimer(reps=20, warmup=2, shared_pool=True)(fn, cs)  # one pool for the 8 graphs
    assert len(shared.times_s) == 20 and 0 < shared.median_s < 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph timing needs a CUDA device")
def test_a_host_synchronising_call_is_refused_by_the_graphs_and_timed_host_launched():  # pragma: no cover
    cs = cases(2)
    cs = [Case(c.x.cuda(), c.ids.cuda(), c.weights.cuda(), c.w) for c in cs]

    def syncing(x, ids, weights, w):
        return x[ids[:, 0].nonzero()[:, 0]]  # nonzero: the host waits for the device

    timer = CudaGraphTimer(reps=20, warmup=2)
    with pytest.raises(NotCapturable):
        timer(syncing, cs)
    assert 0 < timer.host_launched(syncing, cs) < 0.1


def test_routing_mean_weighs_every_routing_and_drops_each_ones_outliers():
    from moetune.search.timing import routing_mean

    # 4 routings, 3 reps each in rotation; routings 0 and 1 are cheap (10), 2 and 3 dear (14); one rep of
    # routing 1 is an outlier (90)
    times = [10e-6, 10e-6, 14e-6, 14e-6] * 3
    times[5] = 90e-6  # rep 5 → routing 1
    assert routing_mean(times, 4) == pytest.approx(12e-6)  # the mean over routings, outlier dropped
    skewed = [10e-6] * 3 + [14e-6] * 1  # three cheap routings, one dear: a median of the reps says 10
    assert routing_mean(skewed * 3, 4) == pytest.approx(11e-6)
    assert routing_mean([5e-6, 7e-6], 4) == pytest.approx(6e-6)  # fewer reps than routings


def test_cpu_timer_does_not_time_the_warm_up():
    """A first call that compiles (slow) must not reach the median."""
    calls = []

    def fn(x, ids, weights, w):
        calls.append(1)
        time.sleep(0.1 if len(calls) == 1 else 0.002)

    t = CpuTimer(warmup=1, reps=5, max_time_s=5.0)(fn, cases(2))
    assert len(calls) == 6 and t.reps == 5 and t.median_s < 0.02


def test_cpu_timer_of_a_slow_call_stays_near_its_time_cap():
    """A call slower than the cap: one warm-up, `min_reps` reps, not warmup + 21 reps."""
    calls = []

    def fn(x, ids, weights, w):
        calls.append(1)
        time.sleep(0.03)

    t0 = time.monotonic()
    t = CpuTimer(warmup=3, reps=21, max_time_s=0.02, min_reps=3)(fn, cases(2))
    assert len(calls) == 4 and t.reps == 3 and time.monotonic() - t0 < 0.3
    assert 0.03 <= t.median_s < 0.06


def test_cpu_timer_reports_the_spread_of_its_reps():
    delays = iter([0.001, 0.001, 0.02, 0.001, 0.02, 0.001, 0.02, 0.001, 0.02])

    def fn(x, ids, weights, w):
        time.sleep(next(delays))

    t = CpuTimer(warmup=1, reps=8, max_time_s=5.0)(fn, cases(2))
    assert t.spread_s > 0.01  # the interquartile range of 1 ms and 20 ms reps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph timing needs a CUDA device")
def test_a_capture_lets_another_thread_allocate_and_launch():  # pragma: no cover - GPU only
    """The search's build pool first-launches candidates in other threads while a graph is being captured:
    their allocations and launches must neither fail nor spoil the capture."""
    import threading

    block = tb.BLOCK.replace(weight_dtype="bfloat16", routing_weight_dtype="bfloat16")
    w = expert_tensors(block, "cuda")
    cs = make_cases(block, w, 4, 8, torch.Generator().manual_seed(0))
    from moetune.search.baseline import baseline_fn

    fn, _ = baseline_fn(block, "batched_mm")
    stop, errors = threading.Event(), []

    def other():
        try:
            while not stop.is_set():
                torch.empty(int(torch.randint(1, 1 << 20, ())), device="cuda").fill_(1.0)  # as a first launch does
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    try:
        timing = CudaGraphTimer(reps=20, warmup=2)(fn, cs)
    finally:
        stop.set()
        t.join()
    assert not errors and 0 < timing.median_s < 0.1


def test_jax_timer_waits_for_each_result_and_rotates_the_routings():
    """Each rep is timed until its result is ready (a host callback sleeping 2 ms is inside the time), the cases
    rotate from the first after the warm-up, and fewer than 50 reps are refused."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    seen = []

    def slow(x):  # host-side numpy: a JAX op inside the callback would wait on the calls queued behind it
        x = np.asarray(x)
        seen.append(float(x[0]))
        time.sleep(0.002)
        return x

    fn = jax.jit(lambda x: jax.pure_callback(slow, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1)
    cs = [(jnp.full((4,), float(i)),) for i in range(3)]
    t = JaxTimer(reps=50, warmup=2, flush_bytes=1 << 20)(fn, cs)
    assert t.reps == 50 and len(t.times_s) == 50 and t.method == JaxTimer.name
    assert seen == [0.0, 1.0] + [float(i % 3) for i in range(50)]
    assert 0.002 <= t.median_s < 0.05 and min(t.times_s) >= 0.002
    seen.clear()
    per_call = JaxTimer(reps=50, warmup=2, flush_bytes=1 << 20).pipelined(fn, cs, rounds=1)
    assert seen == [0.0] + [float(i % 3) for i in range(50)]  # one warm call, then every rep in rotation
    assert 0.0015 <= per_call < 0.05  # the callback's 2 ms sleep is the call's steady cost
    seen.clear()
    stepped = JaxTimer(reps=50, warmup=2, flush_bytes=1 << 20).pipelined(fn, cs, rounds=1, depth=2)
    assert seen == [0.0] + [float(i % 3) for i in range(50)] and 0.0015 <= stepped < 0.05
    with pytest.raises(ValueError, match="depth = 0"):
        JaxTimer(reps=50).pipelined(fn, cs, depth=0)
    with pytest.raises(ValueError, match="at least 50"):
        JaxTimer(reps=10)
