"""Keep a shipped Triton table current across a source edit that leaves its winners' sm_90 code unchanged.

A table's rows carry the kernel hash of the sources they were timed on; any edit of those files makes
them stale. Beside the table lies the PTX digest of every stored winner's kernels, compiled for sm_90 on
the tree the table is current on (`cache/h200.digests.json`, with the Triton version that made them).
Compiling needs no GPU, so on any machine with that Triton:

    python -m tests.codegen.relabel cache/h200.sqlite            # after a source edit
    python -m tests.codegen.relabel cache/h200.sqlite --record   # after a re-tune: the new winners' digests

The first compiles the stored winners on the current tree; where the digest of every stale row (one timed
on other kernel sources; a row re-timed on this tree is current already) equals the recorded one, the
Triton rows move to the current kernel hash (their timings still hold); where any differs, nothing is
written and those kernels are named (re-tune them on the GPU). `--record` writes the digests file, and
only for a table whose rows are all current.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class RelabelError(Exception):
    """The relabel cannot run here or on this table: says why."""


def digests_path(table: str | os.PathLike) -> Path:
    """Where the digests of `table` live: beside it, `<name>.digests.json`."""
    return Path(table).with_suffix(".digests.json")


def tree_digests(table: str | os.PathLike) -> dict[str, str]:
    """The PTX digest of every kernel of every stored Triton winner, compiled for sm_90 on this tree."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RelabelError("TRITON_INTERPRET is set: interpreted kernels do not compile; unset it")
    from . import triton_sm90

    return triton_sm90.table_digests(str(table))


def _triton() -> str:
    from moetune.runtime.versions import backend_version

    return backend_version("triton")


def _stale_entries(table: str | os.PathLike) -> list:
    """The Triton rows of `table` timed on other kernel sources than this tree's."""
    from moetune.runtime.table import DispatchTable
    from moetune.runtime.versions import kernel_source_hash, stale_on

    now = kernel_source_hash("triton")
    with DispatchTable(table, create=False) as t:
        return [e for e in t.entries(backend="triton") if stale_on(e, now)]


def _stale_rows(table: str | os.PathLike) -> list[str]:
    return [f"[{e.bucket_lo},{e.bucket_hi}] {e.kind} of {e.signature_text}" for e in _stale_entries(table)]


def _row_key(e, names: dict[str, str]) -> str:
    """The row part of a digest key of entry `e`: "<preset> [lo,hi]" (`names`: preset by signature)."""
    return f"{names.get(e.signature, e.signature)} [{e.bucket_lo},{e.bucket_hi}]"


def _preset_names() -> dict[str, str]:
    from moetune.ir.presets import PRESETS, preset

    return {b.signature_hash(): b.name for b in map(preset, PRESETS)}


def _uncovered_rows(table: str | os.PathLike, digests: dict[str, str]) -> list[str]:
    """The Triton rows of `table` that have no digest (a block that is not a preset)."""
    from moetune.runtime.table import DispatchTable

    names, covered = _preset_names(), {k.split(" T=")[0] for k in digests}
    with DispatchTable(table, create=False) as t:
        return [f"[{e.bucket_lo},{e.bucket_hi}] of {e.signature_text}: no digests (not a preset's block)"
                for e in t.entries(backend="triton") if _row_key(e, names) not in covered]


def record(table: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Write the digests of `table`'s winners on this tree; refused while any of its rows is stale (their
    digests would vouch for code the timings were not measured on)."""
    from moetune.runtime.versions import kernel_source_hash

    stale = _stale_rows(table)
    if stale:
        raise RelabelError(f"{table}: {len(stale)} rows were timed on other kernel sources ({'; '.join(stale[:4])}"
                           f"{' …' if len(stale) > 4 else ''}): relabel or re-tune them before recording digests")
    out = Path(path) if path is not None else digests_path(table)
    data = dict(triton=_triton(), kernel_hash=kernel_source_hash("triton"), digests=tree_digests(table))
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return out


def relabel(table: str | os.PathLike, path: str | os.PathLike | None = None) -> list[str]:
    """Move `table`'s Triton rows to this tree's kernel hash when every stale winner's digest equals the
    recorded one. Returns what differs (digest keys, rows without digests); nothing is written then."""
    import dataclasses

    from moetune.runtime.table import DispatchTable
    from moetune.runtime.versions import kernel_source_hash

    path = Path(path) if path is not None else digests_path(table)
    if not path.exists():
        raise RelabelError(f"{path}: no such file (record it on a tree the table is current on: --record)")
    recorded = json.loads(path.read_text())
    if recorded["triton"] != _triton():
        raise RelabelError(f"{path}: digests made with {recorded['triton']}, this is {_triton()}: run where "
                           f"{recorded['triton']} is installed")
    old, now = recorded["digests"], tree_digests(table)
    names = _preset_names()
    stale = {_row_key(e, names) for e in _stale_entries(table)}  # a row re-timed on this tree is current
    differ = sorted(k for k in old.keys() | now.keys()
                    if k.split(" T=")[0] in stale and old.get(k) != now.get(k))
    differ += _uncovered_rows(table, now)
    if differ:
        return differ
    current = kernel_source_hash("triton")
    with DispatchTable(table) as t:
        for e in t.entries(backend="triton"):
            if e.versions.kernel_hash != current:
                t.put(dataclasses.replace(e, versions=dataclasses.replace(e.versions, kernel_hash=current)),
                      replace=True)
    path.write_text(json.dumps(dict(recorded, kernel_hash=current), indent=1, sort_keys=True) + "\n")
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.codegen.relabel", description=__doc__.split("\n")[0])
    ap.add_argument("table", help="a Triton dispatch table, e.g. cache/h200.sqlite")
    ap.add_argument("--digests", help="the digests file (default: beside the table, <name>.digests.json)")
    ap.add_argument("--record", action="store_true", help="write the digests of the table's winners on this tree")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported: compiled, not interpreted
    try:
        if args.record:
            print(f"digests of {args.table} written to {record(args.table, args.digests)}")
            return 0
        differ = relabel(args.table, args.digests)
    except RelabelError as e:
        print(f"relabel: {e}", file=sys.stderr)
        return 2
    if differ:
        print(f"{args.table}: nothing written; {len(differ)} differ from the recorded digests (re-tune those "
              "entries on the GPU):\n  " + "\n  ".join(differ))
        return 1
    print(f"{args.table}: every stale winner's sm_90 code unchanged; Triton rows on the tree's kernel hash")
    return 0


if __name__ == "__main__":
    sys.exit(main())
