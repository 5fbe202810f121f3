"""The `moetune` command.

Each subcommand's work lives beside the code it drives; this file only parses arguments and
hands them to `run(args)` of the named module (imported on use, so `moetune presets` pulls in
neither Optuna nor Triton).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .ir.errors import MoetuneError


def _source(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--preset", help="a shipped preset (see `moetune presets`)")
    g.add_argument("--config", help="a HuggingFace config.json")
    g.add_argument("--model-dir", help="a HuggingFace model folder (its config.json is read)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moetune", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="the main job: tune a CPU table, compile a tiny model with it, compare")
    p.add_argument("--family", default="qwen3_moe", help="tiny transformers family (see moetune.tiny)")
    p.add_argument("--budget", default="60s", help="tuning budget for the CPU table")
    p.add_argument("--cache", default=None, help="dispatch table to write (default: cache/cpu-demo.sqlite)")
    p.set_defaults(module="moetune.demo")

    p = sub.add_parser("presets", help="list the shipped presets of real models")
    p.set_defaults(module="moetune.ir.presets")

    p = sub.add_parser("explain", help="print the MoE block IR of a preset, config or model folder")
    _source(p)
    p.add_argument("--passes", action="store_true", help="also print the IR after every pass")
    p.add_argument("--target", default="h200", help="hardware target for the passes' floors")
    p.add_argument("--trace", help="a routing trace from `moetune record` for the statistics")
    p.add_argument("--tokens", default="1-4096", help="token range LO-HI")
    p.set_defaults(module="moetune.ir.explain")

    p = sub.add_parser("record", help="record each MoE layer's routing on the given inputs")
    p.add_argument("--model-dir", help="a HuggingFace model folder")
    p.add_argument("--tiny", help="a tiny offline model family (tests, demos)")
    p.add_argument("--prompts", help="a text file, one prompt per line (needs a tokenizer in --model-dir)")
    p.add_argument("--steps", type=int, default=8, help="decode steps to record after the prompt")
    p.add_argument("-o", "--output", required=True, help="trace file to write")
    p.set_defaults(module="moetune.passes.trace")

    p = sub.add_parser("tune", help="tune a dispatch table for a preset or config on this machine")
    _source(p, required=False)
    p.add_argument("--tiny", help="the block of a tiny offline model family (demos, tests); "
                                  "one source is needed")
    p.add_argument("--tokens", default="1-1024")
    p.add_argument("--trace")
    p.add_argument("--budget", default="10m",
                   help="search budget shared by the buckets, e.g. 90s, 10m; every bucket still times "
                        "its default and a first batch of candidates, so a budget below ~10 s per bucket "
                        "is exceeded")
    p.add_argument("--cache", default=None, help="dispatch table file (default: cache/<target>.sqlite)")
    p.add_argument("--storage", default=None, help="Optuna storage URL or journal file shared by workers")
    p.add_argument("--backend", default=None, help="torch | triton (default: the best available here)")
    p.add_argument("--dtype", default=None, help="weight dtype (default: the preset's)")
    p.add_argument("--target", default=None, help="target for the floors (default: cpu, or the GPU's)")
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
                        "and re-timed with the current kernels beside the defaults (and its neighbours' winners), "
                        "the best kept (after a kernel change that should not move the timings)")
    p.add_argument("--at-tokens", default=None,
                   help="e.g. 256,512: tune only the buckets (of the whole --tokens range) that hold these "
                        "token counts, whatever the table holds for them (a targeted re-tune)")
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
    p.set_defaults(module="moetune.search.cli")

    p = sub.add_parser("show", help="list a dispatch table's contents")
    p.add_argument("path")
    p.set_defaults(module="moetune.runtime.table", action="show")

    p = sub.add_parser("merge", help="merge dispatch tables, keeping the faster entry of each key")
    p.add_argument("inputs", nargs="+")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(module="moetune.runtime.table", action="merge")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        mod = importlib.import_module(args.module)
        return int(mod.run(args) or 0)
    except MoetuneError as e:
        print(f"moetune {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
