"""`moetune tune`: tune a block's dispatch table on this machine and print the per-bucket table.

    moetune tune --preset NAME | --config FILE | --model-dir DIR | --tiny FAMILY
                 [--tokens 1-1024] [--trace FILE] [--budget 10m] [--cache PATH] [--storage URL]
                 [--backend torch|triton] [--target NAME] [--dtype D] [--strict] [--keep-going]
                 [--exhaustive] [--space-cap N]

One line per bucket while it tunes, then a table: bucket, winner, time, floor, % of floor, vs the
default heuristic, vs transformers' baseline; the device is named. Winners go to `--cache`
(default cache/<target>.sqlite; cache/<target>-tiny.sqlite for --tiny), replacing only slower entries.
`--exhaustive` times every point of each bucket's space (to check the TPE winner against a grid).
`--space-cap N` tunes each bucket over a deterministic sub-grid of at most N points around the default
heuristic (search.space.cap_space), the same for TPE and `--exhaustive`: a grid of the full Triton space
(10⁵ points per bucket) is out of reach, one of the sub-grid is not (bench/grid_vs_tpe.py).
"""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

from ..ir import CaptureError, MoEBlock, UnsupportedSchedule
from ..runtime.table import DispatchTable, device_identity
from .study import BucketResult, TuneOptions, tune_block
from .tune import process_started


