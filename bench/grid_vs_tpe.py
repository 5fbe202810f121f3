"""TPE against an exhaustive grid, and workers sharing one study: on a CPU (torch backend) or a GPU (triton).

grid mode: on three buckets, the TPE winner against an exhaustive grid over the SAME space, a
deterministic sub-grid of ≤ --space-cap points per bucket around the default heuristic
(search.space.cap_space; a grid of the full Triton space, 10⁵ points per bucket, is out of reach).

    1. phase tpe:  the normal study (TPE, defaults enqueued first, early stops) on each bucket
    2. phase grid: `--exhaustive` on the same buckets and the same sub-grid; then the TPE winner (read
                   back from phase 1's table) and the grid winner are re-timed back to back, in
                   alternating rounds, so that the ratio does not mix two processes' timings.

Each phase runs in its own process with its own empty Triton cache (TRITON_CACHE_DIR), so neither
phase's wall time profits from kernels the other compiled; each writes its own temporary table.
Per bucket: both winners and times, the back-to-back ratio TPE / grid, trials, wall time, device.

workers mode: N `moetune tune` processes on one preset and token range, sharing one Optuna journal
(--storage) and one dispatch table (--cache); then the trials each worker ran in each shared study,
and the table's rows (one per bucket: none lost).

    python bench/grid_vs_tpe.py --mode grid --tiny qwen3_moe --backend torch --out /tmp/g
    python bench/grid_vs_tpe.py --mode both --preset qwen3-30b-a3b --backend triton --target h200 --out $OUT

Writes into --out: grid_vs_tpe.{json,md} and multi_worker.{json,md} (+ worker-I.log, each worker's
output). The JSON is rewritten after every bucket, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("grid", "workers", "both"), default="grid")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help="a shipped preset (default qwen3-30b-a3b)")
    src.add_argument("--tiny", default=None, help="the block of a tiny offline model family")
    ap.add_argument("--backend", default=None, help="torch | triton (default: triton on a GPU)")
    ap.add_argument("--target", default=None, help="passes' target (default: the one moetune.compile uses)")
    ap.add_argument("--tokens", default="1-1024", help="the range the passes bucket (the buckets' context)")
    ap.add_argument("--at", default="1,14,165", help="token counts: the buckets holding them are compared")
    ap.add_argument("--space-cap", type=int, default=24, help="points of each bucket's sub-grid")
    ap.add_argument("--tpe-budget", type=float, default=12.0, help="TPE seconds per bucket")
    ap.add_argument("--grid-budget", type=float, default=40.0, help="grid seconds per bucket (a cap)")
    ap.add_argument("--patience", type=int, default=8, help="TPE: trials without a 1%% gain before it stops")
    ap.add_argument("--batch", type=int, default=4, help="TPE: candidates asked (and built) per round")
    ap.add_argument("--routings", type=int, default=0, help="timing cases (0: 32 on a GPU, 8 on CPU)")
    ap.add_argument("--rounds", type=int, default=3, help="back-to-back timing rounds of the two winners")
    ap.add_argument("--tolerance", type=float, default=0.03, help="the target: TPE ≤ (1 + tol) × grid")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build-workers", type=int, default=0, help="build threads (0: one per CPU core)")
    ap.add_argument("--workers", type=int, default=2, help="workers mode: processes on one study")
    ap.add_argument("--worker-tokens", default="1-9", help="workers mode: the token range they tune")
    ap.add_argument("--worker-budget", default="30s", help="workers mode: each worker's budget")
    ap.add_argument("--out", default="bench/results/grid_vs_tpe", help="folder for the results")
    ap.add_argument(
        "--start-s",
        type=float,
        default=30.0,
        help="allowance per process for imports, weights and compiles beyond its budget",
    )
    ap.add_argument("--no-isolate", action="store_true", help="run both phases in this process")
    ap.add_argument("--phase", choices=("tpe", "grid"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phase-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tpe-table", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--grid-table", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.tiny and not a.preset:
        a.preset = "qwen3-30b-a3b"
    return a


def _setup(a):
    """(block, backend name, device, target)."""
    import torch

    from moetune.cli.common import tiny_block
    from moetune.cli.tune import default_backend, default_target

    backend = a.backend or default_backend()
    device = "cuda" if backend != "torch" and torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET
    target = a.target or default_target(device)
    if a.tiny:
        block = tiny_block(a.tiny)
    else:
        from moetune.ir.presets import preset

        block = preset(a.preset)
    return block, backend, device, target


def _tokens(a) -> tuple[tuple[int, int], list[int]]:
    from moetune.cli.common import parse_tokens

    return parse_tokens(a.tokens), [int(t) for t in a.at.split(",") if t.strip()]


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def _publish(stem: Path, rec: dict, markdown: str) -> dict:
    """A check's record as STEM.json, its report as STEM.md and on stdout; returns the record."""
    _write(stem.with_suffix(".json"), rec)
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    return rec


