"""`moetune bench`: each kernel kind's time against T on this machine, beside the floor and transformers.

    moetune bench --preset NAME | --config FILE | --model-dir DIR | --tiny FAMILY
                  [--routing uniform|zipf:S|hot|trace:FILE] [--tokens 1,2,4,…] [--backend torch|triton]
                  [--cache PATH] [--cases N] [--json] [--plot out.png]

Per token count T and per kind the backend runs on the block, the kind's default schedule at T is built, checked
against the float32 reference and timed by the tuner's timer (CUDA graphs on a GPU, the host's median on the
CPU) on `--cases` routings of `--routing`; beside it transformers' experts function (the tuner's baseline), the
floor at the routings' distinct experts and what a compiled model runs at T (the table's entry, or the default
schedule). The table on stdout (time, floor, % of floor, per kind, the fastest kind, the compiled choice and the
baseline), or JSON with `--json`; `--plot` draws time against T per kind on log axes with the floor, the
crossover marked where the fastest kind changes (matplotlib: `pip install 'moetune[plot]'`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from ..ir import ConfigError
from .common import add_source

TOKENS = "1,2,4,8,16,32,64,128,256,512,1024"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="time each kernel kind against T, beside the floor and transformers")
    add_source(p, tiny=True)
    p.add_argument("--routing", default="uniform", metavar="SPEC",
                   help="uniform (default), zipf:S, hot (one expert in half the tokens) or trace:FILE")
    p.add_argument("--tokens", default=TOKENS, help=f"token counts, comma-separated (default {TOKENS})")
    p.add_argument("--backend", default=None, help="torch | triton (default: the best available here)")
    p.add_argument("--dtype", default=None, help="weight dtype (default: the preset's)")
    p.add_argument("--cache", default=None, help="dispatch table (or a folder of them) for the compiled choice "
                                                 "(default: none, the default schedules)")
    p.add_argument("--cases", type=int, default=8, help="routings timed per T (default 8)")
    p.add_argument("--json", action="store_true", help="the rows as JSON on stdout instead of the table")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw time against T per kind into this PNG")
    return p


def _tokens(text: str) -> list[int]:
    try:
        ts = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        ts = []
    if not ts or ts[0] < 1:
        raise ConfigError(f"--tokens {text!r}: expected token counts ≥ 1 separated by commas, such as 1,8,64")
    return ts


def run(args: argparse.Namespace) -> int:
    from ..ir.trace import TraceError, routing_trace
    from .tune import usable_backend

    tokens = _tokens(args.tokens)
    if args.cases < 1:
        raise ConfigError(f"--cases {args.cases}: expected at least 1")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(f"--plot {args.plot!r}: needs matplotlib (pip install 'moetune[plot]')") from None
    backend, device = usable_backend(args.backend)
    from .common import source_block

    block = source_block(args, T_max=max(tokens))
    try:
        trace = routing_trace(args.routing, block.E, block.k)
    except TraceError as e:
        raise ConfigError(f"--routing {args.routing!r}: {str(e).split(': ', 1)[-1]}") from None
    rows = measure(block, backend, device, tokens, trace, args)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("\n".join(table(rows)))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def measure(block, backend_name: str, device: str, tokens: list[int], trace, args) -> list[dict]:
    """One row per T: every kind's time (or why none), the floor, the fastest kind, the compiled choice and the
    baseline."""
    import torch
    from tqdm import tqdm

    from ..codegen.backend import for_target
    from ..ir import RoutingStats
    from ..passes.roofline import floor
    from ..runtime.default import default_at, pass_target
    from ..runtime.versions import device_identity, target_of
    from ..search.baseline import baseline_fn, default_baseline
    from ..search.objective import Objective, expert_tensors, make_cases, routing_sampler
    from ..search.timing import timer_for

    target = target_of(device)
    be = for_target(backend_name, pass_target(target))
    kinds = [k for k, why in be.kinds(block).items() if why is None]
    sampler = routing_sampler(block, trace)
    w = expert_tensors(block, device)
    timer = timer_for(device, be)
    base_name = default_baseline(device)
    base, base_label = baseline_fn(block, base_name)
    chosen = _compiled_choice(block, be, target, device, args.cache)
    dev_name, cap = device_identity(device)
    rows = []
    bar = tqdm(total=len(tokens) * (len(kinds) + 1), desc="moetune bench", unit="run", file=sys.stderr,
               disable=None, leave=False)
    for T in tokens:
        cases = make_cases(block, w, T, args.cases, torch.Generator().manual_seed(1000 + T), sampler)
        distinct = statistics.fmean(len(torch.unique(c.ids)) for c in cases)
        r = T * block.k / distinct
        stats = RoutingStats(tokens=T, distinct_experts=distinct, rows_per_active=r, max_rows=r,
                             source=f"the timed routings ({args.routing})")
        fl = floor(block, pass_target(target), T, stats).time_s * 1e6
        obj = Objective(block, be, timer, cases, (T,), sampler=sampler, seed=T)
        row = dict(model=block.name or block.signature_hash(), tokens=T, routing=args.routing, device=dev_name,
                   capability=cap, backend=be.name, target=target, floor_us=round(fl, 3), distinct=distinct,
                   kinds={})
        for kind in kinds:
            bar.set_postfix_str(f"T={T} {kind}")
            try:
                schedule = be.default(block, kind, T)
                out = obj.evaluate(schedule)
                row["kinds"][kind] = (dict(time_us=out.time_s * 1e6, schedule=schedule.describe()) if out.ok else
                                      dict(error=f"{out.status}: {out.reason}"[:200]))
            except Exception as e:  # noqa: BLE001 - a kind that cannot run at T is a row entry, not the end
                row["kinds"][kind] = dict(error=f"{type(e).__name__}: {e}"[:200])
            bar.update()
        timed = {k: v["time_us"] for k, v in row["kinds"].items() if "time_us" in v}
        row["fastest"] = min(timed, key=timed.get) if timed else None
        s = (chosen(T) if chosen else None) or default_at(block, be, target, T)
        row["compiled"] = s.describe()
        hit = [k for k, v in row["kinds"].items() if v.get("schedule") == row["compiled"]]
        if hit:
            row["compiled_us"] = row["kinds"][hit[0]]["time_us"] if "time_us" in row["kinds"][hit[0]] else None
        else:
            out = obj.evaluate(s)
            row["compiled_us"] = out.time_s * 1e6 if out.ok else None
        bar.set_postfix_str(f"T={T} {base_name}")
        if base is not None:
            try:
                with torch.inference_mode():
                    row["baseline_us"] = timer(base, cases).median_s * 1e6
            except Exception as e:  # noqa: BLE001
                row["baseline_error"] = f"{type(e).__name__}: {e}"[:200]
        row["baseline"] = base_label if base is not None else None
        bar.update()
        rows.append(row)
    bar.close()
    return rows


def _compiled_choice(block, be, target: str, device: str, cache):
    """T → the table entry's schedule a compiled model runs at T (None where no usable entry covers T), None
    without a table."""
    if not cache:
        return None
    from ..runtime.table import load_entries

    entries = load_entries(cache, block, target, be.name, device=device)
    return lambda T: next((s for lo, hi, s in entries if lo <= T <= hi), None)


def crossovers(rows: list[dict]) -> list[tuple[int, int, str, str]]:
    """(T before, T after, kind before, kind after) wherever the fastest kind changes between neighbouring rows."""
    out = []
    for a, b in zip(rows, rows[1:], strict=False):
        if a["fastest"] and b["fastest"] and a["fastest"] != b["fastest"]:
            out.append((a["tokens"], b["tokens"], a["fastest"], b["fastest"]))
    return out


def table(rows: list[dict]) -> list[str]:
    kinds = sorted({k for r in rows for k in r["kinds"]})
    head = f"{'T':>6} {'floor µs':>10} " + " ".join(f"{k:>18}" for k in kinds) + \
        f" {'fastest':>14} {'compiled µs':>12} {'% floor':>8} {'baseline µs':>12} {'vs base':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for k in kinds:
            v = r["kinds"].get(k, {})
            cells.append(f"{v['time_us']:>10.1f} ({100 * r['floor_us'] / v['time_us']:>3.0f}%)" if "time_us" in v
                         else f"{'–':>18}")
        c, b = r.get("compiled_us"), r.get("baseline_us")
        lines.append(f"{r['tokens']:>6} {r['floor_us']:>10.1f} " + " ".join(f"{x:>18}" for x in cells)
                     + f" {r['fastest'] or '–':>14} " + (f"{c:>12.1f} {100 * r['floor_us'] / c:>7.0f}%" if c else
                                                          f"{'–':>12} {'–':>8}")
                     + (f" {b:>12.1f} {b / c:>7.2f}×" if b and c else f" {'–':>12} {'–':>8}"))
    r0 = rows[0]
    lines.append(f"{r0['model']} on {r0['device']} ({r0['capability']}), backend {r0['backend']}, target "
                 f"{r0['target']}, routing {r0['routing']}; time: the kind's default schedule at T (% of floor); "
                 f"compiled: what a compiled model runs at T; baseline: {r0.get('baseline') or 'none'}")
    for lo, hi, a, b in crossovers(rows):
        lines.append(f"crossover: {a} fastest at T = {lo}, {b} at T = {hi}")
    for r in rows:
        for k, v in r["kinds"].items():
            if "error" in v:
                lines.append(f"T = {r['tokens']} {k}: {v['error']}")
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    Ts = [r["tokens"] for r in rows]
    for k in sorted({k for r in rows for k in r["kinds"]}):
        pts = [(r["tokens"], r["kinds"][k]["time_us"]) for r in rows if "time_us" in r["kinds"].get(k, {})]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=k)
    base = [(r["tokens"], r["baseline_us"]) for r in rows if r.get("baseline_us")]
    if base:
        ax.plot(*zip(*base, strict=True), ls=":", color="grey", label=rows[0].get("baseline") or "baseline")
    ax.plot(Ts, [r["floor_us"] for r in rows], ls="--", color="black", label="floor")
    for lo, hi, _, b in crossovers(rows):
        x = math.sqrt(lo * hi)
        ax.axvline(x, color="red", alpha=0.4)
        ax.annotate(f"→ {b}", (x, ax.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=8, color="red")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("µs per call")
    r0 = rows[0]
    ax.set_title(f"{r0['model']}: {r0['device']}, {r0['backend']}, routing {r0['routing']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
