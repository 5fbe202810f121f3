"""`moetune demo`: the main job on a fresh CPU machine, end to end.

1. build a tiny random transformers MoE model from its config (offline) and show what capture finds;
2. tune the torch backend's dispatch table for its MoE block on this CPU (real Optuna studies,
   every candidate checked against the float32 reference) and write it under cache/;
3. compile the model with that table, run it at several sequence lengths and compare the logits
   with the original model's; print the per-bucket dispatch the compiled model uses.
"""

from __future__ import annotations

import argparse
import time

from .common import parse_duration, tiny_model, writable_file


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="the main job: tune a CPU table, compile a tiny model with it, compare")
    p.add_argument("--family", default="qwen3_moe", help="tiny transformers family (see moetune.testing)")
    p.add_argument("--budget", default="60s", help="tuning budget for the CPU table, e.g. 90s, 10m")
    p.add_argument("--cache", default=None, help="dispatch table to write (default: cache/cpu-demo.sqlite)")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import compile as moetune_compile
    from .. import explain, uncompile
    from ..runtime.compiled import describe
    from ..testing import VOCAB
    from . import main

    parse_duration(args.budget, "--budget")
    cache = writable_file(args.cache or "cache/cpu-demo.sqlite", "--cache")
    t0 = time.monotonic()
    model = tiny_model(args.family, name="--family")
    torch.manual_seed(0)

    versions = f"transformers {_version('transformers')}, torch {torch.__version__}"
    print(f"== 1. capture: tiny {args.family} ({versions})")
    captured = explain(model)
    if not any(c.block is not None for c in captured):
        print("no MoE block captured: nothing to tune")
        return 1

    print(f"\n== 2. tune the CPU dispatch table → {cache} (budget {args.budget})")
    rc = main(["tune", "--tiny", args.family, "--tokens", "1-4096", "--budget", args.budget,
               "--cache", str(cache), "--backend", "torch"])
    if rc not in (0, 1):
        return rc

    print(f"\n== 3. compile with {cache} and compare with the original model")
    lengths = (1, 3, 17, 64)
    ids = {s: torch.randint(0, VOCAB, (2, s), generator=torch.Generator().manual_seed(s)) for s in lengths}
    with torch.inference_mode():
        before = {s: model(input_ids=ids[s]).logits for s in lengths}
        moetune_compile(model, cache=str(cache))
        print(describe(model))
        worst = 0.0
        for s in lengths:
            after = model(input_ids=ids[s]).logits
            rel = float((after - before[s]).norm() / before[s].norm())
            worst = max(worst, rel)
            print(f"  batch 2 × {s:>3} tokens (T = {2 * s:>3}): "
                  f"‖compiled − original‖ / ‖original‖ = {rel:.2e}")
        uncompile(model)
    ok = worst <= 1e-5
    print(f"\nlogits {'match' if ok else 'DIFFER'} (fp32, worst relative error {worst:.2e}, limit 1e-5); "
          f"total {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)