def _us(s) -> float | None:
    return None if s is None or not math.isfinite(s) else round(s * 1e6, 2)


# --------------------------------------------------------------------------------------- phases


def run_phase(a) -> dict:
    """One phase in this process: tune (TPE or exhaustive) the selected buckets into its table."""
    from moetune.runtime.table import DispatchTable
    from moetune.runtime.versions import device_identity
    from moetune.search import TuneOptions, tune_block

    block, backend, device, target = _setup(a)
    (lo, hi), at = _tokens(a)
    grid = a.phase == "grid"
    opts = TuneOptions(
        seed=a.seed,
        device=device,
        space_cap=a.space_cap,
        exhaustive=grid,
        keep_going=True,
        routings=a.routings,
        patience=a.patience,
        edge_timing=False,  # both searches judged at the representative T only: the comparison is of search
        **({} if grid else {"batch": a.batch}),
    )
    per = a.grid_budget if grid else a.tpe_budget
    rec = {"phase": a.phase, "device": " ".join(device_identity(device)), "buckets": []}
    t_prev = [time.monotonic()]
    t0 = t_prev[0]
    path = Path(a.phase_json) if a.phase_json else None

    def on_bucket(i, n, r) -> None:
        now = time.monotonic()
        rec["buckets"].append(
            {
                "bucket": list(r.bucket),
                "tokens": r.tokens,
                "winner": r.winner.describe() if r.winner else None,
                "time_us": _us(r.time_s),
                "default_us": _us(r.default_time_s),
                "trials": r.trials,
                "evaluated": r.evaluated,
                "failures": r.failures,
                "stopped": r.stopped,
                "space": r.space,
                "wall_s": round(now - t_prev[0], 2),
            }
        )
        t_prev[0] = now
        print(
            f"  {a.phase} [{i + 1}/{n}] [{r.bucket[0]},{r.bucket[1]}] T={r.tokens}: {r.evaluated} candidates "
            f"({r.trials} trials), best {_us(r.time_s)} µs, {r.stopped}  [{now - t0:.0f} s]",
            flush=True,
        )
        if path:
            _write(path, rec)

    table_path = a.grid_table if grid else a.tpe_table
    with DispatchTable(table_path) as table:
        tune_block(
            block,
            backend,
            target,
            (lo, hi),
            table=table,
            options=opts,
            budget_s=per * len(at),
            on_bucket=on_bucket,
            at_tokens=at,
        )
    rec["wall_s"] = round(time.monotonic() - t0, 2)
    if grid and a.tpe_table:
        rec["back_to_back"] = back_to_back(a, block, backend, device, target)
    if path:
        _write(path, rec)
    return rec


def back_to_back(a, block, backend, device, target) -> list[dict]:
    """Re-time the TPE and grid winners of each bucket in alternating rounds on the same cases."""
    from moetune.codegen.backend import get
    from moetune.passes.pipeline import schedule_block
    from moetune.runtime.table import DispatchTable
    from moetune.search.objective import expert_tensors
    from moetune.search.seeds import runtime_default
    from moetune.search.timing import timer_for

    (lo, hi), at = _tokens(a)
    be = get(backend)
    b = block.replace(T_max=max(block.T_max, hi)) if block.T_max < hi else block
    buckets = [
        x for x in schedule_block(b, target, tokens=(lo, hi)).buckets if any(x.lo <= t <= x.hi for t in at)
    ]
    w = expert_tensors(b, device, seed=a.seed)
    timer = timer_for(device)
    routings = a.routings or (32 if device.startswith("cuda") else 8)
    out = []
    with DispatchTable(a.tpe_table, create=False) as tt, DispatchTable(a.grid_table, create=False) as gt:
        for bk in buckets:
            sig = b.signature_hash()
            # a bucket without an entry kept the default (its winner was within the spread of it)
            te, ge = (t.get(target, backend, sig, bk.lo, bk.hi) for t in (tt, gt))
            default = runtime_default(b, be, target, bk)
            if default is None and (te is None or ge is None):
                out.append(
                    {
                        "bucket": [bk.lo, bk.hi],
                        "error": "no winner in the " + ("TPE" if te is None else "grid") + " table",
                    }
                )
                continue
            try:
                ts, gs = (default if e is None else e.schedule(b) for e in (te, ge))
                out.append(_retime_pair(a, b, be, bk, w, timer, routings, ts, gs))
            except Exception as e:  # noqa: BLE001 - reported in the record; the phases' own times remain
                out.append({"bucket": [bk.lo, bk.hi], "error": f"{type(e).__name__}: {e}"[:500]})
    return out


