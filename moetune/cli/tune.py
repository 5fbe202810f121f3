"""`moetune tune`: tune a block's dispatch table on this machine and print the per-bucket table.

    moetune tune --preset NAME | --config FILE | --model-dir DIR | --tiny FAMILY
                 [--tokens 1-1024] [--trace FILE | --routing SPEC] [--budget 10m] [--cache PATH]
                 [--storage URL] [--devices 0,1]
                 [--backend torch|triton] [--target NAME] [--dtype D] [--strict] [--keep-going]
                 [--exhaustive] [--space-cap N] [--time-limit D] [--resume | --revalidate]
                 [--at-tokens N,N] [--no-edge-timing] [--no-split] [--no-local-search]
    moetune tune ... --target tpu-v5e|tpu-v6e|tpu-v7 --verify-only [--tokens] [--cache] [--space-cap N] ...

One line per bucket while it tunes, then a table: bucket, winner, time, floor, % of floor, vs the
default heuristic, the spread of the final timings, vs transformers' baseline; the device is named.
Winners go to `--cache` (default cache/<target>.sqlite; cache/<target>-tiny.sqlite for --tiny), replacing
only slower entries; a winner that does not beat the default by more than the spread of the final round's
timings is not written (the bucket keeps the default, and its line says so with the numbers); where no usable
entry covers such a bucket, or where the bucket's own entry was timed beside the default and lost, the default
is written as its entry.
`--exhaustive` times every point of each bucket's space (to check the TPE winner against a grid).
`--space-cap N` tunes each bucket over a deterministic sub-grid of at most N points around the default
heuristic (search.space.cap_space), the same for TPE and `--exhaustive`, so that a grid stays in reach.

A TPU target is timed on that TPU only: where none is visible, `moetune tune --target tpu-…` refuses (exit 2)
and names `--verify-only`, which needs no TPU: each bucket's candidates (all of its space, or the `--space-cap`
sub-grid) are verified against the float32 reference in TPU interpret mode, lowered for the TPU and given a
cost-model estimate; each bucket's best estimate is written as an ESTIMATE row, which no measured entry gives
way to and which the runtime uses only where no measured entry covers a bucket (moetune.search.estimate says
how; its table says plainly that its times are estimates).

Every flag, the backend's availability here and the table file are checked before tuning starts.

Exit status: 0 when the tune ran, whether or not a candidate beat the default heuristic, and where the budget or
`--time-limit` left buckets untuned (the last line names them); 1 only where a bucket could not be tuned at all
(every candidate failed its check against the reference or its timing, or none could be built; the last line
names the buckets and why); 2 for a usage error (one line on stderr, before any tuning).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

from ..ir import DTYPES, ConfigError, IRError, Schedule, TunerUnavailable, UnsupportedSchedule
from .common import (
    add_source,
    existing_file,
    parse_counts,
    parse_duration,
    parse_tokens,
    source_block,
    whole,
    writable_file,
)
from .workers import WORKER_ENV


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("tune", help="tune a dispatch table for a preset or config on this machine")
    add_source(p, tiny=True)
    p.add_argument("--tokens", default="1-1024", help="token range LO-HI to tune")
    p.add_argument("--trace", help="a routing trace from `moetune record` (default: uniform routing)")
    p.add_argument("--routing", default=None, metavar="SPEC",
                   help="the routing the candidates are timed on and the buckets' statistics come from: uniform "
                        "(the default), zipf:S (Zipf-skewed, e.g. zipf:1.0), hot (one expert in half the tokens), "
                        "trace:FILE (as --trace)")
    p.add_argument("--budget", default=None,
                   help="search budget shared by the buckets, e.g. 90s, 10m; every bucket still times "
                        "its default and a first batch of candidates, so a budget below ~10 s per bucket "
                        "is exceeded (default 10m)")
    p.add_argument("--cache", default=None, help="dispatch table file (default: cache/<target>.sqlite)")
    p.add_argument("--storage", default=None, help="Optuna storage URL or journal file shared by workers")
    p.add_argument("--devices", default=None, metavar="0,1,…",
                   help="one worker process per device of this host (CUDA_VISIBLE_DEVICES per worker; on a "
                        "machine without CUDA, CPU workers), sharing --storage (default: sqlite:///<table>.study.db "
                        "beside the table) and the table; their progress in one line")
    p.add_argument("--backend", default=None, help="torch | triton (default: the best available here)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="weight dtype (default: the preset's)")
    p.add_argument("--target", default=None, help="target for the floors (default: cpu, or the GPU's); a TPU "
                                                  "target (tpu-v5e, tpu-v6e, tpu-v7) is timed on that TPU, or "
                                                  "estimated with --verify-only")
    p.add_argument("--verify-only", action="store_true",
                   help="with a TPU --target and no TPU here: verify every candidate in TPU interpret mode, lower it "
                        "for the TPU and pick each bucket's winner by a cost model; written as estimate rows, "
                        "never as timings")
    p.add_argument("--strict", action="store_true", help="re-raise every candidate failure")
    p.add_argument("--keep-going", action="store_true",
                   help="score unknown candidate errors inf instead of raising")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exhaustive", action="store_true", help="time every point of each bucket's space")
    p.add_argument("--time-limit", default=None,
                   help="wall clock of the whole run, e.g. 5m: no bucket starts that the last one's time says "
                        "would pass it; the rest are reported untuned (continue with --resume)")
    p.add_argument("--resume", action="store_true",
                   help="keep the buckets whose table entry is current here; tune only the others")
    p.add_argument("--space-cap", type=int, default=None,
                   help="tune a sub-grid of ≤ N points per bucket around the default (also for --exhaustive)")
    p.add_argument("--revalidate", action="store_true",
                   help="as --resume, but a stale bucket is not searched again: its stored winner is re-checked "
                        "and re-timed with the current kernels beside the defaults (and its neighbours' winners; "
                        "each default and stored winner with its launch twin, search.seeds.launch_twins), the "
                        "best kept (after a kernel change that should not move the timings)")
    p.add_argument("--at-tokens", default=None,
                   help="e.g. 256,512: tune only the buckets (of the whole --tokens range) that hold these "
                        "token counts, whatever the table holds for them (a targeted re-tune; with --revalidate, "
                        "their stored winners re-timed beside the defaults, current or not, no search)")
    p.add_argument("--no-edge-timing", action="store_true",
                   help="choose each bucket's winner at its representative T only (default: the finalists "
                        "are also timed at the bucket's first and last T, and at two between them in a bucket "
                        "spanning ≥ 1.5×; the least total loss wins)")
    p.add_argument("--no-split", action="store_true",
                   help="never split a bucket (default, on a GPU: where the winner is ≥ 5 %% slower than another "
                        "finalist at a count timed, the bucket is cut in 2 or 3 parts, each with its fastest "
                        "finalist)")
    p.add_argument("--no-local-search", action="store_true",
                   help="TPE only (default: each new fastest candidate's one-knob neighbours are tried "
                        "next, a local search from the incumbent)")
    return p


def default_backend() -> str:
    """The backend this machine tunes with by default (moetune.runtime.default.machine_backend)."""
    from ..runtime.default import machine_backend

    return machine_backend()


def default_target(device: str) -> str:
    """The same target name `moetune.compile` looks the table up under for this device."""
    from ..runtime.versions import target_of

    return target_of(device)


def usable_backend(name: str | None) -> tuple[str, str]:
    """(backend, device it is timed on) for --backend `name`; TunerUnavailable when it cannot run here."""
    import torch

    from ..codegen.backend import get

    name = name or default_backend()
    try:
        backend = get(name)
    except UnsupportedSchedule:
        raise ConfigError(f"--backend {name!r}: unknown; expected torch or triton") from None
    except ImportError as e:
        if (e.name or "").startswith("moetune"):
            raise ConfigError(f"--backend {name!r}: unknown; expected torch or triton") from None
        raise TunerUnavailable(f"--backend {name!r}: needs the {e.name or e} package, not installed here; "
                               "expected --backend torch on this machine") from None
    reason = backend.available()
    if reason:
        raise TunerUnavailable(f"--backend {name!r}: not usable here ({reason}); expected --backend torch "
                               "on this machine")
    from ..runtime.default import backend_device

    device = backend_device(name)
    if device == "cuda" and not torch.cuda.is_available():
        raise TunerUnavailable(f"--backend {name!r}: tuning times the kernels on a CUDA GPU and none is "
                               "visible here (torch.cuda.is_available() is False); expected --backend torch "
                               "on this machine")
    return name, device


def _target(name: str | None, device: str) -> str:
    if name is None:
        return default_target(device)
    from ..targets import TARGETS, get_target

    try:
        get_target(name)
    except IRError:
        raise ConfigError(f"--target {name!r}: unknown; expected one of {', '.join(TARGETS)}") from None
    return name


def _search():
    """The search's tune_block, TuneOptions and BucketResult; TunerUnavailable without Optuna."""
    try:
        from ..search import BucketResult, TuneOptions, tune_block
    except ModuleNotFoundError as e:
        if e.name != "optuna":
            raise
        raise TunerUnavailable("Optuna is not installed here; expected `pip install 'moetune[tune]'`") from None
    return BucketResult, TuneOptions, tune_block


