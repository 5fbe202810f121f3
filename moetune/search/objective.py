"""The objective: build a candidate, check it against the float32 reference, then time it.

Correct before fast: every candidate is checked on fresh random inputs (new x and routing,
never zeros) at the bucket's token counts before it is timed. A candidate that computes a wrong or
non-finite answer, that the backend refuses, that runs out of a known resource, or whose build or check and
timing runs past its time limit (watchdog.py) scores `inf` and keeps its reason; it never stops the study.
Any other exception is a bug in a kernel: it is re-raised as CandidateError with a copy-pasteable repro,
unless `keep_going` (then it scores `inf` with the repro as its reason). `strict` re-raises every failure,
refusals, resource errors and timeouts included.
"""

from __future__ import annotations

import contextlib
import math
import textwrap
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..codegen.backend import Backend
from ..codegen.quant import activation_group, quantize_blocks, quantize_gate_up
from ..codegen.tensors import ExpertsFn, ExpertTensors
from ..codegen.torch.reference import experts_reference
from ..codegen.torch.tolerance import worst_error
from ..ir import MoEBlock, MoetuneError, Schedule, UnsupportedSchedule
from .timing import Case, Timer, Timing
from .watchdog import CandidateTimeout, call

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CandidateError(MoetuneError):
    """A candidate failed in a way the search does not know how to score; carries a repro."""

    def __init__(self, schedule: Schedule, stage: str, error: BaseException, repro: str):
        self.schedule, self.stage, self.error, self.repro = schedule, stage, error, repro
        super().__init__(f"candidate {schedule.describe()} failed to {stage}: "
                         f"{type(error).__name__}: {error}\nrepro:\n{textwrap.indent(repro, '    ')}")


# ------------------------------------------------------------------------------------------- inputs

RoutingSampler = Callable[[int, torch.Generator], torch.Tensor]  # (T, gen) → ids [T, k] int64 (CPU)


def uniform_sampler(block: MoEBlock) -> RoutingSampler:
    """k distinct experts per token, uniformly at random."""

    def sample(T: int, gen: torch.Generator) -> torch.Tensor:
        return torch.rand(T, block.E, generator=gen).argsort(dim=1)[:, : block.k]  # [T, k]

    return sample


def trace_sampler(block: MoEBlock, rows: torch.Tensor) -> RoutingSampler:
    """Tokens drawn at random from recorded routings `rows` [N, k] (real co-occurrence of experts)."""
    rows = torch.as_tensor(rows, dtype=torch.int64)
    if rows.ndim != 2 or rows.shape[1] != block.k or rows.numel() == 0:
        raise UnsupportedSchedule(f"routing trace rows {tuple(rows.shape)} do not fit top-{block.k} of "
                                  f"{block.name or block.signature_hash()}")
    if int(rows.max()) >= block.E:
        raise UnsupportedSchedule(f"routing trace names expert {int(rows.max())}, block has E = {block.E}")

    def sample(T: int, gen: torch.Generator) -> torch.Tensor:
        return rows[torch.randint(0, rows.shape[0], (T,), generator=gen)]  # [T, k]

    return sample


def routing_sampler(block: MoEBlock, trace) -> RoutingSampler | None:
    """The sampler of a routing trace (moetune.ir.trace.Trace): its tokens' rows over every layer and step;
    None for no trace (uniform routing, make_cases' own)."""
    if trace is None:
        return None
    import numpy as np

    return trace_sampler(block, torch.from_numpy(np.concatenate(trace.pools()).astype(np.int64)))