def _retime_pair(a, b, be, bk, w, timer, routings, tpe_s, grid_s) -> dict:
    """The two winners of one bucket checked again, then timed in alternating rounds on the same cases."""
    from moetune.search import bucket_inputs
    from moetune.search.objective import Objective

    inputs = bucket_inputs(b, bk, w, routings=routings, seed=a.seed + 1)  # cases neither phase timed
    obj = Objective(b, be, timer, inputs.cases, inputs.check_tokens, seed=a.seed + 2, keep_going=True)
    fns, times = {}, {"tpe": [], "grid": []}
    for name, s in (("tpe", tpe_s), ("grid", grid_s)):
        o = obj.evaluate(s)  # checked again on fresh inputs, and timed once
        fns[name] = obj.build(s).fn if o.ok else None
        times[name].append(o.time_s)
    for i in range(max(0, a.rounds - 1)):
        for name in ("grid", "tpe") if i % 2 == 0 else ("tpe", "grid"):
            if fns[name] is not None:
                times[name].append(obj.timer(fns[name], obj.timing_cases).median_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bucket": [bk.lo, bk.hi],
        "same_winner": tpe_s == grid_s,
        "tpe_us": _us(med["tpe"]),
        "grid_us": _us(med["grid"]),
        "ratio": (med["tpe"] / med["grid"])
        if math.isfinite(med["grid"]) and math.isfinite(med["tpe"])
        else None,
        "rounds": {k: [_us(x) for x in v] for k, v in times.items()},
    }


def grid_vs_tpe(a, argv: list[str]) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="moetune-grid-vs-tpe-"))
    tpe_table, grid_table = str(tmp / "tpe.sqlite"), str(tmp / "grid.sqlite")
    recs, rc = {}, 0
    for phase in ("tpe", "grid"):
        pj = tmp / f"{phase}.json"
        extra = [
            "--phase",
            phase,
            "--phase-json",
            str(pj),
            "--tpe-table",
            tpe_table,
            "--grid-table",
            grid_table,
        ]
        t0 = time.monotonic()
        if a.no_isolate:
            run_phase(_args([*argv, *extra]))
        else:
            env = dict(
                os.environ,
                TRITON_CACHE_DIR=str(tmp / f"triton-{phase}"),
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            )
            n = len(_tokens(a)[1])
            budget = a.grid_budget if phase == "grid" else a.tpe_budget
            limit = a.start_s + n * (budget + 5) + (10 if phase == "grid" else 0)  # 10 s: back to back
            try:  # a phase past its limit is stopped; the buckets it finished are in its record
                rc = subprocess.run(
                    [sys.executable, __file__, *argv, *extra], env=env, timeout=limit
                ).returncode
            except subprocess.TimeoutExpired:
                rc = f"stopped after {limit:.0f} s"
            except KeyboardInterrupt:  # e.g. `timeout -s INT`: report what the phases measured
                rc = "interrupted"
            if rc != 0:
                print(f"grid_vs_tpe: phase {phase} exited {rc}", file=sys.stderr)
        recs[phase] = json.loads(pj.read_text()) if pj.is_file() else {"buckets": [], "error": "no record"}
        recs[phase]["process_wall_s"] = round(time.monotonic() - t0, 2)
        if rc == "interrupted":
            if "grid" not in recs:
                recs["grid"] = {"buckets": [], "error": "interrupted", "process_wall_s": 0.0}
            break
    rows = []
    b2b = {tuple(x["bucket"]): x for x in recs["grid"].get("back_to_back", [])}
    grid_by = {tuple(x["bucket"]): x for x in recs["grid"]["buckets"]}
    for t in recs["tpe"]["buckets"]:
        g = grid_by.get(tuple(t["bucket"]), {})
        j = b2b.get(tuple(t["bucket"]), {})
        ratio, source = j.get("ratio"), "back to back"
        if ratio is None and t.get("time_us") and g.get("time_us"):  # no re-timing: each phase's own time
            ratio, source = t["time_us"] / g["time_us"], "each phase's own timing"
        rows.append(
            {
                "bucket": t["bucket"],
                "tokens": t["tokens"],
                "space": t["space"],
                "same_space": t["space"] == g.get("space"),
                "tpe": {k: t[k] for k in ("winner", "time_us", "trials", "evaluated", "wall_s", "stopped")},
                "grid": {
                    k: g.get(k) for k in ("winner", "time_us", "trials", "evaluated", "wall_s", "stopped")
                },
                "grid_complete": str(g.get("stopped", "")).startswith("space exhausted"),
                "back_to_back": j,
                "ratio": ratio,
                "ratio_source": source,
                "within_tolerance": ratio is not None and ratio <= 1 + a.tolerance,
            }
        )
    rec = {
        "device": recs["tpe"].get("device"),
        "block": a.tiny and f"tiny-{a.tiny}" or a.preset,
        "backend": a.backend,
        "space_cap": a.space_cap,
        "tolerance": a.tolerance,
        "buckets": rows,
        "tpe_wall_s": recs["tpe"].get("wall_s"),
        "grid_wall_s": recs["grid"].get("wall_s"),
        "tpe_process_s": recs["tpe"]["process_wall_s"],
        "grid_process_s": recs["grid"]["process_wall_s"],
        "isolated": not a.no_isolate,
        "interrupted": rc == "interrupted",
        "phases": recs,
    }
    return _publish(out / "grid_vs_tpe", rec, grid_markdown(rec))