def _us(s: float | None) -> str:
    return "–" if s is None or not math.isfinite(s) else f"{s * 1e6:.1f}"


def _ratio(a: float | None, b: float) -> str:
    return "–" if a is None or not math.isfinite(b) or b <= 0 else f"{a / b:.2f}×"


def spread_pct(r) -> str:
    """A result's spread as a percentage of the default's time (of the winner's without one)."""
    ref = r.default_time_s if r.default_time_s else r.time_s
    if r.spread_s is None or not ref or not math.isfinite(ref):
        return "–"
    return f"{100.0 * r.spread_s / ref:.1f}%"


def winner_text(s: Schedule | None) -> tuple[str, str]:
    """(kind with its row threshold, every parameter as name=value) of a winner."""
    if s is None:
        return "(none)", "the runtime keeps its default"
    head = s.kind + (f"(R={s.row_threshold})" if s.row_threshold is not None else "")
    params = "" if s.params is None else ", ".join(f"{f.name}={getattr(s.params, f.name)}"
                                                   for f in dataclasses.fields(s.params))
    return head, params


def table_lines(results: list, device: str) -> list[str]:
    """The final table: one line per bucket (and per part of a split bucket), each winner's parameters
    whole on the line below it."""
    hdr = (f"{'bucket':>12} {'T':>5}  {'winner':<16} {'time µs':>9} {'floor µs':>9} {'% floor':>8} "
           f"{'vs default':>10} {'spread':>7} {'vs baseline':>11}  stopped")
    lines = [hdr, "-" * len(hdr)]
    indent = " " * 20
    for r in results:
        head, params = winner_text(r.winner)
        pct = r.pct_of_floor
        lines.append(
            f"{f'[{r.bucket[0]},{r.bucket[1]}]':>12} {r.tokens:>5}  {head:<16} {_us(r.time_s):>9} "
            f"{_us(r.floor.time_s if r.floor else None):>9} {('–' if pct is None else f'{pct:.1f}%'):>8} "
            f"{_ratio(r.default_time_s, r.time_s):>10} {spread_pct(r):>7} {_ratio(r.baseline_time_s, r.time_s):>11}  "
            f"{r.stopped}")
        if params:
            lines.append(indent + params)
        for lo_, hi_, s, t_s, T in r.parts:
            head, params = winner_text(s)
            lines.append(f"{f'[{lo_},{hi_}]':>14} {T:>5}  {head:<14} {_us(t_s):>9}  "
                         f"part of the split bucket [{r.bucket[0]},{r.bucket[1]}]")
            if params:
                lines.append(indent + "  " + params)
    base = next((r.baseline for r in results), "")
    lines.append(f"device: {device}; time: at the bucket's T (GPU: each routing's median replay, averaged "
                 f"over the routings; CPU: the median call); floor at the target's roofs; "
                 f"vs default: the untuned heuristic's time / winner's; spread: how far the winner's and the "
                 f"default's final timings disagree, % of the default's (a winner must beat the default by more); "
                 f"vs baseline: {base} / winner's")
    return lines