def expert_tensors(block: MoEBlock, device: str | torch.device = "cpu", seed: int = 0) -> ExpertTensors:
    """Random weights in the block's layout and format: N(0, 1/D) for gate/up, N(0, 1/F) for down;
    block-quantised formats hold those weights quantised per block (moetune.codegen.quant), as a
    checkpoint would.

    Each expert's weights are a different window of one pool of 2·n normal draws (n: one expert's
    size), so a large block is drawn in the time of two experts and never has an fp32 copy of itself;
    no two experts are equal, so a kernel reading the wrong expert still fails its check."""
    gen = torch.Generator(device=device).manual_seed(seed)
    fmt = block.weight_format
    dt = torch.float8_e4m3fn if fmt.quantized else TORCH_DTYPES[block.weight_dtype]
    lay = block.layout

    def randn(shape, std, quantize=None):
        n = math.prod(shape[1:])
        pool = torch.randn(2 * n, generator=gen, device=device) * std
        out = torch.empty(shape, dtype=dt if quantize else TORCH_DTYPES[fmt.compute_dtype], device=device)
        scales = []
        for e in range(shape[0]):  # [2F, D], [D, F], ... of one expert
            off = (e * n) // shape[0]
            m = pool[off:off + n].view(shape[1:])
            if quantize is None:
                out[e] = m
            else:
                out[e], s = quantize(m, fmt.block, fmt.scale_dtype)
                scales.append(s)
        return (out, torch.stack(scales)) if quantize else out

    gu_shape = lay.gate_up_shape(block.E, block.D, block.F)  # [E, 2F, D] or [E, D, 2F]
    dn_shape = lay.down_shape(block.E, block.D, block.F)  # [E, D, F] or [E, F, D]
    gub = randn((block.E, 2 * block.F), 0.1) if lay.has_bias else None  # [E, 2F]
    dnb = randn((block.E, block.D), 0.1) if lay.has_bias else None  # [E, D]
    if fmt.quantized:
        gu, gus = randn(gu_shape, block.D ** -0.5, quantize_gate_up)
        dn, dns = randn(dn_shape, block.F ** -0.5, quantize_blocks)
        return ExpertTensors(gu, dn, gub, dnb, gus, dns)
    gu = randn(gu_shape, block.D ** -0.5)
    dn = randn(dn_shape, block.F ** -0.5)
    return ExpertTensors(gu, dn, gub, dnb)


def make_cases(block: MoEBlock, w: ExpertTensors, tokens: int, n: int, gen: torch.Generator,
               sampler: RoutingSampler | None = None) -> list[Case]:
    """`n` cases of `tokens` tokens: x ~ N(0, 1), routing from `sampler`, softmax-like positive weights."""
    sampler = sampler or uniform_sampler(block)
    device = w.gate_up.device
    dt = TORCH_DTYPES[block.weight_format.compute_dtype]
    rw = TORCH_DTYPES[block.routing_weight_dtype]
    cases = []
    for _ in range(n):
        x = torch.randn(tokens, block.D, generator=gen).to(dtype=dt, device=device)  # [T, D]
        ids = sampler(tokens, gen).to(device)  # [T, k]
        wts = torch.softmax(torch.randn(tokens, block.k, generator=gen), dim=1)  # [T, k]
        wts = wts.to(dtype=rw, device=device)
        cases.append(Case(x, ids, wts, w))
    return cases


def reference(block: MoEBlock, case: Case, act_group: int | None = None) -> torch.Tensor:
    """The float32 reference of `case`, [T, D] (moetune.codegen.torch.experts_reference; `act_group`: of a
    w8a8 schedule, its activations rounded by the same rule)."""
    return experts_reference(block, case.x, case.ids, case.weights, case.w, act_group)


# ------------------------------------------------------------------------------------------ outcome


@dataclass(frozen=True)
class Outcome:
    """The score of one candidate: `time_s` is inf unless `status` is "ok"."""

    schedule: Schedule
    # ok | verified (checked, not timed: Objective.verify) | wrong | nonfinite | refused | resource | timeout |
    # build_failed | launch_failed
    status: str
    time_s: float = math.inf
    reason: str = ""
    rel_err: float | None = None  # the check's worst error in units of the dtype's tolerance (≤ 1 passes)
    build_s: float = 0.0
    timing: Timing | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Built:
    schedule: Schedule
    fn: ExpertsFn | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    trace: str = field(default="", repr=False)
    stage: str = "build"


def _known(e: BaseException) -> str | None:
    """The status of a failure the search knows how to score, or None for an unknown one."""
    if isinstance(e, UnsupportedSchedule):
        return "refused"
    if isinstance(e, CandidateTimeout):
        return "timeout"
    if isinstance(e, MemoryError | torch.OutOfMemoryError) or type(e).__name__ in ("OutOfResources",
                                                                                   "OutOfMemoryError"):
        return "resource"
    return None


