"""`moetune presets`: the shipped presets of real models, one line each."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser("presets", help="list the shipped presets of real models")


def run(args: argparse.Namespace) -> int:
    from ..ir.presets import table

    print("\n".join(table()))
    print("\nexpert bytes: 3·D·F weights (+ biases) of one expert in the preset's weight format (block scales "
          "included); `moetune explain --preset NAME` prints a block")
    return 0