def grid_markdown(rec: dict) -> str:
    lines = [
        f"# TPE vs exhaustive grid over the same sub-grid ({rec['block']}, {rec['backend']}, "
        f"{rec['device']})",
        "",
        f"Space: ≤ {rec['space_cap']} points per bucket (search.space.cap_space). Ratio: TPE winner / grid "
        f"winner, re-timed back to back (median of rounds; else each phase's own time, marked *); "
        f"target ≤ {1 + rec['tolerance']:.2f}.",
        "",
        "| bucket | T | points | TPE winner | TPE µs | TPE trials | TPE wall s | grid winner | grid µs | "
        "grid trials | grid wall s | ratio | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rec["buckets"]:
        pts = r["space"].split(":", 1)[1].split(" points")[0].strip() if ":" in r["space"] else "?"
        j = r["back_to_back"]
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.3f}" + ("" if r["back_to_back"] else "*")
        lines.append(
            f"| [{r['bucket'][0]},{r['bucket'][1]}] | {r['tokens']} | {pts} | "
            f"{(r['tpe']['winner'] or '–').split(':', 1)[-1]} | {j.get('tpe_us', r['tpe']['time_us'])} | "
            f"{r['tpe']['trials']} | {r['tpe']['wall_s']} | "
            f"{(r['grid']['winner'] or '–').split(':', 1)[-1]} | "
            f"{j.get('grid_us', r['grid']['time_us'])} | {r['grid']['trials']} | {r['grid']['wall_s']} | "
            f"{ratio} | "
            f"{'yes' if r['within_tolerance'] else 'NO'}{'' if r['grid_complete'] else ' (grid cut short)'} |"
        )
    lines += [
        "",
        f"Tuning wall time (both phases, excluding process start): TPE {rec['tpe_wall_s']} s, "
        f"grid {rec['grid_wall_s']} s; whole processes {rec['tpe_process_s']} s and "
        f"{rec['grid_process_s']} s "
        f"({'each with its own empty Triton cache' if rec['isolated'] else 'one process'}).",
    ]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------- workers