def _command_started() -> float | None:
    """When this process is the `moetune tune` command, its start: the budget then counts the imports too.
    Another command that tunes on the way (`moetune demo`) gives its tuning step the budget from that step."""
    from ..search.tune import process_started

    p = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    is_moetune = p is not None and (p.name == "moetune" or "moetune" in p.parts[-3:-1])
    return process_started() if is_moetune and sys.argv[1:2] == ["tune"] else None


def run(args: argparse.Namespace) -> int:
    from ..runtime.table import DispatchTable, table_path
    from ..runtime.versions import device_identity

    lo, hi = parse_tokens(args.tokens)
    at_tokens = parse_counts(args.at_tokens, "--at-tokens", (lo, hi)) if args.at_tokens else None
    whole(args.space_cap, "--space-cap", 1)
    tpu = _tpu_target(args.target)
    if tpu is not None or args.verify_only:
        return _verify_only(args, tpu, (lo, hi), at_tokens)
    budget = parse_duration(args.budget or "10m", "--budget")
    time_limit = parse_duration(args.time_limit, "--time-limit") if args.time_limit else None
    if args.trace and args.routing:
        raise ConfigError(f"--routing {args.routing!r}: not with --trace (--routing trace:FILE is --trace FILE)")
    if args.trace:
        existing_file(args.trace, "--trace", "a routing trace from `moetune record`")
    if args.routing and args.routing.startswith("trace:"):
        existing_file(args.routing[6:], "--routing", "trace:FILE, a routing trace from `moetune record`")
    backend, device = usable_backend(args.backend)
    target = _target(args.target, device)
    cache = writable_file(str(table_path(args.cache, target)) if args.cache else
                          (f"cache/{target}-tiny.sqlite" if args.tiny else f"cache/{target}.sqlite"), "--cache")
    BucketResult, TuneOptions, tune_block = _search()
    block = source_block(args)
    trace = args.trace
    if args.routing:
        from ..ir.trace import TraceError, routing_trace

        try:
            trace = routing_trace(args.routing, block.E, block.k, seed=args.seed or 0)
        except TraceError as e:
            raise ConfigError(f"--routing {args.routing!r}: {str(e).split(': ', 1)[-1]}") from None
    if args.devices is not None:
        from .workers import parse_devices, run_workers

        devices = parse_devices(args.devices)
        storage = args.storage or f"sqlite:///{cache.resolve()}.study.db"
        return run_workers(args.argv, devices, storage, budget)
    dev_name, cap = device_identity(device)
    options = TuneOptions(storage=args.storage, strict=args.strict, keep_going=args.keep_going, device=device,
                          seed=args.seed or 0, exhaustive=args.exhaustive, space_cap=args.space_cap or None,
                          resume=args.resume, edge_timing=not args.no_edge_timing,
                          split=False if args.no_split else None, local_search=not args.no_local_search,
                          revalidate=args.revalidate, time_limit_s=time_limit)
    print(f"moetune tune: {block.name or block.signature_hash()} [{block.signature_hash()}] "
          f"on {dev_name} ({cap}), backend {backend}, target {target}, T ∈ [{lo},{hi}], budget {budget:.0f} s"
          + (f", trace {args.trace}" if args.trace else "")
          + (f", routing {args.routing}" if args.routing else "")
          + (f", storage {args.storage}" if args.storage else "")
          + (f", space capped at {options.space_cap} points per bucket" if options.space_cap else ""))
    print(f"  {block.signature()}")
    t0 = time.monotonic()

    def on_bucket(i: int, n: int, r: BucketResult) -> None:  # the search's display shows progress and ETAs
        fails = ", ".join(f"{v} {k}" for k, v in sorted(r.failures.items()))
        pct = r.pct_of_floor
        line = (f"  [{i + 1}/{n}] bucket [{r.bucket[0]},{r.bucket[1]}] T={r.tokens}: "
                f"{r.evaluated} candidates ({r.trials} trials), best {_us(r.time_s)} µs"
                + (f" ({pct:.1f}% of floor)" if pct is not None else "")
                + f", default {_us(r.default_time_s)} µs, spread {_us(r.spread_s)} µs ({spread_pct(r)}); {r.stopped}"
                + (f"; failed: {fails}" if fails else "")
                + f"  [{time.monotonic() - t0:.0f} s]")
        print(line, flush=True)
        for j, (s, t_s, edge) in enumerate(r.finalists if len(r.finalists) > 1 else ()):
            at = "".join(f", {_us(v)} at T={t}" for t, v in sorted(edge.items()))
            print(f"      {'winner ' if j == 0 else 'final  '} {_us(t_s)} µs{at}: {s.describe()}", flush=True)
        for lo_, hi_, s, t_s, T in r.parts:
            print(f"      split   [{lo_},{hi_}]: {_us(t_s)} µs at T={T}: {s.describe()}", flush=True)

    with DispatchTable(cache) as table:
        results = tune_block(block, backend, target, (lo, hi), trace=trace, table=table, options=options,
                             budget_s=budget, on_bucket=on_bucket, at_tokens=at_tokens, started=_command_started(),
                             display=False if os.environ.get(WORKER_ENV) else None)
    print()
    print("\n".join(table_lines(results, f"{dev_name} ({cap})")))
    written = sum(r.written for r in results)
    print(f"\n{written} of {len(results)} bucket winners written to {cache} "
          f"(an entry is replaced by a faster one, or by a winner chosen against it here; a winner within the "
          f"spread of the default is not written: the default serves its bucket, and is written as its entry where "
          f"no usable entry covered it or where it beat the bucket's entry here); "
          f"total {time.monotonic() - t0:.0f} s")
    rc, summary = exit_status(results)
    print(summary)
    return rc


