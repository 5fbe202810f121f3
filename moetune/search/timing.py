"""Timers: how long one experts call takes.

A timer times `fn(x [T, D], ids [T, k], weights [T, k], w)` over a list of pre-generated cases (x and
routing), rotating through them so that no two consecutive reps see the same routing, and returns the
median. Three kinds:

    CpuTimer        warm-up, then median of `reps` host-timed calls (perf_counter_ns), rotated cases,
                    both cut short once they pass `max_time_s` (a slow call is timed a few times only)
    CudaGraphTimer  one CUDA graph per case, L2 defeated by *reading* a 256 MB buffer before every rep,
                    CUDA events around each replay, ≥ 100 reps (device time): the median of each case's
                    replays, averaged over the cases (`routing_mean`); plus the plain host-launched time
    KernelSumTimer  a call a CUDA graph cannot hold (a JAX program): its kernels' device time per call as CUPTI
                    records them (`kernel_sum`), after the same flush read, median of rounds
    FakeTimer       a function of the schedule: tests of the search without measuring anything
    JaxTimer        jitted JAX calls (no CUDA graphs: JAX's calls cannot be captured by torch): L2 defeated by
                    reading a 256 MB JAX buffer before every rep, each rep host-timed to block_until_ready
                    (so JAX's dispatch is included), ≥ 50 reps in rotation, summarised by `routing_mean`;
                    `pipelined`: the per-call cost of calls issued back to back (the steady state);
                    `device_time`: the kernels' own device time per call (CUPTI: `kernel_sum`)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..codegen.tensors import ExpertsFn, ExpertTensors
from ..ir import Schedule, UnsupportedSchedule


class NotCapturable(UnsupportedSchedule):
    """A kernel that cannot be captured in a CUDA graph (it synchronises, or allocates on the host):
    a compiled model must stay capturable, so the search scores it as refused."""


@dataclass(frozen=True)
class Case:
    """One call's inputs: x [T, D], ids [T, k] int64, weights [T, k]; the block's expert tensors."""

    x: torch.Tensor  # [T, D]
    ids: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    w: ExpertTensors

    @property
    def tokens(self) -> int:
        return int(self.x.shape[0])


def routing_mean(times: Sequence[float], n_cases: int) -> float:
    """The mean over the cases of each case's median rep (rep i ran case i mod n_cases): the expected time
    of a call over the routings, with each routing's outliers dropped. A plain median of all reps picks one
    mode when the routings differ in cost (at a small T, routings that touch fewer experts are faster)."""
    per = [statistics.median(times[i::n_cases]) for i in range(min(n_cases, len(times)))]
    return statistics.fmean(per)


@dataclass(frozen=True)
class Timing:
    median_s: float  # the timer's summary: a median (CPU), the mean of the cases' medians (CUDA graphs)
    spread_s: float  # interquartile range of the reps
    reps: int
    method: str
    host_median_s: float | None = None  # plain host-launched time (GPU timer only)
    times_s: tuple[float, ...] = ()  # every timed rep in run order, rep i on case i mod n (GPU timer only)


class Timer(Protocol):
    name: str

    def __call__(self, fn: ExpertsFn, cases: Sequence[Case], schedule: Schedule | None = None) -> Timing: ...


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs)
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


@dataclass(frozen=True)
class CpuTimer:
    """Host timing for CPU kernels: up to `warmup` calls (fewer once they pass `max_time_s`, at least
    one), then the median of `reps` calls (stopping once they pass `max_time_s`, after at least
    `min_reps`), rotating through the cases, with `threads` torch threads (1 by default: on a small
    shared machine more threads mostly measure the neighbours)."""

    warmup: int = 3
    reps: int = 21
    max_time_s: float = 0.5
    threads: int | None = 1
    min_reps: int = 3

    @property
    def name(self) -> str:
        return f"cpu:median-of-{self.reps},threads={self.threads or torch.get_num_threads()}"

    def __call__(self, fn: ExpertsFn, cases: Sequence[Case], schedule: Schedule | None = None) -> Timing:
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            times: list[float] = []
            spent = 0.0
            warm = 0
            with torch.inference_mode():
                t_warm = time.perf_counter()
                while warm < self.warmup and (warm == 0 or time.perf_counter() - t_warm <= self.max_time_s):
                    c = cases[warm % len(cases)]
                    fn(c.x, c.ids, c.weights, c.w)
                    warm += 1
                for i in range(self.reps):
                    c = cases[(i + warm) % len(cases)]
                    t0 = time.perf_counter_ns()
                    fn(c.x, c.ids, c.weights, c.w)
                    dt = (time.perf_counter_ns() - t0) * 1e-9
                    times.append(dt)
                    spent += dt
                    if spent > self.max_time_s and len(times) >= self.min_reps:
                        break
        finally:
            torch.set_num_threads(before)
        return Timing(statistics.median(times), _iqr(times), len(times), self.name)


@dataclass
class CudaGraphTimer:
    """A CUDA graph per case, L2 flushed by reading a 256 MB buffer before every rep,
    CUDA events around each replay, `reps` replays in rotation; summarised by `routing_mean` (each case's
    median, averaged over the cases). Also the plain host-launched median, and every rep's time.
    `shared_pool`: the graphs capture into one memory pool (they replay one at a time, so they may share
    their intermediate memory): a call that allocates much holds one call's memory, not one per case."""

    reps: int = 100
    warmup: int = 10
    flush_bytes: int = 256 << 20
    name: str = "cuda:graph+l2-read-flush,mean-over-routings"
    shared_pool: bool = False

    def __post_init__(self) -> None:
        self._flush: torch.Tensor | None = None

    def _flush_buffer(self, device: torch.device) -> torch.Tensor:
        if self._flush is None or self._flush.device != device:
            self._flush = torch.ones(self.flush_bytes // 4, dtype=torch.float32, device=device)
        return self._flush

    def __call__(self, fn: ExpertsFn, cases: Sequence[Case], schedule: Schedule | None = None) -> Timing:
        device = cases[0].x.device
        buf = self._flush_buffer(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graphs = []
        pool = torch.cuda.graph_pool_handle() if self.shared_pool else None
        with torch.cuda.stream(stream), torch.inference_mode():
            for c in cases:  # warm-up outside capture (compiles, allocator), then capture
                fn(c.x, c.ids, c.weights, c.w)
            torch.cuda.synchronize(device)
            for c in cases:
                g = torch.cuda.CUDAGraph()
                try:
                    # thread_local: the search's build pool may compile and first-launch the next candidates
                    # in other threads meanwhile; in the default (global) mode their allocations and module
                    # loads fail, and may invalidate this capture
                    with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
                        fn(c.x, c.ids, c.weights, c.w)
                except RuntimeError as e:
                    torch.cuda.synchronize(device)
                    raise NotCapturable(f"not CUDA-graph capturable: {type(e).__name__}: {e}") from e
                graphs.append(g)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        for i in range(self.warmup):
            graphs[i % len(graphs)].replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        sink = torch.zeros((), device=device)
        for i in range(self.reps):
            sink += buf.sum()  # read, not write: a written flush leaves dirty lines for the timed kernel
            starts[i].record()
            graphs[i % len(graphs)].replay()
            ends[i].record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends, strict=True)]
        host = self._host_launched(fn, cases, buf, sink)
        del graphs
        return Timing(routing_mean(times, len(cases)), _iqr(times), len(times), self.name, host, tuple(times))

    def host_launched(self, fn: ExpertsFn, cases: Sequence[Case]) -> float:
        """The plain host-launched median alone, after the same flush: for a call that cannot be captured
        (one that synchronises with the host), which `__call__` refuses."""
        device = cases[0].x.device
        with torch.inference_mode():
            for c in cases[:2]:
                fn(c.x, c.ids, c.weights, c.w)
        return self._host_launched(fn, cases, self._flush_buffer(device), torch.zeros((), device=device))

    def _host_launched(self, fn: ExpertsFn, cases: Sequence[Case], buf: torch.Tensor,
                       sink: torch.Tensor) -> float:
        times = []
        with torch.inference_mode():
            for i in range(max(20, self.reps // 4)):
                c = cases[i % len(cases)]
                sink += buf.sum()
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                fn(c.x, c.ids, c.weights, c.w)
                torch.cuda.synchronize()
                times.append((time.perf_counter_ns() - t0) * 1e-9)
        return statistics.median(times)


@dataclass(frozen=True)
class FakeTimer:
    """Time = cost(schedule) seconds, measured on nothing (tests of the search). The kernel still runs once,
    so a launch failure is seen as it would be with a real timer."""

    cost: Callable[[Schedule | None], float]
    name: str = "fake"

    def __call__(self, fn: ExpertsFn, cases: Sequence[Case], schedule: Schedule | None = None) -> Timing:
        c = cases[0]
        fn(c.x, c.ids, c.weights, c.w)
        t = float(self.cost(schedule))
        return Timing(t, 0.0, 1, self.name)


@dataclass
class JaxTimer:
    """Times a jitted JAX function `fn(*args)` over `cases` (argument tuples of JAX arrays), rotating through
    them: `warmup` calls, then `reps` timed calls, each after a read of `flush_bytes` (a sum of a JAX buffer
    on the first argument's device, waited for) and timed from the call to `block_until_ready` of its result.
    The summary is `routing_mean` of the reps (each case's median, averaged over the cases)."""

    reps: int = 100
    warmup: int = 5
    flush_bytes: int = 256 << 20
    name: str = "jax:host-timed-block_until_ready+l2-read-flush,mean-over-routings"

    def __post_init__(self) -> None:
        if self.reps < 50:
            raise ValueError(f"JaxTimer.reps = {self.reps}: at least 50")
        self._flush = None

    def __call__(self, fn: Callable, cases: Sequence[tuple]) -> Timing:
        import jax

        read, flush = self._reader(cases)
        for i in range(self.warmup):
            jax.block_until_ready(fn(*cases[i % len(cases)]))
        times = []
        for i in range(self.reps):
            c = cases[i % len(cases)]
            read(flush).block_until_ready()
            t0 = time.perf_counter_ns()
            jax.block_until_ready(fn(*c))
            times.append((time.perf_counter_ns() - t0) * 1e-9)
        return Timing(routing_mean(times, len(cases)), _iqr(times), len(times), self.name, times_s=tuple(times))

    def pipelined(self, fn: Callable, cases: Sequence[tuple], rounds: int = 3, depth: int | None = None) -> float:
        """Seconds per call of `fn` issued back to back, each after the flush read, less the same stream of
        flush reads alone; the median of `rounds`. With `depth` None nothing is waited for until the last
        call: the steady cost of a call while the host keeps ahead of the device (device time, or the host's
        own cost where that is the larger), every call's result another live buffer. With `depth` = d, call i
        is issued only once call i - d has finished, as a decode loop that reads step i - d's result before
        it issues step i: at most d calls in flight, their buffers recycled."""
        import collections

        import jax

        if depth is not None and depth < 1:
            raise ValueError(f"JaxTimer.pipelined depth = {depth}: at least 1, or None")
        read, flush = self._reader(cases)
        jax.block_until_ready(fn(*cases[0]))

        def stream(with_fn: bool) -> float:
            jax.block_until_ready(read(flush))
            live: collections.deque = collections.deque()
            t0 = time.perf_counter_ns()
            for i in range(self.reps):
                r = read(flush)
                live.append(fn(*cases[i % len(cases)]) if with_fn else r)
                if depth is not None and len(live) > depth:
                    jax.block_until_ready(live.popleft())
            jax.block_until_ready((r, list(live)))
            return (time.perf_counter_ns() - t0) * 1e-9 / self.reps

        return statistics.median(max(0.0, stream(True) - stream(False)) for _ in range(rounds))

    def device_time(self, fn: Callable, cases: Sequence[tuple]) -> float | None:
        """Device seconds per call: `kernel_sum` over `reps` calls in rotation, each after the flush read,
        less the flush reads' own; None where CUPTI is not reachable."""
        import jax

        read, flush = self._reader(cases)
        return after_flush(lambda i: fn(*cases[i % len(cases)]), lambda: read(flush), self.reps,
                           jax.block_until_ready)

    def _reader(self, cases: Sequence[tuple]):
        """(jitted sum, the flush buffer on the device of the cases' first array)."""
        import jax
        import jax.numpy as jnp

        device = next(iter(jax.tree_util.tree_leaves(cases[0])[0].devices()))
        if self._flush is None or next(iter(self._flush.devices())) != device:
            self._flush = jax.device_put(jnp.ones(self.flush_bytes // 4, jnp.float32), device)
        return jax.jit(jnp.sum), self._flush


def _call(fn: ExpertsFn, c: Case) -> torch.Tensor:
    return fn(c.x, c.ids, c.weights, c.w)


def _cupti():
    """JAX's GPU extension, through which CUPTI is read; None where it is not installed."""
    try:
        from jax._src.lib import mosaic_gpu

        return mosaic_gpu._mosaic_gpu_ext
    except (ImportError, AttributeError):
        return None


def cupti_reachable() -> bool:
    return _cupti() is not None


def kernel_sum(launch: Callable[[int], object], iterations: int, wait: Callable[[list], object]) -> float | None:
    """Device seconds per iteration of `launch(i)` (which launches and returns what `wait` waits for): the
    durations of every kernel the iterations ran, as CUPTI records them (through JAX's GPU extension, which
    sees the kernels of the whole process: JAX's and torch's), summed and divided by `iterations`; gaps
    between kernels are not counted. None where the extension is not installed (no CUDA JAX) or records
    nothing."""
    ext = _cupti()
    if ext is None:
        return None
    wait([launch(0)])
    ext._cupti_init()
    try:
        wait([launch(i) for i in range(iterations)])
    finally:
        timings = ext._cupti_get_timings(True)
    if not timings:
        return None
    return sum(ms for _, ms in timings) * 1e-3 / iterations


class CuptiUnavailable(UnsupportedSchedule):
    """CUPTI, which KernelSumTimer reads, is not reachable (JAX's CUDA build is not installed)."""


@dataclass
class KernelSumTimer:
    """Device time of a call that a CUDA graph cannot hold (a JAX program, behind `bridged`): `kernel_sum`
    of `reps` calls in rotation in `rounds` rounds, each call after a read of `flush_bytes`, less the flush
    reads' own; the summary is the median of the rounds, the spread their range. Kernels alone, no gaps
    between them: the figure a CUDA graph of the whole call would approach. The torch ↔ JAX conversion
    kernels of the bridge (the ids' dtype) are in it, the same for every candidate."""

    reps: int = 100
    rounds: int = 5
    warmup: int = 2
    flush_bytes: int = 256 << 20
    name: str = "cuda:cupti-kernel-sum+l2-read-flush,median-of-rounds"

    def __post_init__(self) -> None:
        if self.reps < 50 or self.rounds < 1:
            raise ValueError(f"KernelSumTimer reps = {self.reps}, rounds = {self.rounds}: at least 50 and 1")
        self._flush: torch.Tensor | None = None

    def __call__(self, fn: ExpertsFn, cases: Sequence[Case], schedule: Schedule | None = None) -> Timing:
        device = cases[0].x.device
        if self._flush is None or self._flush.device != device:
            self._flush = torch.ones(self.flush_bytes // 4, dtype=torch.float32, device=device)
        buf, n = self._flush, max(1, self.reps // self.rounds)

        def wait(_):
            torch.cuda.synchronize(device)

        with torch.inference_mode():
            for i in range(self.warmup):
                _call(fn, cases[i % len(cases)])
            rounds = [after_flush(lambda i, r=r: _call(fn, cases[(r * n + i) % len(cases)]), buf.sum, n, wait)
                      for r in range(self.rounds)]
        if any(t is None for t in rounds):
            raise CuptiUnavailable("KernelSumTimer: CUPTI is not reachable here (it is read through JAX's CUDA "
                                   "build: pip install 'jax[cuda]')")
        per = sorted(rounds)
        return Timing(statistics.median(per), per[-1] - per[0], n * self.rounds, self.name, None, tuple(per))


def after_flush(call: Callable[[int], object], read: Callable[[], object], iterations: int,
                wait: Callable[[list], object]) -> float | None:
    """Device seconds per `call(i)`, each launched after `read()` (the flush): the `kernel_sum` of both less
    that of the reads alone; None where CUPTI is not reachable."""
    both = kernel_sum(lambda i: (read(), call(i)), iterations, wait)
    alone = kernel_sum(lambda i: read(), iterations, wait)
    return None if both is None or alone is None else max(0.0, both - alone)


def timer_for(device: str | torch.device, backend=None) -> Timer:
    """The real timer for a device and backend: on a GPU, CUDA graphs, or the kernel sum for a backend whose
    kernels are JAX programs (a torch graph cannot capture a JAX call); on CPU, the host timer."""
    if torch.device(device).type != "cuda":
        return CpuTimer()
    return KernelSumTimer() if getattr(backend, "library", "") == "jax" else CudaGraphTimer()
