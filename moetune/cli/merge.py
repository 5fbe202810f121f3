"""`moetune merge A B … -o OUT`: the faster entry of each key; a bucket split in one table and whole in
the other keeps the newer tuning (moetune.runtime.table.merge). Prints the merged table."""

from __future__ import annotations

import argparse

from .common import existing_file, writable_file
from .show import show


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("merge", help="merge dispatch tables, keeping the faster entry of each key")
    p.add_argument("inputs", nargs="+", help="dispatch tables to read")
    p.add_argument("-o", "--output", required=True, help="dispatch table to write (created if missing)")
    return p


def run(args: argparse.Namespace) -> int:
    from ..runtime.table import merge

    for path in args.inputs:
        existing_file(path, "TABLE", "a dispatch table written by `moetune tune`")
    writable_file(args.output, "-o")
    read, written, dropped = merge(args.inputs, args.output)
    print(f"merged {len(args.inputs)} table(s) into {args.output}: {read} entries read, {written} written"
          + (f", {dropped} dropped (overlapped by newer entries of the same versions)" if dropped else ""))
    print(show(args.output))
    return 0
