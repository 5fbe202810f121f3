"""`python -m bench decode --mode step` (`bench.decode`'s module doc): one decode step of a preset's first layers
without a KV cache, T sequences of one token, timed by the package's timer, against the experts' floor.
"""

from __future__ import annotations

import json

import torch

from bench.cells import TARGET
from bench.models import build_preset
from moetune.ir.presets import preset
from moetune.passes.roofline import floor
from moetune.search.timing import Case, CpuTimer, CudaGraphTimer, NotCapturable


def timed(step, ids: torch.Tensor, reps: int) -> dict:
    """{eager: host-launched µs, graph: replay µs or None, why: why not captured} of `step(ids)`."""
    fn = lambda x, *_: step(x)
    case = [Case(ids, ids, ids, None)]  # the timer's (x, ids, weights, w): here only the input ids
    if ids.device.type != "cuda":
        return dict(eager=CpuTimer(warmup=2, reps=max(3, reps), max_time_s=30.0, threads=None)(fn, case).median_s
                    * 1e6, graph=None, why="")
    timer = CudaGraphTimer(reps=reps, warmup=3, flush_bytes=0)
    try:
        t = timer(fn, case)
    except NotCapturable as e:
        return dict(eager=timer.host_launched(fn, case) * 1e6, graph=None, why=str(e).splitlines()[0][:200])
    return dict(eager=t.host_median_s * 1e6, graph=t.median_s * 1e6, why="")


def steps(args) -> list[dict]:
    """Time every T of `args` (add_arguments' options); the rows, also written to --out and printed."""
    import moetune

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    cache = args.cache if args.cache is not None else ("cache" if cuda else "")
    dtype = getattr(torch, args.dtype or ("float32" if args.family and not cuda else "bfloat16"))
    if args.family:
        from moetune.testing import build

        model, what = build(args.family, dtype=dtype).to(dev), args.family
        layers, block = model.config.num_hidden_layers, None
    else:
        what, layers = args.preset or "qwen3-30b-a3b", args.layers or 2
        model = build_preset(what, layers, args.vocab or 1024, dev, dtype=dtype)
        block = preset(what)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.randint(0, vocab, (T, 1), generator=gen).to(dev)

        def step(x):
            with torch.no_grad():
                return model(input_ids=x, use_cache=False).logits

        moetune.uncompile(model)
        ref = step(ids).float()
        model.float()  # the float32 reference of the same weights (bf16 -> fp32 -> bf16 is exact)
        ref32 = step(ids).float()
        model.to(dtype)
        row = dict(model=what, layers=layers, tokens=T, device=torch.cuda.get_device_name() if cuda else "cpu",
                   transformers_rel_err_fp32=((ref - ref32).norm() / ref32.norm()).item())
        if block is not None:
            row["experts_floor_us_per_layer"] = floor(block, TARGET, T).time_s * 1e6
        t = timed(step, ids, args.reps)
        row.update(transformers_us=t["eager"], transformers_graph_us=t["graph"], transformers_graph_why=t["why"])
        moetune.compile(model, cache=cache or None)
        out = step(ids).float()
        row["logits_rel_err"] = ((out - ref).norm() / ref.norm()).item()
        row["moetune_rel_err_fp32"] = ((out - ref32).norm() / ref32.norm()).item()
        t = timed(step, ids, args.reps)
        row.update(moetune_us=t["eager"], moetune_graph_us=t["graph"], moetune_graph_why=t["why"])
        rows.append(row)
    moetune.uncompile(model)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode-step.json").write_text(json.dumps(rows, indent=1))
    report(rows, what, layers, dev)
    return rows


def report(rows: list[dict], what: str, layers: int, dev: str) -> None:
    cols = ["transformers_us", "transformers_graph_us", "moetune_us", "moetune_graph_us"]
    print(f"{what}, {layers} layers, {rows[0]['device'] if rows else dev}: µs per step (per layer)")
    print(f"{'T':>5} " + " ".join(f"{c.removesuffix('_us'):>24s}" for c in cols)
          + f" {'floor/layer':>11s} {'vs hf':>9s} {'hf vs fp32':>10s} {'mt vs fp32':>10s}")
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v:11.1f} ({v / layers:9.1f})" if v is not None else f"{'–':>24s}")
        fl = r.get("experts_floor_us_per_layer")
        errs = (r["logits_rel_err"], r["transformers_rel_err_fp32"], r["moetune_rel_err_fp32"])
        print(f"{r['tokens']:5d} " + " ".join(f"{c:>24s}" for c in cells) + (f" {fl:11.1f}" if fl else f" {'–':>11s}")
              + " {:9.2e} {:10.2e} {:10.2e}".format(*errs))
    for r in rows:
        for k in ("transformers_graph_why", "moetune_graph_why"):
            if r.get(k):
                print(f"T={r['tokens']} {k.removesuffix('_why')}: not captured: {r[k]}")
