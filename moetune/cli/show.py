"""`moetune show TABLE`: a dispatch table's winners, grouped by (target, backend, block).

Each entry is one line (bucket, kind, time, floor, % of floor, default, vs default, the spread it was
judged against, baseline, vs baseline, when tuned, and what its time is: "measured", or "estimate" for a
cost-model estimate of `moetune tune --verify-only`, never a timing) with the winner's parameters whole on
the line below it; a group holding estimates says so under its header. `--json`: one JSON array of the
rows, each an object of every column, for scripts.
"""

from __future__ import annotations

import argparse
import json
import os

from .common import existing_file


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("show", help="list a dispatch table's contents")
    p.add_argument("path", help="a dispatch table (.sqlite)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON array of the rows, each with every column (params as stored: a JSON text)")
    return p


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def rows_json(path: str | os.PathLike) -> str:
    """The table's rows as one JSON array, each row an object of every column in the table's order."""
    from ..runtime.schema import COLUMNS
    from ..runtime.table import DispatchTable

    with DispatchTable(path, create=False) as t:
        rows = [e.row() for e in t.entries()]
    return json.dumps([{c: r[c] for c in COLUMNS} for r in rows], indent=1, ensure_ascii=False)


def show(path: str | os.PathLike) -> str:
    """The table's contents, one entry per line and its parameters on the next."""
    from ..runtime.schema import TABLE
    from ..runtime.table import DispatchTable

    with DispatchTable(path, create=False) as t:
        rows = t.entries()
        lines = [f"{path}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'} in {TABLE}"]
        if t.foreign_version:
            lines.append(f"  (holds {t.foreign_version}, not {TABLE})")
    group = None
    for e in rows:
        g = (e.target, e.backend, e.signature)
        if g != group:
            group = g
            v = e.versions
            libs = v.backend_version if v.backend_version.startswith("torch ") else \
                f"{v.backend_version}, torch {v.torch}"
            lines += ["", f"target {e.target}  backend {e.backend}  block {e.signature}: {e.signature_text}",
                      f"  device {v.device} ({v.capability}), {libs}, moetune {v.moetune}, "
                      f"kernels {v.kernel_hash}",
                      f"  {'bucket':>12}  {'winner':<16} {'time µs':>9} {'floor µs':>9} {'% floor':>8} "
                      f"{'default µs':>10} {'vs default':>10} {'spread µs':>9} {'baseline µs':>11} "
                      f"{'vs baseline':>11}"
                      f"  {'tuned at':<25}  time is"]
            est = [x for x in rows if (x.target, x.backend, x.signature) == g and x.estimated]
            if est:
                lines.insert(len(lines) - 1, f"  {len(est)} of these entries hold cost-model ESTIMATES (not "
                                             "measured): every candidate verified and lowered for the target, "
                                             "none timed; a compiled model prefers any measured entry to them")
        vs_d = None if not e.default_time_us else e.default_time_us / e.time_us
        vs_b = None if not e.baseline_time_us else e.baseline_time_us / e.time_us
        kind = e.kind + (f"(R={e.row_threshold})" if e.row_threshold is not None else "")
        lines.append(
            f"  {f'[{e.bucket_lo},{e.bucket_hi}]':>12}  {kind:<16} {_fmt(e.time_us):>9} "
            f"{_fmt(e.floor_us, '.2f'):>9} {_fmt(e.pct_of_floor):>7}% {_fmt(e.default_time_us):>10} "
            f"{_fmt(vs_d, '.2f'):>9}× {_fmt(e.spread_us, '.2f'):>9} {_fmt(e.baseline_time_us):>11} "
            f"{_fmt(vs_b, '.2f'):>10}×  {e.tuned_at:<25}  {'estimate' if e.estimated else 'measured'}"
        )
        if e.params:
            lines.append(" " * 16 + ", ".join(f"{k}={v}" for k, v in json.loads(e.params).items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    existing_file(args.path, "TABLE", "a dispatch table written by `moetune tune`")
    print(rows_json(args.path) if args.json else show(args.path))
    return 0