def _bucket_of(study_name: str) -> tuple[int, int]:
    """moetune:<target>:<backend>:<signature>:<lo>-<hi>[:cap<N>] → (lo, hi)."""
    m = re.search(r":(\d+)-(\d+)(?::cap\d+)?$", study_name)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def multi_worker(a) -> dict:
    import optuna

    from moetune.cli.common import parse_duration
    from moetune.runtime.table import DispatchTable

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="moetune-workers-"))
    journal, cache = str(tmp / "study.journal"), str(tmp / "shared.sqlite")
    src = ["--tiny", a.tiny] if a.tiny else ["--preset", a.preset]
    cmd = [
        sys.executable,
        "-m",
        "moetune.cli",
        "tune",
        *src,
        "--tokens",
        a.worker_tokens,
        "--budget",
        a.worker_budget,
        "--cache",
        cache,
        "--storage",
        journal,
        "--keep-going",
    ]
    cmd += ["--backend", a.backend] if a.backend else []
    cmd += ["--target", a.target] if a.target else []
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    logs = [out / f"worker-{i + 1}.log" for i in range(a.workers)]
    t0 = time.monotonic()
    procs = []
    for i in range(a.workers):
        with open(logs[i], "w") as f:
            f.write(f"$ {' '.join(cmd)} --seed {i + 1}\n")
            f.flush()
            procs.append(
                subprocess.Popen(
                    [*cmd, "--seed", str(i + 1)], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT)
                )
            )
    limit = a.start_s + parse_duration(a.worker_budget, "--worker-budget") + 10
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1.0, limit - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:  # stopped: its trials so far stay in the journal
            p.kill()
            rcs.append(f"killed after {limit:.0f} s")
        except KeyboardInterrupt:
            p.kill()
            rcs.append("interrupted")
    wall = time.monotonic() - t0
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal))
    studies = []
    for s in sorted(storage.get_all_studies(), key=lambda s: _bucket_of(s.study_name)):
        trials = storage.get_all_trials(s._study_id, deepcopy=False)
        per: dict[str, dict] = {}
        for t in trials:
            wk = t.user_attrs.get("worker", "(not told)")
            d = per.setdefault(wk, {"trials": 0, "evaluated": 0})
            if t.state == optuna.trial.TrialState.COMPLETE:
                d["trials"] += 1
                d["evaluated"] += 0 if t.user_attrs.get("duplicate") else 1
        states: dict[str, int] = {}
        for t in trials:
            states[t.state.name] = states.get(t.state.name, 0) + 1
        studies.append(
            {
                "study": s.study_name,
                "bucket": "-".join(map(str, _bucket_of(s.study_name))),
                "trials": len(trials),
                "states": states,
                "per_worker": per,
            }
        )
    with DispatchTable(cache, create=False) as t:
        rows = [
            {
                "bucket": list(e.bucket),
                "winner": e.describe(),
                "time_us": round(e.time_us, 2),
                "trials": e.trials,
            }
            for e in t.entries()
        ]
    row_buckets = {f"{r['bucket'][0]}-{r['bucket'][1]}" for r in rows}
    rec = {
        "workers": a.workers,
        "returncodes": rcs,
        "wall_s": round(wall, 2),
        "command": " ".join(cmd),
        "studies": studies,
        "rows": rows,
        "lost_rows": sorted({s["bucket"] for s in studies} - row_buckets),
        "workers_in_every_study": all(
            sum(1 for d in s["per_worker"].values() if d["trials"]) >= 2 for s in studies
        )
        if a.workers >= 2
        else None,
    }
    return _publish(out / "multi_worker", rec, worker_markdown(rec))


def worker_markdown(rec: dict) -> str:
    lines = [
        f"# {rec['workers']} `moetune tune` workers, one Optuna journal, one table "
        f"(exit codes {rec['returncodes']}, {rec['wall_s']} s)",
        "",
        f"`{rec['command']} --seed I`",
        "",
        "| study bucket | trials | states | per worker: trials told (evaluated here) |",
        "|---|---|---|---|",
    ]
    for s in rec["studies"]:
        pw = "; ".join(f"{w}: {d['trials']} ({d['evaluated']})" for w, d in sorted(s["per_worker"].items()))
        lines.append(f"| {s['bucket']} | {s['trials']} | {s['states']} | {pw} |")
    lines += [
        "",
        f"Table rows: {len(rec['rows'])}; studies without a row (lost): {rec['lost_rows'] or 'none'}; "
        f"every study shared by ≥ 2 workers: {rec['workers_in_every_study']}",
        "",
    ]
    lines += [f"- [{r['bucket'][0]},{r['bucket'][1]}] {r['winner']}" for r in rec["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _args(argv)
    if a.phase:
        run_phase(a)
        return 0
    ok, rec = True, {}
    if a.mode in ("grid", "both"):
        rec = grid_vs_tpe(a, argv)
        ok &= bool(rec["buckets"]) and all(r["within_tolerance"] for r in rec["buckets"])
    if a.mode in ("workers", "both") and not (a.mode == "both" and rec.get("interrupted")):
        rec = multi_worker(a)
        ok &= not rec["lost_rows"] and bool(rec["rows"]) and all(rc in (0, 1) for rc in rec["returncodes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
