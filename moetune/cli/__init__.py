"""The `moetune` command: one module per subcommand, each with its `add_parser` and its `run(args)`.

Subcommand modules import what they drive inside `run`, so `moetune presets` pulls in neither
Optuna nor Triton. A user error exits 2 with one line on stderr: a `MoetuneError` raised by a
subcommand as `moetune <subcommand>: <message>`, a malformed command line as
`moetune: <subcommand>: <message>`.
"""

from __future__ import annotations

import argparse
import sys

from ..ir.errors import MoetuneError
from . import bench, demo, explain, merge, presets, record, show, tune

COMMANDS = (demo, presets, explain, record, tune, bench, show, merge)


class UsageError(Exception):
    """A command line argparse cannot parse; `main` prints it as one line."""


class Parser(argparse.ArgumentParser):
    """argparse, but a parse error is one line (no usage block) and `main` returns 2 for it."""

    def error(self, message: str) -> None:
        words = self.prog.split()
        where = f"{words[-1]}: " if len(words) > 1 else ""
        raise UsageError(f"moetune: {where}{' '.join(message.split())}")

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra:  # left over by a subcommand: name it
            where = f"{ns.command}: " if getattr(ns, "command", None) else ""
            raise UsageError(f"moetune: {where}unrecognized arguments: {' '.join(extra)}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="moetune", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in COMMANDS:
        mod.add_parser(sub).set_defaults(run=mod.run)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # as given: what `tune --devices` hands on
    try:
        return int(args.run(args) or 0)
    except MoetuneError as e:
        print(f"moetune {args.command}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
