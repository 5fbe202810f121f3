"""One decode step of a real transformers MoE model, its experts run by transformers or by moetune.

The kernels bench times the experts block alone. This times what a user's decode step pays: the real
model class of a preset (`moetune.ir.presets`) built from its config with `--layers` decoder layers,
random bf16 weights, a small vocabulary (`--vocab`: the LM head is not what is compared), T sequences of
one new token each (`use_cache=False`: no KV cache, so attention is a small part of the step), timed
four ways per T:

    transformers          the model as built: transformers' default experts function (grouped_mm)
    transformers+graph    the same forward captured once in a CUDA graph and replayed
    moetune               after `moetune.compile(model, cache=--cache)`: eager (no_grad)
    moetune+graph         moetune's forward captured in a CUDA graph and replayed

Each figure is the median over `--reps` steps of wall time per step (eager: host-launched, one sync per
step; graph: replays timed with CUDA events), µs; per layer = step / layers. No L2 flush: consecutive
steps, as in serving. Before timing, moetune's logits are checked against transformers' on the same
input (bf16 both: ‖a − b‖ / ‖b‖), and both against the same model run in float32: random routers make
near-ties in top-k, so bf16 rounding alone can send a token to another expert in a later layer; the
float32 columns show how far transformers' own bf16 run is. A forward that cannot be captured is
reported with the reason.

    python bench/decode_step.py --preset qwen3-30b-a3b --layers 2 --tokens 1,8,64 --out DIR
    python bench/decode_step.py --family qwen3_moe --tokens 1,3     # a tiny model (moetune.testing), CPU too
    ... --dtype bfloat16                                            # the weights' dtype (default below)

Writes DIR/decode-step.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moetune  # noqa: E402
from moetune.ir.presets import PRESETS  # noqa: E402


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


def eager_us(step, reps: int, sync) -> float:
    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def graph_us(step, reps: int) -> tuple[float | None, str]:
    """Median µs of a CUDA-graph replay of `step`, or (None, why it could not be captured)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
    except Exception as e:  # noqa: BLE001 - reported, not hidden: the row says why
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times), ""


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cache = args.cache if args.cache is not None else ("cache/h200.sqlite" if cuda else "")
    dtype = getattr(torch, args.dtype or ("float32" if args.family and not cuda else "bfloat16"))
    if args.family:
        from moetune.testing import build

        model, what = build(args.family, dtype=dtype).to(dev), args.family
        layers = model.config.num_hidden_layers
    else:
        what = args.preset or "qwen3-30b-a3b"
        model, layers = build_preset(what, args.layers, args.vocab, dev, dtype=dtype), args.layers
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.randint(0, vocab, (T, 1), generator=gen).to(dev)

        def step(ids=ids):
            with torch.no_grad():
                return model(input_ids=ids, use_cache=False).logits

        moetune.uncompile(model)
        ref = step().float()
        model.float()  # the float32 reference of the same weights (bf16 -> fp32 -> bf16 is exact)
        ref32 = step().float()
        model.to(dtype)
        row_err = {"transformers_rel_err_fp32": ((ref - ref32).norm() / ref32.norm()).item()}
        row = dict(model=what, layers=layers, tokens=T, device=torch.cuda.get_device_name() if cuda else "cpu")
        row["transformers_us"] = eager_us(step, args.reps, sync)
        if cuda:
            row["transformers_graph_us"], row["transformers_graph_why"] = graph_us(step, args.reps)
        moetune.compile(model, cache=cache or None)
        out = step().float()
        row["logits_rel_err"] = ((out - ref).norm() / ref.norm()).item()
        row.update(row_err, moetune_rel_err_fp32=((out - ref32).norm() / ref32.norm()).item())
        row["moetune_us"] = eager_us(step, args.reps, sync)
        if cuda:
            row["moetune_graph_us"], row["moetune_graph_why"] = graph_us(step, args.reps)
        rows.append(row)
    moetune.uncompile(model)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode-step.json").write_text(json.dumps(rows, indent=1))
    cols = ["transformers_us", "transformers_graph_us", "moetune_us", "moetune_graph_us"]
    print(f"{what}, {layers} layers, {rows[0]['device'] if rows else dev}: µs per step (per layer)")
    print(f"{'T':>5} " + " ".join(f"{c.removesuffix('_us'):>24s}" for c in cols)
          + f" {'vs hf':>9s} {'hf vs fp32':>10s} {'mt vs fp32':>10s}")
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v:11.1f} ({v / layers:9.1f})" if v is not None else f"{'–':>24s}")
        errs = (r["logits_rel_err"], r["transformers_rel_err_fp32"], r["moetune_rel_err_fp32"])
        print(f"{r['tokens']:5d} " + " ".join(f"{c:>24s}" for c in cells) + " {:9.2e} {:10.2e} {:10.2e}".format(*errs))
    for r in rows:
        for k in ("transformers_graph_why", "moetune_graph_why"):
            if r.get(k):
                print(f"T={r['tokens']} {k.removesuffix('_why')}: not captured: {r[k]}")
    return rows


if __name__ == "__main__":
    main()