def exit_status(results: list) -> tuple[int, str]:
    """The exit status of a tune and the line that says why. 0: the tune ran, whether a candidate beat the
    default or the default serves its bucket, and where the budget or `--time-limit` left buckets untuned (their
    default serves them; `--resume` tunes only those). 1 only where a bucket could not be tuned at all: every
    candidate it tried failed its check against the reference or its timing, or it had none to try."""
    def failed(r) -> bool:
        if r.winner is not None or r.left:
            return False
        return r.stopped.startswith("not tuned:") or (r.evaluated > 0 and sum(r.failures.values()) >= r.evaluated)

    bad = [r for r in results if failed(r)]
    left = [r for r in results if r.left]
    kept = sum(r.winner is not None and r.winner == r.default for r in results)
    won = sum(r.winner is not None for r in results)
    span = lambda rs: ", ".join(f"[{r.bucket[0]},{r.bucket[1]}]" for r in rs)  # noqa: E731
    text = (f"{won} of {len(results)} bucket(s) with a winner, {kept} of them the default heuristic (no candidate "
            "beat it)"
            + (f", {len(left)} left untuned by the budget or the time limit (their default serves them; rerun "
               f"with --resume to tune only those): {span(left)}" if left else ""))
    if not bad:
        return 0, f"exit status 0: the tune ran; {text}"
    why = "; ".join(f"[{r.bucket[0]},{r.bucket[1]}] "
                    + (r.stopped.removeprefix("not tuned: ") if r.stopped.startswith("not tuned:") else
                       f"every candidate failed ({', '.join(f'{v} {k}' for k, v in sorted(r.failures.items()))})")
                    for r in bad)
    return 1, f"exit status 1: {len(bad)} bucket(s) could not be tuned at all: {why}; {text}"


