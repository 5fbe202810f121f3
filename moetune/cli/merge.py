"""`moetune merge A B … -o OUT`: the faster entry of each key (one timed on this tree's kernel sources over a
stale one); where entries overlap, the newer splits the older around itself, and a current one the stale
ones, so every token count covered stays covered (moetune.runtime.merge). OUT is
replaced only once the merge is complete. Prints what was read, what OUT holds, and the merged table."""

from __future__ import annotations

import argparse

from .common import existing_file, writable_file
from .show import show


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("merge", help="merge dispatch tables, keeping the faster entry of each key (current over stale)")
    p.add_argument("inputs", nargs="+", help="dispatch tables to read")
    p.add_argument("-o", "--output", required=True, help="dispatch table to write (created if missing)")
    return p


def run(args: argparse.Namespace) -> int:
    from ..runtime.merge import merge

    for path in args.inputs:
        existing_file(path, "TABLE", "a dispatch table written by `moetune tune`")
    writable_file(args.output, "-o")
    m = merge(args.inputs, args.output)
    fates = [f"{n} {what}" for n, what in ((m.trimmed, "trimmed around newer entries that overlap them"),
                                           (m.replaced, "replaced by a faster entry of their bucket or newer "
                                                        "entries over all of it")) if n]
    print(f"merged {len(args.inputs)} table(s) into {args.output}: {m.read} entries read"
          + (f" (and {m.held} it held)" if m.held else "") + f", it holds {m.rows}"
          + (f"; of those read, {', '.join(fates)}" if fates else ""))
    print(show(args.output))
    return 0