def parse_tokens(s: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", s)
    if not m:
        raise UnsupportedSchedule(f"--tokens {s!r}: expected LO-HI, e.g. 1-1024")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if not 1 <= lo <= hi:
        raise UnsupportedSchedule(f"--tokens {s!r}: need 1 ≤ LO ≤ HI")
    return lo, hi


def parse_budget(s: str) -> float:
    """'90s', '10m', '1.5h', '120' (seconds) → seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|min)?\s*", s)
    if not m:
        raise UnsupportedSchedule(f"--budget {s!r}: expected e.g. 90s, 10m, 1h")
    v = float(m.group(1)) * {None: 1, "s": 1, "m": 60, "min": 60, "h": 3600}[m.group(2)]
    if v <= 0:
        raise UnsupportedSchedule(f"--budget {s!r}: must be positive")
    return v


def _block(args) -> MoEBlock:
    names = ("preset", "config", "model_dir", "tiny")
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None)]
    if len(given) != 1:
        raise CaptureError("moetune tune needs one of --preset, --config, --model-dir, --tiny; "
                           f"got {given or 'none'}")
    dtype = getattr(args, "dtype", None)
    if getattr(args, "tiny", None):
        return tiny_block(args.tiny, dtype)
    if args.preset:
        from ..ir.presets import preset

        return preset(args.preset, dtype=dtype)
    from ..ir.config import block_from_config

    path = Path(args.config) if args.config else Path(args.model_dir) / "config.json"
    if not path.is_file():
        raise CaptureError(f"config {path}: no such file")
    import json

    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CaptureError(f"config {path}: not JSON ({e})") from e
    return block_from_config(cfg, name=str(path), dtype=dtype)


def tiny_block(family: str, dtype: str | None = None) -> MoEBlock:
    """The (first) MoE block of moetune.tiny's model of `family`, as capture sees it."""
    import torch

    from .. import capture
    from ..tiny import FAMILIES, build

    if family not in FAMILIES:
        raise CaptureError(f"unknown tiny family {family!r}; families: {', '.join(FAMILIES)}")
    model = build(family, dtype=getattr(torch, dtype) if dtype else torch.float32)
    for c in capture(model):
        block = getattr(c, "block", None)
        if block is not None:
            return block.replace(name=f"tiny-{family}")
    raise CaptureError(f"tiny {family}: no MoE block captured")


def _default_backend() -> str:
    import torch

    return "triton" if torch.cuda.is_available() else "torch"


def _default_target(device: str) -> str:
    """The same target name `moetune.compile` looks the table up under for this device."""
    import torch

    from ..runtime.compiled import _target

    return _target(torch.device(device))


def _us(s: float | None) -> str:
    return "–" if s is None or not math.isfinite(s) else f"{s * 1e6:.1f}"


def _ratio(a: float | None, b: float) -> str:
    return "–" if a is None or not math.isfinite(b) or b <= 0 else f"{a / b:.2f}×"


def table_lines(results: list[BucketResult], device: str) -> list[str]:
    hdr = (f"{'bucket':>12} {'T':>5}  {'winner':<46} {'time µs':>9} {'floor µs':>9} {'% floor':>8} "
           f"{'vs default':>10} {'vs baseline':>11}  stopped")
    lines = [hdr, "-" * len(hdr)]
    for r in results:
        win = r.winner.describe().split(":", 1)[-1] if r.winner else "(none: the runtime keeps its default)"
        pct = r.pct_of_floor
        lines.append(
            f"{f'[{r.bucket[0]},{r.bucket[1]}]':>12} {r.tokens:>5}  {win[:46]:<46} {_us(r.time_s):>9} "
            f"{_us(r.floor.time_s if r.floor else None):>9} {('–' if pct is None else f'{pct:.1f}%'):>8} "
            f"{_ratio(r.default_time_s, r.time_s):>10} {_ratio(r.baseline_time_s, r.time_s):>11}  "
            f"{r.stopped}")
        for lo_, hi_, s, t_s, T in r.parts:
            lines.append(f"{f'[{lo_},{hi_}]':>14} {T:>5}  {s.describe().split(':', 1)[-1][:44]:<44} {_us(t_s):>9}  "
                         f"part of the split bucket [{r.bucket[0]},{r.bucket[1]}]")
    base = next((r.baseline for r in results), "")
    lines.append(f"device: {device}; time: at the bucket's T (GPU: each routing's median replay, averaged "
                 f"over the routings; CPU: the median call); floor at the target's roofs; "
                 f"vs default: the untuned heuristic's time / winner's; vs baseline: {base} / winner's")
    return lines


def _command_started() -> float | None:
    """When this process is the `moetune` command, its start (the budget counts the imports too)."""
    p = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return process_started() if p is not None and (p.name == "moetune" or "moetune" in p.parts[-3:-1]) else None


def run(args) -> int:
    lo, hi = parse_tokens(args.tokens)
    at_tokens = None
    if getattr(args, "at_tokens", None):
        try:
            at_tokens = sorted({int(t) for t in args.at_tokens.split(",") if t.strip()})
        except ValueError:
            raise SystemExit(f"moetune tune: --at-tokens {args.at_tokens!r}: token counts separated by "
                             "commas") from None
        if not at_tokens or not all(lo <= t <= hi for t in at_tokens):
            raise SystemExit(f"moetune tune: --at-tokens {args.at_tokens!r}: every count must lie in "
                             f"--tokens {lo}-{hi}")
    budget = parse_budget(args.budget)
    backend = args.backend or _default_backend()
    device = "cpu" if backend == "torch" else "cuda"
    target = getattr(args, "target", None) or _default_target(device)
    block = _block(args)
    cache = Path(args.cache or (f"cache/{target}-tiny.sqlite" if getattr(args, "tiny", None)
                                else f"cache/{target}.sqlite"))
    dev_name, cap = device_identity(device)
    options = TuneOptions(storage=args.storage, strict=getattr(args, "strict", False),
                          keep_going=getattr(args, "keep_going", False), device=device,
                          seed=getattr(args, "seed", 0) or 0, exhaustive=getattr(args, "exhaustive", False),
                          space_cap=getattr(args, "space_cap", None) or None,
                          resume=getattr(args, "resume", False),
                          edge_timing=not getattr(args, "no_edge_timing", False),
                          split=False if getattr(args, "no_split", False) else None,
                          local_search=not getattr(args, "no_local_search", False),
                          revalidate=getattr(args, "revalidate", False),
                          time_limit_s=parse_budget(args.time_limit) if getattr(args, "time_limit", None) else None)
    print(f"moetune tune: {block.name or block.signature_hash()} [{block.signature_hash()}] "
          f"on {dev_name} ({cap}), backend {backend}, target {target}, T ∈ [{lo},{hi}], budget {budget:.0f} s"
          + (f", trace {args.trace}" if args.trace else "")
          + (f", storage {args.storage}" if args.storage else "")
          + (f", space capped at {options.space_cap} points per bucket" if options.space_cap else ""))
    print(f"  {block.signature()}")
    tty = sys.stdout.isatty()
    t0 = time.monotonic()
    state = {"i": 0, "n": 0}

    def progress(ev: dict) -> None:
        if not tty:
            return
        lo_, hi_ = ev["bucket"]
        pct = f"{100 * ev['floor_s'] / ev['best_s']:.0f}% of floor" if math.isfinite(ev["best_s"]) else ""
        sys.stdout.write(f"\r  [{state['i'] + 1}/{state['n'] or '?'}] [{lo_},{hi_}] "
                         f"{ev['evaluated']} candidates, best {_us(ev['best_s'])} µs {pct}   ")
        sys.stdout.flush()

    def on_bucket(i: int, n: int, r: BucketResult) -> None:
        state["i"], state["n"] = i + 1, n
        fails = ", ".join(f"{v} {k}" for k, v in sorted(r.failures.items()))
        pct = r.pct_of_floor
        line = (f"  [{i + 1}/{n}] bucket [{r.bucket[0]},{r.bucket[1]}] T={r.tokens}: "
                f"{r.evaluated} candidates ({r.trials} trials), best {_us(r.time_s)} µs"
                + (f" ({pct:.1f}% of floor)" if pct is not None else "")
                + f", default {_us(r.default_time_s)} µs; {r.stopped}"
                + (f"; failed: {fails}" if fails else "")
                + f"  [{time.monotonic() - t0:.0f} s]")
        print(("\r" if tty else "") + line + (" " * 8 if tty else ""), flush=True)
        for j, (s, t_s, edge) in enumerate(r.finalists if len(r.finalists) > 1 else ()):
            at = "".join(f", {_us(v)} at T={t}" for t, v in sorted(edge.items()))
            print(f"      {'winner ' if j == 0 else 'final  '} {_us(t_s)} µs{at}: {s.describe()}", flush=True)
        for lo_, hi_, s, t_s, T in r.parts:
            print(f"      split   [{lo_},{hi_}]: {_us(t_s)} µs at T={T}: {s.describe()}", flush=True)

    with DispatchTable(cache) as table:
        results = tune_block(block, backend, target, (lo, hi), trace=args.trace, table=table, options=options,
                             budget_s=budget, progress=progress, on_bucket=on_bucket, at_tokens=at_tokens,
                             started=_command_started())
    print()
    print("\n".join(table_lines(results, f"{dev_name} ({cap})")))
    written = sum(r.written for r in results)
    print(f"\n{written} of {len(results)} bucket winners written to {cache} "
          f"(an entry is replaced by a faster one, or by a winner chosen against it here); "
          f"total {time.monotonic() - t0:.0f} s")
    left = [r for r in results if r.stopped.startswith("not tuned: time limit")]
    if left:
        print(f"{len(left)} bucket(s) left untuned by the time limit: rerun with --resume to tune only those")
    return 0 if all(r.winner is not None for r in results) else 1


if __name__ == "__main__":  # pragma: no cover
    from ..cli import main

    sys.exit(main(["tune", *sys.argv[1:]]))