# ----------------------------------------------------------------------------------------- TPU targets


def _tpu_target(name: str | None):
    """The target row of --target `name` when it is a TPU (aliases allowed), else None."""
    if name is None:
        return None
    from ..targets import TARGETS, get_target

    try:
        t = get_target(name)
    except IRError:
        raise ConfigError(f"--target {name!r}: unknown; expected one of {', '.join(TARGETS)}") from None
    return t if t.kind == "tpu" else None


def _tpu_here() -> bool:
    try:
        from ..codegen.pallas_tpu._common import on_tpu

        return on_tpu()
    except ImportError:
        return False


_TIMING_FLAGS = (("--budget", "budget"), ("--time-limit", "time_limit"), ("--storage", "storage"),
                 ("--resume", "resume"), ("--revalidate", "revalidate"), ("--exhaustive", "exhaustive"),
                 ("--trace", "trace"), ("--no-edge-timing", "no_edge_timing"), ("--no-split", "no_split"),
                 ("--no-local-search", "no_local_search"))


def _verify_only(args: argparse.Namespace, tpu, tokens: tuple[int, int], at_tokens: list[int] | None) -> int:
    """`--verify-only` for a TPU target (module doc); a TPU target without it is refused."""
    from ..runtime.table import DispatchTable

    if tpu is None:
        raise ConfigError(f"--verify-only: for a TPU target (--target tpu-v5e, tpu-v6e or tpu-v7), not "
                          f"{args.target or 'this machine'}; other targets are tuned by timing on them")
    if not args.verify_only:
        if not _tpu_here():
            raise TunerUnavailable(
                f"--target {args.target}: tuning times every candidate on that TPU and none is visible here; "
                "add --verify-only to verify each candidate in TPU interpret mode, lower it for the TPU and write "
                "each bucket's best cost-model estimate (estimates, not timings)")
        raise TunerUnavailable(f"--target {args.target}: moetune tune times candidates on a CPU or a CUDA GPU, not "
                               "on a TPU; add --verify-only to verify each candidate on this TPU, lower it and "
                               "write each bucket's best cost-model estimate (estimates, not timings)")
    for flag, dest in _TIMING_FLAGS:
        if getattr(args, dest):
            raise ConfigError(f"{flag} does not apply to --verify-only: every candidate is verified, lowered and "
                              "estimated, none is timed")
    if args.backend not in (None, "pallas_tpu"):
        raise ConfigError(f"--backend {args.backend!r}: --verify-only for {tpu.name} runs the Pallas TPU backend; "
                          "expected --backend pallas_tpu or none")
    cache = writable_file(args.cache or (f"cache/{tpu.name}-tiny.sqlite" if args.tiny else f"cache/{tpu.name}.sqlite"),
                          "--cache")
    from ..search.estimate import EstimateOptions, estimate_block, verify_block

    block = source_block(args)
    options = EstimateOptions(space_cap=args.space_cap or None, seed=args.seed or 0, strict=args.strict,
                              keep_going=args.keep_going)
    lo, hi = tokens
    where = "on this TPU" if _tpu_here() else "in TPU interpret mode (no TPU here)"
    print(f"moetune tune --verify-only: {block.name or block.signature_hash()} [{block.signature_hash()}] for "
          f"{tpu.name}, backend pallas_tpu, T ∈ [{lo},{hi}]"
          + (f", space capped at {options.space_cap} points per bucket" if options.space_cap else ""))
    print(f"  {block.signature()}")
    print(f"  candidates verified {where} against the float32 reference on {verify_block(block)[1]}, lowered for "
          f"{tpu.name} at the block's real shape; times are COST-MODEL ESTIMATES, not measurements")
    t0 = time.monotonic()

    def on_bucket(i: int, n: int, r) -> None:
        print(f"  [{i + 1}/{n}] bucket [{r.bucket[0]},{r.bucket[1]}] T={r.tokens}: {r.candidates} candidates: "
              f"{r.verified} verified, {r.lowered} lowered, {r.refused} refused"
              + (f" ({r.lowering_refused} by the TPU lowering)" if r.lowering_refused else "")
              + "".join(f", {v} {k}" for k, v in sorted(r.failures.items()))
              + f"; best estimate {_us(r.time_s)} µs" + (f" ({r.pct_of_floor:.1f}% of floor)" if r.pct_of_floor
                                                          else "")
              + (f"; {r.note}" if r.note else "") + f"  [{time.monotonic() - t0:.0f} s]", flush=True)
        for why in r.reasons:
            print(f"      {why}", flush=True)

    with DispatchTable(cache) as table:
        results = estimate_block(block, tpu.name, tokens, table=table, options=options, at_tokens=at_tokens,
                                 on_bucket=on_bucket)
    print()
    print("\n".join(estimate_lines(results, tpu.name)))
    written = sum(r.written for r in results)
    print(f"\n{written} of {len(results)} bucket estimates written to {cache} as ESTIMATE rows (an estimate "
          "replaces only a slower estimate; it never replaces a measured entry, which always replaces it; a "
          "compiled model uses an estimate only where no measured entry covers its bucket, and says so); "
          f"total {time.monotonic() - t0:.0f} s")
    bad = [r for r in results if r.winner is None]
    if not bad:
        print("exit status 0: every bucket has an estimate")
        return 0
    print(f"exit status 1: {len(bad)} bucket(s) without a verified, lowered candidate: "
          + ", ".join(f"[{r.bucket[0]},{r.bucket[1]}]" for r in bad))
    return 1