def repro(block: MoEBlock, schedule: Schedule, tokens: int, device: str) -> str:
    """Python that rebuilds and runs the candidate on random inputs."""
    p = schedule.params
    imp = "" if p is None else f"from {type(p).__module__} import {type(p).__name__}\n"
    return (
        "import torch\n"
        "from moetune.ir import *\n"
        "from moetune.codegen.backend import get\n"
        "from moetune.search.objective import expert_tensors, make_cases\n"
        f"{imp}"
        f"block = {block!r}\n"
        f"schedule = {schedule!r}\n"
        f"w = expert_tensors(block, {device!r})\n"
        f"case = make_cases(block, w, {tokens}, 1, torch.Generator().manual_seed(0))[0]\n"
        f"fn = get({schedule.backend!r}).build(block, schedule)\n"
        "out = fn(case.x, case.ids, case.weights, case.w)\n"
    )


@contextlib.contextmanager
def _threads(n: int | None):
    """Run with `n` torch threads (None: as they are): the check on the timer's threads."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Objective:
    """Scores candidates of one bucket: build → check at `check_tokens` → time on `timing_cases` (the timer
    None: `verify` only; the timing cases then give the weights the checks run on). `timeout_s`: what one
    evaluation (with its build, when it is not built yet) may take (TuneOptions.candidate_timeout_s)."""

    def __init__(self, block: MoEBlock, backend: Backend, timer: Timer | None, timing_cases: Sequence[Case],
                 check_tokens: Sequence[int], *, sampler: RoutingSampler | None = None, seed: int = 0,
                 strict: bool = False, keep_going: bool = False, warm_in_build: bool | None = None,
                 timeout_s: float | None = None):
        self.block, self.backend, self.timer = block, backend, timer
        self.timeout_s = timeout_s
        self.timing_cases = list(timing_cases)
        self.w = self.timing_cases[0].w
        self.device = str(self.w.gate_up.device)
        self.check_tokens = tuple(sorted(set(check_tokens)))
        self.sampler = sampler
        self.strict, self.keep_going = strict, keep_going
        self.warm_in_build = (self.w.gate_up.device.type != "cpu") if warm_in_build is None else warm_in_build
        self._gen = torch.Generator().manual_seed(seed + 7919)
        self._pool: dict[int, list[tuple[Case, dict[int | None, torch.Tensor]]]] = {}  # T → (case, refs by group)
        self._turn = 0
        self._fns: dict[Schedule, ExpertsFn] = {}  # candidates that passed their check, reused by the final round
        self.timer_wall: list[float] = []  # wall time of every timer call

    # fresh inputs for every candidate; where the fp32 reference is costly (large blocks at large T),
    # a pool of POOL fresh cases per token count, each candidate checked on the next one in turn
    POOL = 4
    FRESH_REFERENCE_BYTES = 2 << 30

    def _check_case(self, T: int, act_group: int | None) -> tuple[Case, torch.Tensor]:
        b = self.block
        if T * b.k * 3 * b.D * b.F * 4 <= self.FRESH_REFERENCE_BYTES:
            case = make_cases(b, self.w, T, 1, self._gen, self.sampler)[0]
            return case, reference(b, case, act_group)
        pool = self._pool.get(T)
        if pool is None:
            pool = self._pool[T] = [(c, {}) for c in make_cases(b, self.w, T, self.POOL, self._gen, self.sampler)]
        self._turn += 1
        case, refs = pool[self._turn % len(pool)]
        if act_group not in refs:
            refs[act_group] = reference(b, case, act_group)
        return case, refs[act_group]

    # stage 1: build (thread-safe; run ahead of timing in a pool)
    def build(self, schedule: Schedule) -> Built:
        """Build the candidate; with `warm_in_build`, also launch it once on a timing case, so that a
        backend compiling at first launch (Triton) compiles here, in the build pool, not while timing."""
        t0 = time.perf_counter()
        stage = "build"
        try:
            fn = self.backend.build(self.block, schedule)
            if self.warm_in_build:
                stage = "launch at warm-up"
                c = self.timing_cases[0]
                with torch.inference_mode():
                    fn(c.x, c.ids, c.weights, c.w)
            return Built(schedule, fn, seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - classified in evaluate()
            return Built(schedule, None, e, time.perf_counter() - t0, traceback.format_exc(), stage)

    def _fail(self, schedule: Schedule, stage: str, e: BaseException, build_s: float) -> Outcome:
        status = _known(e)
        if self.strict or (status is None and not self.keep_going):
            raise CandidateError(schedule, stage, e, repro(self.block, schedule, self.check_tokens[0],
                                                           self.device)) from e
        if status is None:
            status = f"{stage.split()[0]}_failed"
            code = repro(self.block, schedule, self.check_tokens[0], self.device)
            why = f"{type(e).__name__}: {e}\nrepro:\n{code}"
        else:
            why = f"{type(e).__name__}: {e}"
        return Outcome(schedule, status, reason=why, build_s=build_s)

    # stage 2 and 3: check, then time
    def evaluate(self, schedule: Schedule, built: Built | None = None) -> Outcome:
        """Check and time the candidate (built first, when `built` is None), within `timeout_s`."""
        stages = "check and timing" if built else "build, check and timing"
        try:
            return call(self._evaluate, self.timeout_s, schedule, built,
                        what=f"candidate {schedule.describe()}: its {stages}")
        except CandidateTimeout as e:
            return self._fail(schedule, "check and time" if built else "build", e, built.seconds if built else 0.0)

    def _evaluate(self, schedule: Schedule, built: Built | None) -> Outcome:
        built = built or self.build(schedule)
        checked = self.verify(schedule, built)
        if checked.status != "verified":
            return checked
        try:
            timing = self.time_fn(built.fn, schedule)
        except Exception as e:  # noqa: BLE001
            return self._fail(schedule, "launch while timing", e, built.seconds)
        self._fns[schedule] = built.fn
        return Outcome(schedule, "ok", timing.median_s, rel_err=checked.rel_err, build_s=built.seconds,
                       timing=timing)

    def verify(self, schedule: Schedule, built: Built | None = None) -> Outcome:
        """Build and check the candidate without timing it: status "verified" (time inf, `rel_err` the worst
        error of the check), or the outcome of its failure, scored as `evaluate` scores it."""
        built = built or self.build(schedule)
        if built.error is not None:
            return self._fail(schedule, built.stage, built.error, built.seconds)
        with _threads(getattr(self.timer, "threads", None)):
            failed, worst = self._check(schedule, built)
        return failed or Outcome(schedule, "verified", rel_err=worst, build_s=built.seconds)

    def _check(self, schedule: Schedule, built: Built) -> tuple[Outcome | None, float]:
        """(the failed check's outcome or None, the worst error in units of the tolerance)."""
        fn = built.fn
        worst = 0.0
        group = activation_group(schedule.params)
        for T in self.check_tokens:
            case, ref = self._check_case(T, group)
            try:
                with torch.inference_mode():
                    out = fn(case.x, case.ids, case.weights, case.w)  # [T, D]
            except Exception as e:  # noqa: BLE001
                return self._fail(schedule, f"launch at T={T}", e, built.seconds), worst
            if tuple(out.shape) != (T, self.block.D):
                why = f"T={T}: output shape {tuple(out.shape)}, expected {(T, self.block.D)}"
                return Outcome(schedule, "wrong", reason=why, build_s=built.seconds), worst
            if not bool(torch.isfinite(out).all()):
                return Outcome(schedule, "nonfinite", reason=f"T={T}: output has NaN or inf",
                               build_s=built.seconds), worst
            err = worst_error(out, ref, tf32=self.device.startswith("cuda"), a8=group is not None)
            worst = max(worst, err)
            if not err <= 1:
                return Outcome(schedule, "wrong", reason=f"T={T}: worst error {err:.3g}× the {out.dtype} "
                                                         "tolerance of moetune.codegen.torch.tolerance",
                               rel_err=err, build_s=built.seconds), err
        return None, worst

    def fn_of(self, schedule: Schedule) -> ExpertsFn:
        """The built kernel of a candidate that passed its check here (built again if it was not kept)."""
        fn = self._fns.get(schedule)
        if fn is None:
            fn = self._fns[schedule] = self.backend.build(self.block, schedule)
        return fn

    def time_fn(self, fn: ExpertsFn, schedule: Schedule | None = None, cases: Sequence[Case] | None = None) -> Timing:
        """Time `fn` on the timing cases (or `cases`); the wall time of the call is kept in `timer_wall`."""
        t0 = time.perf_counter()
        try:
            return self.timer(fn, self.timing_cases if cases is None else cases, schedule)
        finally:
            self.timer_wall.append(time.perf_counter() - t0)
