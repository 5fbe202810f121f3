"""host: host time of one experts call of a compiled model, by the path it takes (eager decode is host-bound).

A tiny model of the real transformers class (moetune.testing) is compiled: on a CUDA device with the triton
backend, else on the CPU with the torch backend (one thread: steadier). One MoE layer's experts module
is called T tokens at a time, `--reps` calls back to back with one synchronisation at the end; the
figure is wall time per call, the median of `--rounds` rounds in which the paths take turns. The GPU
work of a tiny block is a few µs, so on a GPU this is the host's time per call; on the CPU the torch
kernels' own time is in every row alike, and the differences between rows are the host's.

    op          torch.ops.moetune.experts (what tracers and grad mode run)
    body        the op's body called as a function (what the hook runs instead in eager inference)
    hook        the experts module's forward through transformers' hook (what eager inference runs)
    dispatcher  the plan's Dispatcher alone: bisect on T, then the bucket's kernels
    step        a whole decode step of the model (T sequences, one token each, no KV cache)
    args        a Triton launcher's shared host work (`call_args`) with the kernel's memo warm, as every
                call after the first; args-cold: with an empty memo, as the first call
    route       (CUDA) the routing kernel alone: two torch.empty and one Triton launch, a launch's cost
    …-triton    (CUDA) dispatcher / route / step with every launch through Triton's own dispatch
                (`fn[grid]`), as before moetune.codegen.triton.launch: the direct launch's saving, in the
                same run

    python -m bench host [--family qwen3_moe] [--tokens 1] [--out DIR]
    python -m bench host --tokens 0      # no kernel runs (T = 0 returns at the dispatcher):
                                                  # the paths' own host time, also on a CPU
    python -m bench host --profile 2000  # then cProfile of 2000 dispatcher calls (top 25 by
                                                  # own time; profile.txt in --out)
"""

from __future__ import annotations

import cProfile
import io
import json
import platform
import pstats
import statistics
import time
from pathlib import Path

import torch

import moetune
from moetune.codegen.tensors import ExpertTensors
from moetune.runtime import compiled
from moetune.testing import VOCAB, build


def per_call_us(paths: dict, reps: dict, rounds: int, sync) -> dict[str, float]:
    """Median over rounds of wall µs per call of each path; the paths take turns within each round
    (order rotated), so drift of the machine's speed falls on all of them alike."""
    names = list(paths)
    for n in names:
        for _ in range(20):
            paths[n]()
    sync()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            fn = paths[n]
            t0 = time.perf_counter()
            for _ in range(reps[n]):
                fn()
            sync()
            times[n].append((time.perf_counter() - t0) / reps[n] * 1e6)
    return {n: statistics.median(v) for n, v in times.items()}


def add_arguments(ap) -> None:
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--reps", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--out", type=Path, default=None, help="folder for host-overhead.json")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile N dispatcher calls after")


def run(args) -> int:

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(args.family, dtype=dtype).to(dev)
    moetune.compile(model, backend="triton" if cuda else "torch")
    ex = next(m for m in model.modules() if getattr(m, "_moetune_plan", None) is not None)
    plan = ex._moetune_plan
    b = plan.block
    T = args.tokens
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, b.D, generator=gen).to(dev, dtype)
    ids = (torch.stack([torch.randperm(b.E, generator=gen)[: b.k] for _ in range(T)]) if T
           else torch.zeros(0, b.k, dtype=torch.long)).to(dev)
    wt = torch.rand(T, b.k, generator=gen).to(dev, dtype)
    bias = (ex.gate_up_proj_bias, ex.down_proj_bias) if b.layout.has_bias else (None, None)
    w = ExpertTensors(ex.gate_up_proj, ex.down_proj, *bias)
    step_ids = torch.randint(0, VOCAB, (T, 1), generator=gen).to(dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    paths = {
        "op": lambda: torch.ops.moetune.experts(x, ids, wt, ex.gate_up_proj, ex.down_proj, *bias, plan.id),
        "body": lambda: compiled._run_plan(x, ids, wt, ex.gate_up_proj, ex.down_proj, *bias, plan.id),
        "hook": lambda: ex(x, ids, wt),
        "dispatcher": lambda: plan.dispatcher(x, ids, wt, w),
        "step": lambda: model(input_ids=step_ids, use_cache=False),
    }
    try:  # the Triton launchers' shared host work (pure Python: timed on the CPU too)
        from moetune.codegen.triton import launch, layout, routing
    except ImportError:  # no triton here
        pass
    else:
        memo: dict = {}
        paths["args"] = lambda: layout.call_args(b, x, ids, wt, w, memo)
        paths["args-cold"] = lambda: layout.call_args(b, x, ids, wt, w, {})
        if cuda:  # one Triton launch of moetune's own: the routing kernel (two torch.empty, one launch)
            paths["route"] = lambda: routing.route(ids, b.E)

            def through_triton(fn):  # every launch through Triton's dispatch, as before launch.py
                def call():
                    launch.DIRECT = False
                    try:
                        fn()
                    finally:
                        launch.DIRECT = True
                return call

            paths["dispatcher-triton"] = through_triton(paths["dispatcher"])
            paths["route-triton"] = through_triton(paths["route"])
            paths["step-triton"] = through_triton(paths["step"])
    if T == 0:
        paths = {n: f for n, f in paths.items() if not n.startswith("step")}
    reps = {n: max(args.reps // 20, 20) if n.startswith("step") else args.reps for n in paths}
    rows = []
    for mode in ("no_grad", "inference_mode"):
        with getattr(torch, mode)():
            us = per_call_us(paths, reps, args.rounds, sync)
        rows += [dict(mode=mode, path=n, us=us[n]) for n in paths]
    device = torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()}, " \
        f"{torch.get_num_threads()} threads)"
    rec = dict(device=device, family=args.family, tokens=T, backend=plan.dispatcher.backend.name,
               route=plan.dispatcher.route(T).schedule.describe(), torch=torch.__version__, rows=rows)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host-overhead.json").write_text(json.dumps(rec, indent=1))
    print(f"{device}, {args.family}, T={T}, backend {rec['backend']}: {rec['route']}")
    print(f"{'mode':16s} {'path':18s} {'µs per call':>12s}")
    for r in rows:
        print(f"{r['mode']:16s} {r['path']:18s} {r['us']:12.1f}")
    if args.profile:  # where the dispatcher's host time goes, function by function
        prof = cProfile.Profile()
        with torch.inference_mode():
            prof.enable()
            for _ in range(args.profile):
                paths["dispatcher"]()
            sync()
            prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print(buf.getvalue())
        if args.out:
            (args.out / "profile.txt").write_text(buf.getvalue())
    return 0
