"""kernels: moetune's Triton experts kernels against transformers' experts functions and the floor, per cell.

A cell is one preset (`moetune.ir.presets`) at one token count T. What is timed is the whole expert block,
(x [T, D], ids [T, k], weights [T, k]) → out [T, D], every sort, permute, activation, weighting and combine
step included; the router is not. Per cell:

  * inputs: the tuner's own (`moetune.search.objective.expert_tensors`, `make_cases`): 32 routings (and x)
    drawn uniformly, bf16 weights N(0, 1/D) / N(0, 1/F), bf16 routing weights;
  * candidates from the package, none written here: `table` (what the dispatch table `--table` routes T to
    for the preset, i.e. what a compiled model runs), `default` (the runtime's default schedule at T,
    `moetune.runtime.default`), `kind-default` (each schedule kind's backend default at T,
    `backend.default(block, kind, T)`), and with `--space-samples N` N points drawn with a fixed seed from
    the tuner's search space of T's bucket (`moetune.search.space.build_space`); the same schedule twice
    is timed once, under its first name;
  * baselines: transformers' `grouped_mm_experts_forward` and `batched_mm_experts_forward` on a stand-in
    module, and its eager experts loop re-implemented op for op (it synchronises with the host, so it is
    timed host-launched); with FP8 weights transformers' own FP8Experts module run with each of those experts
    implementations, whose kernel (finegrained-fp8) transformers fetches from the Hugging Face hub, or takes from
    a local copy of its source with `--hf-fp8-kernel DIR`. A baseline is timed whatever its error (the record
    carries it), host-launched where a CUDA graph cannot hold it;
  * each candidate is checked against the float32 reference (`moetune.search.objective.reference`) twice:
    its eager output and the output its CUDA-graph replays wrote, by the package's bound
    (`moetune.codegen.torch.tolerance.worst_error` ≤ 1); then timed by the package's timer
    (`moetune.search.timing.CudaGraphTimer`: one graph per routing, a 256 MB read before every replay);
    `time_us` is the median of all replays, `routing_mean_us` the tuner's summary of the same replays;
  * floor: `moetune.targets.floor` on the h200 target with the distinct experts averaged over the
    32 routings; ceilings (streaming read, device copy, bf16 matmul) are measured first.

    python -m bench kernels --out DIR [--shapes a,b] [--tokens 1,2,...] [--budget-s 393] [--space-samples N]
    python -m bench kernels --weights fp8 --hf-fp8-kernel .hf/finegrained-fp8/torch-ext [...]  # FP8 baselines
    python -m bench kernels --render bench/results/nvidia-h200-kernels.json    # the .md from the JSON (CPU)

Writes DIR/<device>-kernels.json (ceilings and a list of records) and DIR/<device>-kernels.md.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.baselines import eager_fn, fp8_kernel_package, hf_fn, hf_fp8_fn, use_fp8_kernel_source
from bench.cells import N_ROUT, ROOT, SHAPES, TARGET, TOKENS, WEIGHTS, bench_block, best_open, device_stem
from bench.kernels_report import render, table
from moetune.ir import MoEBlock, RoutingStats, Schedule, UnsupportedSchedule
from moetune.ir.presets import preset
from moetune.passes.roofline import floor
from moetune.search.timing import Case, CudaGraphTimer

# ------------------------------------------------------------------------------------------ candidates


def table_choice(path: str, block: MoEBlock, T: int, versions=None) -> list[tuple[str, Schedule]]:
    """[("table", schedule)]: what the dispatch table at `path` routes T to for the preset of the bench block
    `block`, in the block's weight format — what a compiled model of that preset runs (none when the file,
    the entry or a current one is missing; stale or foreign entries are said in one warning, as at run
    time). `versions`: what the entries are judged against (default: this machine's GPU)."""
    if not path or block.name not in SHAPES:
        return []
    from moetune.runtime.table import CacheError, load_entries

    model = preset(block.name)
    if block.weight_format.quantized:
        model = model.with_weight_format(block.weight_format)
    try:
        usable = load_entries(path, model, TARGET, "triton", versions=versions, device="cuda")
    except CacheError as e:  # an unreadable table costs the `table` candidate, never the sweep
        print(f"candidate `table` left out: {e}", flush=True)
        return []
    return [("table", s) for lo, hi, s in usable if lo <= T <= hi]


def space_samples(block: MoEBlock, backend, T: int, n: int, seed: int = 0,
                  kinds: tuple[str, ...] = ()) -> list[tuple[str, Schedule]]:
    """`n` points of the tuner's search space of T's bucket (of its `kinds` alone, when given), drawn by Optuna's
    random sampler with `seed` (points the parameter classes refuse are drawn again, up to 20·n draws)."""
    if n <= 0:
        return []
    import dataclasses

    import optuna

    from moetune.runtime.default import default_plan
    from moetune.search.space import build_space

    space = build_space(block, backend, default_plan(block, backend, TARGET).bucket_for(T))
    if kinds:
        kept = tuple(ks for ks in space.kinds if ks.kind in kinds)
        if not kept:
            return []
        space = dataclasses.replace(space, kinds=kept)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out: list[tuple[str, Schedule]] = []
    for _ in range(20 * n):
        trial = study.ask()
        try:
            s = space.suggest(trial)
        except UnsupportedSchedule:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        study.tell(trial, 0.0)
        out.append((f"space-{len(out)}", s))
        if len(out) == n:
            break
    return out


def parse_with(items: list[str]) -> list[tuple[tuple[str, object], ...]]:
    """`--with KNOB=VALUE[,KNOB=VALUE...]` arguments, each a set of knobs (knob, value) set together: true/false as
    bools, digits as ints, else the text."""
    out = []
    for item in items:
        group = []
        for part in item.split(","):
            knob, eq, text = part.partition("=")
            if not eq or not knob.isidentifier():
                raise ValueError(f"--with {item!r}: KNOB=VALUE[,KNOB=VALUE...], e.g. pdl=true")
            low = text.lower()
            group.append((knob, True if low == "true" else False if low == "false" else int(text) if text.isdigit()
                          else text))
        out.append(tuple(group))
    return out


def with_knobs(block: MoEBlock, named: list[tuple[str, Schedule]],
               knobs: list[tuple[tuple[str, object], ...]]) -> list[tuple[str, Schedule]]:
    """Each candidate whose parameters have every knob of a set in `knobs` and differ in one, again with the set's
    knobs set (tag `TAG+knob=value[,knob=value...]`), where its kind's space admits the result: one change
    A/B-timed against the same schedule."""
    import dataclasses

    from moetune.codegen.triton import BACKEND

    out = []
    for group in knobs:
        text = ",".join(f"{k}={v}" for k, v in group)
        for tag, s in named:
            p = s.params
            if (p is None or not all(hasattr(p, k) for k, _ in group)
                    or all(getattr(p, k) == v for k, v in group)):
                continue
            try:
                q = BACKEND.space(block, s.kind).admit(dataclasses.replace(p, **dict(group)))
            except UnsupportedSchedule as e:
                print(f"{block.name}: {tag} with {text} left out: {e}", flush=True)
                continue
            out.append((f"{tag}+{text}", dataclasses.replace(s, params=q)))
    return out


def candidates(block: MoEBlock, T: int, *, table: str = "", samples: int = 0, seed: int = 0,
               versions=None, knobs: list[tuple[str, object]] = (),
               sample_kinds: tuple[str, ...] = ()) -> list[tuple[str, Schedule]]:
    """The cell's moetune candidates, each (tag, schedule), all from the package (module doc), and with `knobs`
    each of them again with a knob set (`with_knobs`); a schedule met twice keeps its first tag."""
    from moetune.codegen.triton import BACKEND
    from moetune.runtime.default import default_at
    from moetune.search.space import key

    named = table_choice(table, block, T, versions)
    named.append(("default", default_at(block, BACKEND, TARGET, T)))
    for kind, why in BACKEND.kinds(block).items():
        if why is None:
            try:
                named.append(("kind-default", BACKEND.default(block, kind, T)))
            except UnsupportedSchedule as e:
                print(f"{block.name} T={T}: no {kind} default: {e}", flush=True)
    named += space_samples(block, BACKEND, T, samples, seed, sample_kinds)
    named += with_knobs(block, named, list(knobs))
    out, seen = [], set()
    for tag, s in named:
        if key(s) not in seen:
            seen.add(key(s))
            out.append((tag, s))
    return out


def in_space(block: MoEBlock, schedule: Schedule) -> str | None:
    """None when `schedule`'s parameters are a point of its kind's tuner space (`backend.space(block, kind)`,
    every value among the choices and admitted by the target's check); else why not."""
    from moetune.codegen.triton import BACKEND

    space = BACKEND.space(block, schedule.kind)
    for name, values in space.choices:
        v = getattr(schedule.params, name)
        if v not in values:
            return f"{schedule.describe()}: {name} = {v!r} not in {values}"
    try:
        space.admit(schedule.params)
    except UnsupportedSchedule as e:
        return f"{schedule.describe()}: refused by the target: {e}"
    return None


# ------------------------------------------------------------------------------------------ ceilings


try:  # the read ceiling's kernel (a measurement, not a moetune kernel); without Triton only --render works
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernels suite needs Triton on the GPU
    triton = None
else:
    @triton.jit
    def read_kernel(src, dst, n, BLOCK: tl.constexpr):
        """Streaming read of src [n] by a fixed grid: the HBM read ceiling."""
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(dst + pid, tl.sum(acc, axis=0))


def ceilings(dev: torch.device) -> dict:
    """The device's measured roofs: a Triton streaming read and a device copy of 4 GiB, an 8192³ bf16 matmul
    (plain CUDA-event loops of 10: a ceiling is a rate over bytes far larger than the L2)."""
    n = 2 * 1024**3  # 4 GiB of bf16
    a = torch.randn(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty(132 * 8, dtype=torch.float32, device=dev)
    res = {}

    def t_ms(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / reps

    ms = t_ms(lambda: read_kernel[(132 * 8,)](a, dst, n, BLOCK=4096, num_warps=8))
    res["hbm_read_TBps"] = 2 * n / ms / 1e9
    b = torch.empty(n // 2, dtype=torch.bfloat16, device=dev)
    ms = t_ms(lambda: b.copy_(a[: n // 2]))
    res["d2d_copy_rw_TBps"] = 2 * n / ms / 1e9
    a = b = None
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    ms = t_ms(lambda: m @ m)
    res["bf16_matmul_TFLOPs"] = 2 * 8192**3 / ms / 1e9
    m = None
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------------ measuring


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def extra_memory(fn, c: Case) -> int:
    """Peak device memory one eager call allocates beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(c.x, c.ids, c.weights, c.w)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def floor_us(block: MoEBlock, T: int, distinct: float) -> float:
    """The package's roofline floor on the h200 target with the distinct experts of the timed routings."""
    rows = T * block.k / distinct
    stats = RoutingStats(tokens=T, distinct_experts=distinct, rows_per_active=rows, max_rows=rows,
                         source="the timed routings")
    return floor(block, TARGET, T, stats).time_s * 1e6


def measure(rec: dict, fn, cases: list[Case], ref: torch.Tensor, timer: CudaGraphTimer, host_only: bool,
            a8: bool = False, baseline: bool = False, check_ref: torch.Tensor | None = None) -> None:
    """Check `fn` against `check_ref` (eager, then its graph replays; `a8`: a w8a8 result against the reference
    on its rounded activations, with their bound; None: `ref`), time it, and fill `rec` (`rel_err` against
    `ref`, the float32 reference, so that every implementation's is comparable). A moetune candidate outside
    the bound is not timed; a `baseline` is timed whatever its error (the record carries it, `over_bound` set),
    and one that a CUDA graph cannot hold is timed host-launched (`graph_error` says why)."""
    from functools import partial

    from moetune.codegen.torch.tolerance import worst_error

    worst_error = partial(worst_error, a8=a8)
    c0 = cases[0]
    out = fn(c0.x, c0.ids, c0.weights, c0.w)
    torch.cuda.synchronize()
    check_ref = ref if check_ref is None else check_ref
    rec["rel_err"], rec["worst_err"] = rel_err(out, ref), worst_error(out, check_ref)
    del out
    rec["extra_mem_bytes"] = extra_memory(fn, c0)
    if not rec["worst_err"] <= 1:
        if not baseline:
            rec["error"] = f"worst_error {rec['worst_err']:.3g} > 1 (rel_err {rec['rel_err']:.3g}): not timed"
            return
        rec["over_bound"] = True
    if host_only:
        rec["time_us"], rec["mode"] = timer.host_launched(fn, cases) * 1e6, "host"
        return
    captured: list[torch.Tensor] = []  # graph 0's output buffer: what its replays wrote

    def kept(x, ids, wt, w):
        y = fn(x, ids, wt, w)
        if torch.cuda.is_current_stream_capturing() and not captured:
            captured.append(y)
        return y

    try:
        t = timer(kept, cases)
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot be captured is timed as it runs
        if not baseline:
            raise
        torch.cuda.synchronize()
        rec["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rec["time_us"], rec["mode"] = timer.host_launched(fn, cases) * 1e6, "host"
        return
    rec["graph_rel_err"], graph_worst = rel_err(captured[0], ref), worst_error(captured[0], check_ref)
    captured.clear()
    if not graph_worst <= 1 and not baseline:
        rec["error"] = f"graph replay worst_error {graph_worst:.3g} > 1: not counted"
        return
    rec.update(time_us=statistics.median(t.times_s) * 1e6, routing_mean_us=t.median_s * 1e6, mode="graph",
               host_us=t.host_median_s * 1e6, spread_us=t.spread_s * 1e6)


def routing_sampler(block: MoEBlock, spec: str):
    """The tuner's sampler of the routing `spec` (moetune.ir.trace.routing_trace): None for uniform."""
    from moetune.ir.trace import routing_trace
    from moetune.search.objective import routing_sampler as of_trace

    return of_trace(block, routing_trace(spec, block.E, block.k))


def cell(shape: str, T: int, w, args, timer: CudaGraphTimer, name: str) -> list[dict]:
    from moetune.codegen.quant import activation_group
    from moetune.codegen.triton import BACKEND
    from moetune.search.objective import make_cases, reference

    block = bench_block(shape, args.weights)
    fp8 = block.weight_format.quantized
    E, k = block.E, block.k
    cases = make_cases(block, w, T, N_ROUT, torch.Generator().manual_seed(1000 + T),
                       routing_sampler(block, getattr(args, "routing", "uniform")))
    distinct = statistics.mean(len(torch.unique(c.ids)) for c in cases)
    fl = floor_us(block, T, distinct)
    refs = {}  # the tuner's float32 references, by activation group (w8a8)

    def ref_at(group):
        if group not in refs:
            refs[group] = reference(block, cases[0], group)
        return refs[group]

    ref = ref_at(None)
    bo = best_open(shape, T, args.weights)
    named = candidates(block, T, table=args.table, samples=args.space_samples, seed=args.seed,
                       knobs=getattr(args, "knobs", ()),
                       sample_kinds=tuple(k for k in getattr(args, "sample_kinds", "").split(",") if k))
    named = [(tag, s) for tag, s in named if re.fullmatch(args.variants, tag)]
    cands = [(f"moetune:{s.kind}", tag, s) for tag, s in named]
    for b in args.baselines.split(","):
        if not b or (b == "batched_mm" and (T > 64 or T * k * 3 * block.D * block.F * 2 > 24e9)):
            continue  # batched_mm gathers every pair's weights: beyond that it runs out of memory
        if b == "eager" and T not in args.eager_tokens:
            continue
        cands.append((b, "", None))
    records = []
    for impl, tag, sched in cands:
        rec = dict(device=name, shape=shape, E=E, k=k, D=block.D, F=block.F, tokens=T, impl=impl, variant=tag,
                   schedule=sched.describe() if sched else None, floor_us=round(fl, 2), distinct=distinct,
                   best_open_us=bo, weights=block.weight_format.signature(),
                   routing=getattr(args, "routing", "uniform"))
        try:
            if sched:
                fn = BACKEND.build(block, sched)
            elif fp8:
                fn = hf_fp8_fn(impl, w, block)
            else:
                fn = eager_fn(E) if impl == "eager" else hf_fn(impl, w, E)
            # (transformers' FP8 experts: activations per 1 × the weight block's columns)
            group = activation_group(sched.params) if sched else block.weight_format.block[1] if fp8 else None
            measure(rec, fn, cases, ref, timer, host_only=impl == "eager", baseline=sched is None,
                    a8=group is not None, check_ref=ref_at(group))
        except Exception as exc:  # noqa: BLE001 - a failing candidate is recorded, never stops the sweep
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            torch.cuda.synchronize()
        if "time_us" in rec:
            rec["pct_floor"] = 100.0 * fl / rec["time_us"]
            if bo:
                rec["speedup_vs_best_open"] = bo / rec["time_us"]
        records.append(rec)
        torch.cuda.empty_cache()
    return records


def run(args) -> int:
    if args.render:
        print(render(args.render))
        return 0
    try:
        args.knobs = parse_with(args.with_)
    except ValueError as e:
        print(f"python -m bench kernels: {e}", file=sys.stderr)
        return 2
    if args.hf_fp8_kernel:
        try:
            fp8_kernel_package(args.hf_fp8_kernel)
        except FileNotFoundError as e:
            print(f"python -m bench kernels: {e}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("bench kernels: no CUDA device here (the kernels suite times GPU kernels; --render works on CPU)",
              file=sys.stderr)
        return 2
    from moetune.search.objective import expert_tensors

    t_start = time.time()
    dev = torch.device("cuda")
    name = device_stem()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-kernels" + ("-fp8" if args.weights == "fp8" else "")
    jpath = out_dir / f"{stem}.json"
    meta = {"hf_fp8_kernel": use_fp8_kernel_source(args.hf_fp8_kernel)} if args.hf_fp8_kernel else {}
    ceil = ceilings(dev)
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    print("ceilings: " + "  ".join(f"{k} {v:.3g}" for k, v in ceil.items()), flush=True)
    timer = CudaGraphTimer(reps=args.reps, shared_pool=True)  # batched_mm's per-call weight copies: once
    records: list[dict] = []
    tokens = [int(t) for t in args.tokens.split(",")]
    stop = False
    for shape in args.shapes.split(","):
        w = expert_tensors(bench_block(shape, args.weights), dev)
        for T in tokens:
            if time.time() - t_start > args.budget_s:
                print(f"budget reached: stopping before {shape} T={T}", flush=True)
                stop = True
                break
            recs = cell(shape, T, w, args, timer, name)
            records += recs
            mine = [r for r in recs if r["impl"].startswith("moetune") and "time_us" in r]
            if mine:
                b = min(mine, key=lambda r: r["time_us"])
                print(f"{shape:18s} T={T:5d} floor {b['floor_us']:8.1f}  best {b['impl']}/{b['variant']} "
                      f"{b['time_us']:8.1f} µs ({b['pct_floor']:.0f}%)  open {b['best_open_us']}  "
                      f"host {b['host_us']:.1f}  [{time.time() - t_start:.0f}s]", flush=True)
            jpath.write_text(json.dumps(dict(ceilings=ceil, **meta, records=records), indent=1))
        del w
        torch.cuda.empty_cache()
        if stop:
            break
    md = table(records, ceil, name, args.weights, meta.get("hf_fp8_kernel"))
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    return 0


def add_arguments(ap) -> None:
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"), help="folder for the JSON and .md")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="presets, comma-separated")
    ap.add_argument("--weights", choices=WEIGHTS, default="bf16",
                    help="the presets' bf16 experts, or the same in FP8 (e4m3, fp32 scales per 128×128 block)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, comma-separated")
    ap.add_argument("--routing", default="uniform", metavar="SPEC",
                    help="the timed routings: uniform, zipf:S, hot or trace:FILE (moetune.ir.trace.routing_trace)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="no new cell starts after this many seconds")
    ap.add_argument("--reps", type=int, default=100, help="timed graph replays per candidate")
    ap.add_argument("--baselines", default="grouped_mm,batched_mm,eager")
    ap.add_argument("--eager-tokens", type=lambda s: {int(t) for t in s.split(",") if t}, default={1},
                    help="token counts at which the eager loop is timed")
    ap.add_argument("--variants", default=".*", help="regex: only the moetune candidates whose tag matches")
    ap.add_argument("--table", default=str(ROOT / "cache"),
                    help="dispatch table (or a folder: its <target>.sqlite) whose entry for the cell's T is "
                         "candidate `table`; '' to leave it out")
    ap.add_argument("--space-samples", type=int, default=0, metavar="N",
                    help="also N points of the tuner's space of the cell's bucket (fixed seed)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the space samples")
    ap.add_argument("--sample-kinds", default="", metavar="KIND[,KIND...]",
                    help="draw the space samples from these schedule kinds alone (e.g. fused_gemv)")
    ap.add_argument("--with", dest="with_", action="append", default=[], metavar="KNOB=VALUE[,KNOB=VALUE...]",
                    help="also each candidate with these knobs set, where its space admits it (e.g. pdl=true, "
                         "block_k=256,num_stages=3)")
    ap.add_argument("--hf-fp8-kernel", metavar="DIR",
                    help="transformers' FP8 experts baselines run the finegrained-fp8 kernel from this local copy of "
                         "its source (the folder holding its finegrained_fp8 package) instead of the hub download")
    ap.add_argument("--render", metavar="JSON", help="rewrite the markdown table of a results JSON, then exit")


