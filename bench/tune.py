"""tune: a short tune of one preset into a scratch dispatch table, through the package's own `moetune tune`.

The tuner (`moetune.search.tune.tune_block`) runs on this machine's backend (triton on a GPU, torch on the
CPU) over the preset's buckets (`moetune.ir.presets`, the passes' bucketing) within `--budget` in all,
compile included, and prints one line per bucket and then its table: each bucket's winner, its time, the
floor (`moetune.targets.floor`), % of floor, the winner against the bucket's default heuristic and
against transformers' baseline, the spread of the final timings. The winners go to DIR/<preset>.sqlite, never
to the shipped cache/; `moetune show --cache DIR/<preset>.sqlite` lists them again.

    python -m bench tune --preset qwen3-30b-a3b --tokens 1-1024 --budget 60s --out DIR
    python -m bench tune --tiny qwen3_moe --tokens 1-8 --budget 10s --out DIR      # a tiny model, CPU too
    python -m bench tune --preset mixtral-8x7b --at-tokens 512,1024 --budget 60s   # only those buckets
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from moetune.ir.presets import PRESETS


def add_arguments(ap) -> None:
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help=f"one of {', '.join(PRESETS)} (default qwen3-30b-a3b)")
    src.add_argument("--tiny", default=None, metavar="FAMILY", help="a tiny model family of moetune.testing")
    ap.add_argument("--tokens", default="1-1024", help="token range LO-HI")
    ap.add_argument("--at-tokens", default=None, help="only the buckets holding these token counts (N,N)")
    ap.add_argument("--budget", default="60s", help="the whole run's budget, e.g. 60s, 5m")
    ap.add_argument("--out", type=Path, default=None, help="folder of the scratch table (default: a temp dir)")


def run(args) -> int:
    from moetune.cli import main

    name = args.tiny or args.preset or "qwen3-30b-a3b"
    out = args.out or Path(tempfile.mkdtemp(prefix="moetune-bench-tune-"))
    out.mkdir(parents=True, exist_ok=True)
    argv = ["tune", "--tiny" if args.tiny else "--preset", name, "--tokens", args.tokens, "--budget", args.budget,
            "--cache", str(out / f"{name}.sqlite")]
    if args.at_tokens:
        argv += ["--at-tokens", args.at_tokens]
    print("moetune " + " ".join(argv), file=sys.stderr, flush=True)
    return main(argv)
