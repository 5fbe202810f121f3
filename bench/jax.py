"""jax: moetune's Pallas GPU kernels for JAX against jax.lax.ragged_dot and moetune's PyTorch path, per cell.

A cell is one preset (`moetune.ir.presets`, bf16) at one token count T; what is timed is the whole routed-expert
block, (x [T, D], ids [T, k], weights [T, k]) → out [T, D], every sort, activation, weighting and combine step
included. Per cell, on the tuner's own inputs (`moetune.search.objective.expert_tensors`, `make_cases`: 8
uniform routings), shared by JAX and torch through DLPack (no copy):

  * moetune (JAX), two routes, each `moetune_fn(block, T, backend=…)`, moetune.jax.experts jitted:
    `moetune-jax` the pallas_gpu backend (Pallas kernels through Pallas' Triton lowering, `build_jax`) running the
    table's (`--table`) pallas_gpu entry for T, else its runtime default; `moetune-jax:triton-xla` moetune's
    Triton kernels at an XLA FFI call (moetune.jax.xla_call) running the table's triton schedule for T, as the
    PyTorch path does; with `--kinds` also each pallas_gpu schedule kind's default
    (`backend.default(block, kind, T)`) where it is another schedule;
  * ragged_dot (JAX): `ragged_fn(block)`, the experts written the usual way with `jax.lax.ragged_dot`: sort the
    pairs by expert, group sizes by bincount, gate/up ragged_dot, silu(gate)·up, down ragged_dot, unsort,
    weighted sum over the k experts. It reads the weights in the [E, D, 2F] / [E, F, D] layout ragged_dot
    takes: transposed once when the cell's tensors are made, outside the timing;
  * moetune (PyTorch): moetune's Triton kernels through the triton backend's schedule for T, from the dispatch
    table (`--table`) where it has one, else the runtime default (as `python -m bench kernels` builds them).

Each is checked against the float32 reference (`moetune.search.objective.reference`, the package's bound
`worst_error` ≤ 1) before it is timed; a failing or crashing one is recorded with its error and the sweep
goes on. JAX functions are timed by `moetune.search.timing.JaxTimer`: `time_us` host-timed to
block_until_ready (a 256 MB read before every rep, ≥ 50 reps: JAX dispatch and the wait included) and
`pipelined_us`, the per-call cost of calls issued back to back (`JaxTimer.pipelined`), and `stepped_us`, the
same with at most STEPPED_DEPTH calls in flight (a decode loop that reads an earlier step's result before it
issues the next). The suite runs with
XLA_FLAGS `RECORD_FLAGS` (each unless XLA_FLAGS sets it), so that XLA records even these one-call programs into CUDA
graphs as it records a model's: a recorded triton-xla call replays without entering Python while its buffers'
addresses repeat (`time_us`: one call at a time; `stepped_us`: a few buffers in turn), and is recorded again,
through Python, for each call whose addresses are new (`pipelined_us`: every call's output is another live
buffer). `recorded_per_call` gives, for each of the three, the recordings per call that were made
(`moetune.jax.xla_call.recordings`; only where there were any). The
PyTorch path is timed by the package's CudaGraphTimer: `time_us` graph replays (device time), `host_us` its
host-launched median (launch and wait included). `compile_s` is the first call's wall time (trace, lowering
and compile). Per record: time, the floor (`moetune.targets.floor`, h200, with the distinct experts of
the timed routings), % of floor and, for the moetune JAX rows, like-for-like ratios: `vs_ragged_dot`
(host-timed both), `vs_torch_host` (PyTorch host-launched / JAX host-timed) and `vs_torch_graph` (PyTorch graph
replay / JAX pipelined). Where JAX's CUDA build reaches CUPTI, `device_us` is every row's kernels' own device time
per call (`JaxTimer.device_time`, `KernelSumTimer`: kernel durations summed, no gaps) and
`vs_torch_device` the PyTorch path's over the JAX row's.

    python -m bench jax --out DIR [--shapes a,b] [--tokens 1,8,64,256] [--kinds] [--reps 100] [--budget-s 240]

Writes DIR/<device>-jax.json (a list of records); prints a table last.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = ("qwen3-30b-a3b", "qwen3.5-397b-a17b")
TOKENS = (1, 8, 64, 256)
N_ROUT = 8
SLOW_CALL_S = 0.02
PIPE_ROUNDS = 3  # rounds of JaxTimer.pipelined, the median taken
STEPPED_DEPTH = 2  # calls in flight in `stepped_us` (a decode loop reading step i - 2's result to issue step i)
BACKEND = "pallas_gpu"
# XLA records a program's runs of kernels into CUDA graphs only from a few in a row; a model's programs have
# many, the bench's one-call programs not: the first flag makes XLA record them too, as in a model. XLA keeps
# a few recordings of a traced call (an LRU keyed by its buffers' addresses); the cells' routings in turn,
# times the output buffers of the calls in flight, outnumber its default 16: the second keeps them all
RECORD_FLAGS = ("--xla_gpu_graph_min_graph_size=1", "--xla_cmd_buffer_trace_cache_size=64")


# ------------------------------------------------------------------------------------------ the functions


def moetune_schedule(block, T: int, table: str | None = None):
    """(the schedule moetune.jax.experts runs at T on the pallas_gpu backend with `table`, its source)."""
    import moetune.jax as mj

    r = mj.route(block, T, table=table, backend=BACKEND)
    return r.schedule, r.source


def moetune_fn(block, T: int, schedule=None, backend: str = BACKEND, table: str | None = None):
    """The jitted JAX function moetune runs for `block` at T tokens: fn(x, ids, weights, w: JaxExperts). With no
    `schedule`, what a JAX user calls: moetune.jax.experts on `backend` (with `table`, else its default schedule
    at T); with one, that pallas_gpu schedule's kernel itself (`build_jax`)."""
    import jax

    from moetune.codegen.backend import get

    if schedule is None:
        import moetune.jax as mj

        def user(x, ids, weights, w):
            return mj.experts(x, ids, weights, w.gate_up, w.down, block=block, backend=backend, table=table,
                              gate_up_scale=w.gate_up_scale, down_scale=w.down_scale)

        return jax.jit(user)
    return jax.jit(get(BACKEND).kind(schedule.kind, block).build_jax(block, schedule))


