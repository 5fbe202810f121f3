"""decode: one decode step of a real transformers MoE model, its experts run by transformers or by moetune.

The kernels suite times the expert block alone; this times what a user's decode step pays. The real model
class of a preset (`moetune.ir.presets`) is built from its config with `--layers` MoE decoder layers, random
weights, a small vocabulary (`--vocab`: the LM head is not what is compared), and T sequences of one new
token each (`use_cache=False`: no KV cache, so attention is a small part of the step). Per T:

    transformers          the model as built (transformers' default experts function), host-launched
    transformers+graph    the same forward in a CUDA graph, replayed
    moetune               after `moetune.compile(model, cache=--cache)`, host-launched
    moetune+graph         moetune's forward in a CUDA graph, replayed

Timed by the package's timer (`moetune.search.timing`: on a GPU one graph, replays timed with CUDA events,
and the host-launched median; on the CPU the host timer) without its L2 flush: consecutive steps, as in
serving. µs per step, and per layer beside the experts' roofline floor per layer
(`moetune.passes.targets.floor` on the h200 target). Before timing, moetune's logits are compared with
transformers' (‖a − b‖ / ‖b‖), and both with the same model run in float32: random routers make near-ties in
top-k, so bf16 rounding alone sends some tokens to other experts in later layers. A forward that cannot be
captured is reported with the reason.

    python -m bench decode --preset qwen3-30b-a3b --layers 4 --tokens 1,8,64 --out DIR
    python -m bench decode --family qwen3_moe --tokens 1,3      # a tiny model (moetune.testing), CPU too

Writes DIR/decode-step.json and prints a table last.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moetune.ir.presets import PRESETS, preset
from moetune.passes.targets import floor
from moetune.search.timing import Case, CpuTimer, CudaGraphTimer, NotCapturable


def build_preset(name: str, layers: int, vocab: int, device: str, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The preset's real model class with `layers` MoE decoder layers, random weights in `dtype`, eval."""
    import transformers

    cfg = {k: v for k, v in PRESETS[name].items() if k not in ("model_type", "dtype")}
    cfg.update(num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=False)
    if "first_k_dense_replace" in cfg:  # every timed layer an MoE layer
        cfg["first_k_dense_replace"] = 0
    config = transformers.AutoConfig.for_model(PRESETS[name]["model_type"], **cfg)
    if getattr(config, "text_config", None) is not None:  # a multimodal config: its text model alone
        config = type(config.text_config)(**cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for m in model.modules():  # a zero correction bias at init would route every token alike
        if hasattr(m, "e_score_correction_bias"):
            with torch.no_grad():
                m.e_score_correction_bias.copy_(torch.randn_like(m.e_score_correction_bias) * 0.1)
    return model.eval()


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


def add_arguments(ap) -> None:
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help=f"one of {', '.join(PRESETS)} (default qwen3-30b-a3b)")
    src.add_argument("--family", default=None, help="a tiny model family of moetune.testing instead")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="the weights' dtype (default: bfloat16, float32 for --family on the CPU)")
    ap.add_argument("--cache", default=None, help="moetune's dispatch table (default: cache/h200.sqlite on a "
                    "GPU, none on the CPU; '' for none)")
    ap.add_argument("--out", type=Path, default=None)


def run(args) -> int:
    steps(args)
    return 0


def steps(args) -> list[dict]:
    """Time every T of `args` (add_arguments' options); the rows, also written to --out and printed."""
    import moetune

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    cache = args.cache if args.cache is not None else ("cache/h200.sqlite" if cuda else "")
    dtype = getattr(torch, args.dtype or ("float32" if args.family and not cuda else "bfloat16"))
    if args.family:
        from moetune.testing import build

        model, what = build(args.family, dtype=dtype).to(dev), args.family
        layers, block = model.config.num_hidden_layers, None
    else:
        what = args.preset or "qwen3-30b-a3b"
        model, layers = build_preset(what, args.layers, args.vocab, dev, dtype=dtype), args.layers
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
            row["experts_floor_us_per_layer"] = floor(block, "h200", T).time_s * 1e6
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