def estimate_lines(results: list, target: str) -> list[str]:
    """The --verify-only table: one line per bucket, its winner's parameters whole on the line below it."""
    from ..search.estimate import MODEL

    hdr = (f"{'bucket':>12} {'T':>5}  {'winner':<16} {'estimate µs':>11} {'floor µs':>9} {'% floor':>8} "
           f"{'vs default':>10} {'candidates':>10} {'verified':>8} {'lowered':>7} {'refused':>7} {'failed':>6}")
    lines = [f"ESTIMATES for {target} (cost model, not measured; nothing was timed):", hdr, "-" * len(hdr)]
    for r in results:
        head, params = winner_text(r.winner)
        pct = r.pct_of_floor
        lines.append(
            f"{f'[{r.bucket[0]},{r.bucket[1]}]':>12} {r.tokens:>5}  {head:<16} {_us(r.time_s):>11} "
            f"{_us(r.floor.time_s if r.floor else None):>9} {('–' if pct is None else f'{pct:.1f}%'):>8} "
            f"{_ratio(r.default_time_s, r.time_s):>10} {r.candidates:>10} {r.verified:>8} {r.lowered:>7} "
            f"{r.refused:>7} {sum(r.failures.values()):>6}")
        if params:
            lines.append(" " * 20 + params)
    lines.append(f"estimate: {MODEL}, at the bucket's T with {target}'s bandwidth, peak and grid step cost "
                 "(moetune.search.estimate); floor at the target's roofs; vs default: the default's estimate / "
                 "the winner's; verified: passed the check against the float32 reference; lowered: also lowered "
                 "for the TPU at the bucket's first, representative and last T; refused: by the backend or the "
                 "TPU lowering")
    return lines