def xla_schedule(block, T: int, table: str) -> str:
    """What moetune.jax.experts runs at T on the triton backend with `table`: the schedule and its source."""
    import moetune.jax as mj

    r = mj.route(block, T, table=table, backend="triton")
    return f"{r.source}: {r.schedule.describe() if r.schedule is not None else mj.REFERENCE}"


def ragged_weights(w):
    """(gate_up [E, D, 2F], down [E, F, D]) of standard-layout JaxExperts: the layout ragged_dot reads."""
    import jax.numpy as jnp

    return jnp.swapaxes(w.gate_up, 1, 2), jnp.swapaxes(w.down, 1, 2)


def ragged_fn(block):
    """The jitted experts of the module doc written with jax.lax.ragged_dot: fn(x, ids, weights, gate_up, down)
    with the weights of `ragged_weights`. Ids outside [0, E) get routing weight 0."""
    import jax
    import jax.numpy as jnp

    E, k, F = block.E, block.k, block.F

    def fn(x, ids, weights, gate_up, down):
        T = x.shape[0]
        flat = ids.reshape(-1)  # [P]
        valid = (flat >= 0) & (flat < E)
        e = jnp.where(valid, flat, E - 1)
        order = jnp.argsort(e)  # [P]
        sizes = jnp.bincount(e, length=E).astype(jnp.int32)  # [E]
        xs = x[order // k]  # [P, D] in expert order
        gu = jax.lax.ragged_dot(xs, gate_up, sizes)  # [P, 2F]
        h = (jax.nn.silu(gu[:, :F]) * gu[:, F:]).astype(x.dtype)
        y = jax.lax.ragged_dot(h, down, sizes)  # [P, D]
        y = jnp.zeros_like(y).at[order].set(y)  # pair order
        wt = jnp.where(valid, weights.reshape(-1).astype(jnp.float32), 0.0)
        return (y.astype(jnp.float32) * wt[:, None]).reshape(T, k, -1).sum(axis=1).astype(x.dtype)

    return jax.jit(fn)


def torch_schedule(block, T: int, table: str):
    from moetune.codegen.triton import BACKEND as TRITON
    from moetune.runtime.default import default_at

    from .cells import TARGET
    from .kernels import table_choice

    chosen = table_choice(table, block, T)
    return (chosen[0][1], "table") if chosen else (default_at(block, TRITON, TARGET, T), "default")


# ------------------------------------------------------------------------------------------ records


def record(shape: str, block, T: int, impl: str, floor_us: float, **fields) -> dict:
    """One JSON record: the cell, the implementation and what was measured (time_us, or error)."""
    rec = dict(shape=shape, E=block.E, k=block.k, D=block.D, F=block.F, tokens=T, impl=impl,
               floor_us=round(floor_us, 2))
    rec.update(fields)
    if rec.get("time_us"):
        rec["pct_floor"] = round(100.0 * floor_us / rec["time_us"], 1)
    return rec


def add_ratios(records: list[dict]) -> None:
    """On each timed moetune JAX record the like-for-like ratios of the module doc, same cell."""
    cells: dict[tuple, dict] = {}
    for r in records:
        cells.setdefault((r["shape"], r["tokens"]), {})[r["impl"]] = r
    for r in records:
        if not r["impl"].startswith("moetune-jax") or not r.get("time_us"):
            continue
        same = cells[(r["shape"], r["tokens"])]
        rag, pt = same.get("ragged_dot", {}), same.get("moetune-torch", {})
        if rag.get("time_us"):
            r["vs_ragged_dot"] = round(rag["time_us"] / r["time_us"], 3)
        if pt.get("time_us") and r.get("pipelined_us"):
            r["vs_torch_graph"] = round(pt["time_us"] / r["pipelined_us"], 3)
        if pt.get("host_us"):
            r["vs_torch_host"] = round(pt["host_us"] / r["time_us"], 3)
        if pt.get("device_us") and r.get("device_us"):
            r["vs_torch_device"] = round(pt["device_us"] / r["device_us"], 3)


def table(records: list[dict]) -> str:
    """The short text table: one line per record."""
    head = (f"{'shape':18s} {'T':>4s} {'impl':24s} {'time µs':>9s} {'pipe µs':>8s} {'step µs':>8s} {'dev µs':>8s} "
            f"{'floor':>7s} {'%floor':>6s} {'/ragged':>7s} {'/t-host':>7s} {'/t-graph':>8s} {'/t-dev':>6s} "
            f"{'compile s':>9s}  schedule / error")
    lines = [head, "-" * len(head)]

    def num(v, f):
        return format(v, f) if isinstance(v, (int, float)) else "-"

    for r in records:
        tail = r.get("error") or r.get("schedule") or ""
        lines.append(f"{r['shape']:18s} {r['tokens']:4d} {r['impl']:24s} {num(r.get('time_us'), '9.1f')} "
                     f"{num(r.get('pipelined_us'), '8.1f')} {num(r.get('stepped_us'), '8.1f')} "
                     f"{num(r.get('device_us'), '8.1f')} "
                     f"{num(r['floor_us'], '7.1f')} {num(r.get('pct_floor'), '6.1f')} "
                     f"{num(r.get('vs_ragged_dot'), '7.2f')} {num(r.get('vs_torch_host'), '7.2f')} "
                     f"{num(r.get('vs_torch_graph'), '8.2f')} {num(r.get('vs_torch_device'), '6.2f')} "
                     f"{num(r.get('compile_s'), '9.2f')}  {tail[:100]}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ measuring


def parse_tokens(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in s.split(","))
    except ValueError:
        out = ()
    if not out or any(t < 1 for t in out):
        raise ValueError(f"--tokens {s!r}: comma-separated integers ≥ 1")
    return out


def parse_shapes(s: str) -> tuple[str, ...]:
    from moetune.ir.presets import PRESETS

    out = tuple(n for n in s.split(",") if n)
    bad = [n for n in out if n not in PRESETS]
    if not out or bad:
        raise ValueError(f"--shapes {s!r}: unknown {', '.join(bad) or '(none given)'}; presets: {', '.join(PRESETS)}")
    return out


def _check_jax(fn, args, ref, first_call: float) -> tuple[dict, bool]:
    import torch

    from moetune.codegen.torch.tolerance import worst_error

    out = fn(*args)
    out.block_until_ready()
    compile_s = time.perf_counter() - first_call
    err = worst_error(torch.from_dlpack(out), ref)
    fields = dict(compile_s=round(compile_s, 3), worst_err=err)
    if not err <= 1:
        fields["error"] = f"worst_error {err:.3g} > 1: not timed"
    return fields, err <= 1


def time_jax(fn, cases: list[tuple], ref, timer) -> dict:
    """Check `fn` on the first case, then time it; a call slower than SLOW_CALL_S gets the timer's minimum of
    50 reps and one warm-up (the suite stays within its few minutes)."""
    import jax

    from moetune.jax.xla_call import recordings
    from moetune.search.timing import JaxTimer

    t0 = time.perf_counter()
    fields, ok = _check_jax(fn, cases[0], ref, t0)
    if ok:
        t1 = time.perf_counter()
        jax.block_until_ready(fn(*cases[-1]))
        if time.perf_counter() - t1 > SLOW_CALL_S:
            timer = JaxTimer(reps=50, warmup=1)
        streamed = 1 + PIPE_ROUNDS * timer.reps  # a warm call, then each round's stream of calls
        calls = {"host": (lambda: timer(fn, cases), timer.warmup + timer.reps),
                 "pipelined": (lambda: timer.pipelined(fn, cases, rounds=PIPE_ROUNDS), streamed),
                 "stepped": (lambda: timer.pipelined(fn, cases, rounds=PIPE_ROUNDS, depth=STEPPED_DEPTH), streamed)}
        got, per_call = {}, {}
        for how, (run, n_calls) in calls.items():
            n0 = recordings()
            got[how] = run()
            per_call[how] = round((recordings() - n0) / n_calls, 3)
        t = got["host"]
        fields.update(time_us=t.median_s * 1e6, median_us=statistics.median(t.times_s) * 1e6,
                      spread_us=t.spread_s * 1e6, reps=t.reps, method=t.method,
                      pipelined_us=got["pipelined"] * 1e6, stepped_us=got["stepped"] * 1e6)
        if any(per_call.values()):
            fields["recorded_per_call"] = per_call
        dev = timer.device_time(fn, cases)
        if dev is not None:
            fields["device_us"] = dev * 1e6
    return fields


def time_torch(block, T: int, w, cases, ref, timer, table_path: str) -> dict:
    import torch

    from moetune.codegen.torch.tolerance import worst_error
    from moetune.codegen.triton import BACKEND as TRITON
    from moetune.search.timing import KernelSumTimer, cupti_reachable

    sched, source = torch_schedule(block, T, table_path)
    fields = dict(schedule=f"{source}: {sched.describe()}")
    fn = TRITON.build(block, sched)
    c = cases[0]
    t0 = time.perf_counter()
    out = fn(c.x, c.ids, c.weights, c.w)
    torch.cuda.synchronize()
    fields["compile_s"] = round(time.perf_counter() - t0, 3)
    fields["worst_err"] = err = worst_error(out, ref)
    if not err <= 1:
        fields["error"] = f"worst_error {err:.3g} > 1: not timed"
        return fields
    t = timer(fn, cases)
    fields.update(time_us=t.median_s * 1e6, host_us=t.host_median_s * 1e6, spread_us=t.spread_s * 1e6,
                  reps=t.reps, method=t.method)
    if cupti_reachable():
        fields["device_us"] = KernelSumTimer(reps=timer.reps)(fn, cases).median_s * 1e6
    return fields


def cell(shape: str, T: int, w, rw, args, timers) -> list[dict]:
    import torch

    from moetune.codegen.backend import get
    from moetune.codegen.pallas_tpu._common import jax_experts, to_jax
    from moetune.search.objective import make_cases, reference

    from .cells import bench_block
    from .kernels import floor_us

    block = bench_block(shape)
    cases = make_cases(block, w, T, N_ROUT, torch.Generator().manual_seed(2000 + T))
    fl = floor_us(block, T, statistics.mean(len(torch.unique(c.ids)) for c in cases))
    ref = reference(block, cases[0])
    wj = jax_experts(w)
    jcases = [(to_jax(c.x), to_jax(c.ids.to(torch.int32)), to_jax(c.weights)) for c in cases]
    records = []

    def attempt(impl: str, measure, **fields) -> None:
        try:
            fields.update(measure())
        except Exception as exc:  # noqa: BLE001 - a failing cell is recorded, never stops the sweep
            fields["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        records.append(record(shape, block, T, impl, fl, **fields))

    main, source = moetune_schedule(block, T, args.table)
    scheds = [("moetune-jax", main)]
    via = xla_schedule(block, T, args.table)
    attempt("moetune-jax:triton-xla", lambda: time_jax(moetune_fn(block, T, backend="triton", table=args.table),
                                                       [(*c, wj) for c in jcases], ref, timers["jax"]),
            schedule=via)
    if args.kinds:
        be = get(BACKEND)
        for kind, why in be.kinds(block).items():
            s = be.default(block, kind, T) if why is None else None
            if s is not None and s != main:
                scheds.append((f"moetune-jax:{kind}", s))
    for impl, s in scheds:  # the main row through moetune.jax.experts (which runs `main`), the others as kernels
        fn = (lambda: moetune_fn(block, T, table=args.table)) if s is main else (lambda s=s: moetune_fn(block, T, s))
        attempt(impl, lambda fn=fn: time_jax(fn(), [(*c, wj) for c in jcases], ref, timers["jax"]),
                schedule=f"{source}: {s.describe()}" if s is main else s.describe())
    attempt("ragged_dot", lambda: time_jax(ragged_fn(block), [(*c, *rw) for c in jcases], ref, timers["jax"]))
    attempt("moetune-torch", lambda: time_torch(block, T, w, cases, ref, timers["torch"], args.table))
    add_ratios(records)
    return records


def gpu_missing() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device for torch"
    import jax

    try:
        jax.devices("gpu")
    except RuntimeError as e:
        return f"JAX sees no GPU ({str(e).splitlines()[0]})"
    return None


def run(args) -> int:
    try:
        shapes, tokens = parse_shapes(args.shapes), parse_tokens(args.tokens)
        if args.reps < 50:
            raise ValueError(f"--reps {args.reps}: at least 50")
    except ValueError as e:
        print(f"python -m bench jax: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch holds the weights; JAX shares them
    for flag in RECORD_FLAGS:
        if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    why = gpu_missing()
    if why:
        print(f"python -m bench jax: {why} (the suite times GPU kernels)", file=sys.stderr)
        return 2
    import jax
    import torch

    from moetune.codegen.pallas_tpu._common import jax_experts
    from moetune.search.objective import expert_tensors
    from moetune.search.timing import CudaGraphTimer, JaxTimer

    from .cells import bench_block, device_stem

    t_start = time.time()
    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{device_stem()}-jax.json"
    print(f"device {torch.cuda.get_device_name()} jax {jax.__version__} torch {torch.__version__} "
          f"XLA_FLAGS={os.environ['XLA_FLAGS']}", flush=True)
    timers = dict(jax=JaxTimer(reps=args.reps), torch=CudaGraphTimer(reps=args.reps))
    records: list[dict] = []
    for shape in shapes:
        if time.time() - t_start > args.budget_s:
            print(f"budget reached: stopping before {shape}", flush=True)
            break
        w = expert_tensors(bench_block(shape), dev)
        rw = jax.block_until_ready(ragged_weights(jax_experts(w)))
        for T in tokens:
            if time.time() - t_start > args.budget_s:
                print(f"budget reached: stopping before {shape} T={T}", flush=True)
                break
            recs = cell(shape, T, w, rw, args, timers)
            records += recs
            for r in recs:
                print(f"{shape:18s} T={T:4d} {r['impl']:22s} "
                      + (f"{r['time_us']:9.1f} µs ({r['pct_floor']:.0f}% of floor)" if r.get("time_us")
                         else r.get("error", "")) + f"  [{time.time() - t_start:.0f}s]", flush=True)
            path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), jax=jax.__version__,
                                            xla_flags=os.environ["XLA_FLAGS"], records=records), indent=1))
        del w, rw
        torch.cuda.empty_cache()
    print(table(records))
    return 0


def add_arguments(ap) -> None:
    from .kernels import ROOT

    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"), help="folder for the JSON")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="presets, comma-separated")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, comma-separated")
    ap.add_argument("--kinds", action="store_true",
                    help="also time each schedule kind's pallas_gpu default where it differs from the runtime's")
    ap.add_argument("--reps", type=int, default=100, help="timed reps per function (≥ 50)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="no new cell starts after this many seconds")
    ap.add_argument("--table", default=str(ROOT / "cache"),
                    help="dispatch table the PyTorch path's schedule comes from (else the runtime default)")
