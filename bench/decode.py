"""decode: a real transformers MoE model decoding, its experts run by transformers or by moetune.

The kernels suite times the expert block alone; this times what a user serving the model pays. Two modes.

`--mode generate` (the default): end-to-end greedy generation. The real model class of a preset
(`moetune.ir.presets`) is built from its config with random weights on the device: bf16, or with
`--weights fp8` its experts turned into transformers' own FP8Experts (behind its FP8 experts hook, as its FP8
loading builds them: `moetune.testing.fp8`), the bf16 weights quantised per 128×128 block. Its first `--layers`
decoder layers (default: as many as `--mem-gb` holds, `fit_layers`; the output says "first N of M layers"),
the real vocabulary unless `--vocab` shrinks it. `--prompt` random tokens per sequence, `--new` new tokens,
per batch size of `--batch`, through transformers' own `generate` with a static KV cache
(`cache_implementation="static"`) and its compile config (`--compile`, default `reduce-overhead` on a GPU:
transformers compiles the decode steps' forward, prefill stays eager; `none` on the CPU). Variants:

    transformers:<impl>   each of transformers' experts implementations in `--impls`, named by what runs
                          in the decode steps ("default": the model as built, grouped_mm, which `generate`
                          swaps for batched_mm in the decode steps on a GPU; "grouped_mm": grouped_mm kept
                          for the decode steps too); the fastest at a batch size is the baseline (a)
    moetune               after `moetune.compile(model, cache=--cache)`, the same generate and compile

Per (variant, batch), after `--warmup` generations (compilation and graph recording excluded), `--timed`
generations: prefill ms (from the `generate` call to its first logits), decode ms per step (the median of the
intervals between consecutive steps' logits, CUDA events on a GPU), tokens/s = batch / (ms per step).
Each variant runs in a process of its own (`--isolate`, the default on a GPU; `--variants` picks them and their
order), as a user's job would: in one process, what a variant compiled, recorded and allocated stays behind for the
next (bench/README.md measures the difference); without it, compilation state is still reset between variants.

MoE share: `--profile-steps` decode steps of one more, uncompiled generation run under `torch.profiler`, each
experts module's call inside a `record_function` scope opened and closed by forward (pre-)hooks, which exist
only for that run: the scopes are gone inside a compiled graph, and kernels replayed from a CUDA graph cannot
be traced to a module. MoE µs per step is the device time of the kernels launched inside the scopes (CPU time
on the CPU); the share is that over the timed decode step, and `moe_share_kernels` over all kernels of the
profiled steps. moetune's experts are one opaque op, so its kernels are the compiled step's own; transformers'
experts run unfused in that run, their eager kernels.

Token check: the greedy tokens of moetune and of the baseline at each batch, compared position by position: the
first decode step at which a sequence differs, and there the largest |Δlogit| between the two and the
baseline's top-2 margin (how near a tie the reference was), or "identical over N tokens".

`--mode step`: one decode step (`use_cache=False`, no KV cache) of `--layers` MoE layers and a small vocabulary,
T sequences of one token each (`--tokens`), timed by the package's timer (`moetune.search.timing`: on a GPU one
graph, replays timed with CUDA events, and the host-launched median; on the CPU the host timer) without its L2
flush; µs per step and per layer beside the experts' floor per layer (`moetune.targets.floor`, this
target), moetune's logits against transformers' and both against float32:

    transformers          the model as built (transformers' default experts function), host-launched
    transformers+graph    the same forward in a CUDA graph, replayed
    moetune               after `moetune.compile(model, cache=--cache)`, host-launched
    moetune+graph         moetune's forward in a CUDA graph, replayed

    python -m bench decode --preset qwen3-30b-a3b --batch 1,4,16,64 --out DIR
    python -m bench decode --preset qwen3-30b-a3b --weights fp8 --hf-fp8-kernel DIR2 --out DIR
    python -m bench decode --family qwen3_moe --prompt 8 --new 4 --batch 1,2      # a tiny model, CPU too
    python -m bench decode --mode step --preset qwen3-30b-a3b --layers 4 --tokens 1,8,64 --out DIR

Writes DIR/decode.json (generate) or DIR/decode-step.json (step) and prints a table last;
`readme_table(paths)` renders tokens/s of whole models from decode.json files as markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.cells import TARGET
from bench.decode_step import steps
from bench.models import (
    FP8_BLOCK,
    KEPT_GROUPED_MM,
    build_preset,
    fit_layers,
    fp8_experts,
    generate_once,
    generation_config,
    impl_name,
    preset_config,
    register_kept_grouped_mm,
    reset_compile,
)
from bench.profiling import ExpertsOff, compiled_kernels, profile_moe
from moetune.ir.presets import PRESETS, preset
from moetune.passes.roofline import floor

# ------------------------------------------------------------------------------------ generation --


def first_divergence(ref: dict, other: dict) -> dict:
    """Where the greedy tokens of `other` first leave those of `ref` (each a `generate_once` result of the same
    prompts): {identical, tokens} and, where they differ, the decode step (0-based), the sequence, both tokens,
    how many sequences differ, and with both runs' logits the largest |Δlogit| there and `ref`'s top-2 margin."""
    a, b = ref["sequences"], other["sequences"]  # [B, new]
    out = dict(tokens=a.numel(), identical=bool(torch.equal(a, b)))
    if out["identical"]:
        return out
    diff = a != b
    first = torch.where(diff.any(1), diff.int().argmax(1), torch.full((a.shape[0],), a.shape[1]))  # [B]
    row = int(first.argmin())
    step = int(first[row])
    out.update(step=step, row=row, ref_token=int(a[row, step]), token=int(b[row, step]),
               sequences_differing=int(diff.any(1).sum()))
    if ref.get("logits") is not None and other.get("logits") is not None:
        la, lb = ref["logits"][step, row].float(), other["logits"][step, row].float()  # [V]
        top = la.topk(2).values
        out.update(max_abs_dlogit=float((la - lb).abs().max()), ref_top2_margin=float(top[0] - top[1]))
    return out


def _label(variant: str, impl: str | None) -> str:
    return variant if impl is None else f"{variant}:{impl_name(impl)}"


def _say(t0: float):
    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:6.1f}s] {msg}", flush=True)
    return say


def _model(args, dev: str, batches: list[int], say) -> tuple[torch.nn.Module, dict] | None:
    """The model of `args` on `dev` and what the results say of it: {model, layers, layers_of, weights, fit,
    block (the preset's MoEBlock, None for a tiny family), hf_fp8_kernel}; None when not one layer fits."""
    weights, name = args.weights, args.preset or "qwen3-30b-a3b"
    if name.endswith("-fp8"):
        weights, name = "fp8", name.removesuffix("-fp8")
    info: dict = dict(weights=weights, fit=None)
    if args.family:
        from moetune.testing import build

        model = build(args.family, dtype=getattr(torch, args.dtype or "bfloat16")).to(dev)
        info.update(model=args.family, block=None, layers=model.config.num_hidden_layers,
                    layers_of=model.config.num_hidden_layers)
    else:
        info.update(model=name, block=preset(f"{name}-fp8" if weights == "fp8" and f"{name}-fp8" in PRESETS
                                             else name))
        info["layers_of"] = preset_config(name, None, args.vocab).num_hidden_layers
        layers = args.layers
        if layers is None:
            vocab = args.vocab or preset_config(name, 1, None).vocab_size
            mem_gb = min(args.mem_gb, torch.cuda.mem_get_info()[0] / 2**30) if dev == "cuda" else args.mem_gb
            fit = info["fit"] = fit_layers(name, args.vocab, mem_gb, max(batches), args.prompt + args.new,
                                           fp8=weights == "fp8", logits_bytes=max(batches) * args.new * vocab * 4)
            layers = fit["layers"]
            if layers == 0:
                print(f"python -m bench decode: not one layer of {name} fits {mem_gb:.1f} GiB (--mem-gb, or the "
                      f"device's free memory) "
                      f"({fit['bytes'] / 2**30:.1f} GiB without layers); raise --mem-gb or give --layers",
                      file=sys.stderr)
                return None
        info["layers"] = layers
        say(f"building {name}: first {layers} of {info['layers_of']} layers, {weights}, on {dev}"
            + (f" (estimate {info['fit']['bytes'] / 2**30:.1f} of {info['fit']['budget'] / 2**30:.1f} GiB)"
               if info["fit"] else ""))
        model = build_preset(name, layers, args.vocab, dev, moe_only=False)
    if weights == "fp8":  # a tiny family's sizes are no multiple of 128: blocks of 8
        fp8_experts(model, FP8_BLOCK if info["block"] is not None else (8, 8))
        if args.hf_fp8_kernel:
            from bench.baselines import use_fp8_kernel_source

            info["hf_fp8_kernel"] = use_fp8_kernel_source(args.hf_fp8_kernel)
        elif dev == "cpu":  # transformers' FP8 experts call the hub's GPU kernel: on the CPU, a dequantising one
            from transformers.integrations import finegrained_fp8 as f8

            from moetune.testing.fp8 import dequantizing_fp8_kernel

            f8._FINEGRAINED_FP8 = dequantizing_fp8_kernel()
            info["hf_fp8_kernel"] = "moetune.testing.fp8.dequantizing_fp8_kernel (CPU)"
    return model, info


def measure(model: torch.nn.Module, ids: torch.Tensor, new: int, mode: str, *, warmup: int, timed: int,
            profile_steps: int, keep_logits: bool, kernels: int = 0) -> tuple[dict, dict]:
    """One variant at one batch (`ids` [B, prompt]): `warmup` untimed generations, `timed` timed ones, then the
    profiled run. Returns (its row of the results, {sequences, logits} of the last timed generation)."""
    cuda = ids.device.type == "cuda"
    for _ in range(warmup):
        generate_once(model, ids, generation_config(new, mode, cuda))
    runs = [generate_once(model, ids, generation_config(new, mode, cuda, keep_logits and i == timed - 1))
            for i in range(timed)]
    steps_ms = [s for r in runs for s in r["steps_ms"]]
    ms = statistics.median(steps_ms)
    b = ids.shape[0]
    row = dict(decode_impl=impl_name(runs[-1]["decode_impl"]), batch=b,
               prefill_ms=statistics.median(r["prefill_ms"] for r in runs), ms_per_step=ms,
               step_ms_min=min(steps_ms), step_ms_max=max(steps_ms), decode_steps=len(steps_ms),
               tokens_per_s=b / ms * 1e3)
    if kernels and cuda:
        row["compiled"] = compiled_kernels(model, ids, new, mode, max(profile_steps, 1), kernels)
    if profile_steps:
        p = profile_moe(model, ids, profile_steps)
        row.update(moe_us_per_step=p["moe_us"], kernels_us_per_step=p["kernels_us"],
                   moe_share_kernels=p["moe_us"] / max(p["kernels_us"], 1e-9), profiled_steps=profile_steps,
                   profiled_scopes=p["scopes"])
    return row, dict(sequences=runs[-1]["sequences"], logits=runs[-1]["logits"])


def generation(args) -> dict:
    """The generate mode of `args` (add_arguments' options): the results, also written to --out/decode.json and
    printed ({} when the model does not fit)."""
    import transformers

    import moetune
    from moetune.runtime.compiled import plans
    from moetune.testing import moe_blocks

    transformers.logging.set_verbosity_error()
    say = _say(time.time())
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    mode = args.compile or ("reduce-overhead" if cuda else "none")
    cache = args.cache if args.cache is not None else ("cache" if cuda else "")
    batches = [int(b) for b in args.batch.split(",")]
    warmup, steps = (1, min(args.profile_steps, 2)) if args.quick else (args.warmup, args.profile_steps)
    built = _model(args, dev, batches, say)
    if built is None:
        return {}
    model, info = built
    block = info.pop("block")
    register_kept_grouped_mm()
    as_built = model.get_experts_implementation()
    vocab = model.config.get_text_config().vocab_size
    moe_layers = sum(1 for _ in moe_blocks(model))
    prompts = torch.randint(0, vocab, (max(batches), args.prompt), generator=torch.Generator().manual_seed(1))
    result = dict(mode="generate", **info, moe_layers=moe_layers, vocab=vocab, prompt=args.prompt, new=args.new,
                  batches=batches, compile=mode, cache=cache or None,
                  device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                  transformers=transformers.__version__, warmup=warmup, timed=args.timed, rows=[], comparison=[])
    runs: dict[tuple[str, int], dict] = {}
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    done: set[str] = set()
    plan = [(v, i) for v in variants(args) for i in (impls if v == "transformers" else [None])]
    for variant, impl in plan:
        off = None
        if variant == "no-experts":
            moetune.uncompile(model)
            model.set_experts_implementation(as_built)
            off = ExpertsOff(model).__enter__()
        elif variant == "moetune":
            moetune.compile(model, cache=cache or None)
            left = [c.reason for c in model._moetune_state.captured if c.block is None]
            result.update(moetune_plans=len(plans(model)), moetune_left=left)
            if not plans(model):
                say(f"moetune: no MoE block captured ({left[0] if left else 'none found'}); not timed")
                result["rows"].append(dict(variant="moetune", batch=None, error="no MoE block captured"))
                break
        else:
            moetune.uncompile(model)
            if impl != "default" and _label(variant, impl) in done:
                say(f"{_label(variant, impl)}: measured already (as the default), skipped")
                continue
            model.set_experts_implementation({"default": as_built, "grouped_mm": KEPT_GROUPED_MM}.get(impl, impl))
        reset_compile(model)
        label = None
        for b in batches:
            try:
                row, run = measure(model, prompts[:b].to(dev), args.new, mode, warmup=warmup, timed=args.timed,
                                   profile_steps=0 if off else steps,
                                   keep_logits=not off and b * args.new * vocab * 4 <= args.compare_gb * 2**30,
                                   kernels=args.kernels)
            except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded, the others still run
                row = dict(variant=label or _label(variant, impl), batch=b, error=f"{type(exc).__name__}: {exc}"[:400])
                result["rows"].append(row)
                say(f"{row['variant']} batch {b}: failed: {row['error']}")
                if cuda:
                    torch.cuda.empty_cache()
                continue
            label = label or (variant if variant != "transformers" else f"transformers:{row['decode_impl']}")
            result["rows"].append(dict(variant=label, requested=impl or "moetune", **row))
            if block is not None:
                result["rows"][-1].update(moe_floor_us=moe_layers * floor(block, TARGET, b).time_s * 1e6,
                                          floor_target=TARGET)
            runs[(label, b)] = run
            say(f"{label:28s} batch {b:4d}: prefill {row['prefill_ms']:8.2f} ms, {row['ms_per_step']:8.3f} ms/step, "
                f"{row['tokens_per_s']:9.1f} tok/s" + (f", MoE {row['moe_us_per_step']:8.1f} µs/step (profile)"
                                                       if "moe_us_per_step" in row else ""))
            if "compiled" in row:
                c = row["compiled"]
                top = "; ".join(f"{k['name'][:48]} ×{k['calls']:g} {k['us']:.1f}" for k in c["kernels"])
                say(f"{label} batch {b}: compiled step's kernels {c['kernels_us']:.1f} µs, busy {c['busy_us']:.1f} µs "
                    f"of {row['ms_per_step'] * 1e3:.1f}; {top}")
                gaps = "; ".join(f"{g['after'][:40]} → {g['before'][:40]} ×{g['count']:g} {g['us']:.1f}"
                                 for g in c["gaps"])
                say(f"{label} batch {b}: idle between kernels {c['idle_us']:.1f} µs a step (profiled); {gaps}")
                say(f"{label} batch {b}: host calls a step: "
                    + ", ".join(f"{n} ×{k:g}" for n, k in c["host_calls"].items()))
        if off:
            off.__exit__(None, None, None)
        done.add(label or _label(variant, impl))
        if cuda:
            torch.cuda.empty_cache()
        _finish(result, runs)
        _write(result, args.out)
    moetune.uncompile(model)
    _finish(result, runs)
    _write(result, args.out, runs if args.keep_runs else None)
    report_generation(result)
    return result


VARIANTS = ("transformers", "moetune", "no-experts")


def variants(args) -> list[str]:
    """The variants of `args` in the order they run (--variants; no-experts only with --ablation)."""
    out = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in out if v not in VARIANTS]
    if bad:
        raise ValueError(f"--variants {args.variants!r}: {', '.join(bad)} not among {', '.join(VARIANTS)}")
    return [v for v in out if args.ablation or v != "no-experts"]


def isolated(args, argv: list[str]) -> dict:
    """The generate mode with each variant in a process of its own (`argv`: this command's arguments after
    `python -m bench`), as a user's job would run it: nothing one variant compiled, recorded or allocated is
    there when the next runs. The children's rows and token runs merged into one result, as `generation` gives."""
    import subprocess
    import tempfile

    say = _say(time.time())
    result, runs = None, {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants(args):
            out = Path(tmp) / v
            cmd = [sys.executable, "-m", "bench", *argv, "--variants", v, "--no-isolate", "--keep-runs",
                   "--out", str(out)]
            say(f"{v}: a process of its own")
            rc = subprocess.run(cmd, check=False).returncode
            if not (out / "decode.json").exists():
                say(f"{v}: its process ended with exit code {rc} and no results")
                continue
            part = json.loads((out / "decode.json").read_text())
            if result is None:
                result = part
            else:
                result["rows"] += part["rows"]
                for k in ("moetune_plans", "moetune_left"):
                    if k in part:
                        result[k] = part[k]
            runs.update(torch.load(out / "runs.pt"))
    if result is None:
        return {}
    result["isolated"] = True
    _finish(result, runs)
    _write(result, args.out)
    report_generation(result)
    return result


def _write(result: dict, out: Path | None, runs: dict | None = None) -> None:
    """decode.json in `out`; with `runs`, each (variant, batch)'s sequences and logits in runs.pt beside it."""
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode.json").write_text(json.dumps(result, indent=1))
        if runs is not None:
            torch.save(runs, out / "runs.pt")


def _finish(result: dict, runs: dict) -> None:
    """The baseline (the fastest transformers variant) per batch, moetune's speed-up over it and the token check."""
    result["comparison"] = []
    for b in result["batches"]:
        rows = [r for r in result["rows"] if r["batch"] == b and "ms_per_step" in r]
        bare = [r for r in rows if r["variant"] == "no-experts"]
        for r in rows:  # the MoE time by ablation: the step less the same step without the experts
            if bare and r["variant"] != "no-experts":
                r["moe_us_ablation"] = (r["ms_per_step"] - bare[0]["ms_per_step"]) * 1e3
                r["moe_share"] = r["moe_us_ablation"] / (r["ms_per_step"] * 1e3)
        hf = [r for r in rows if r["variant"].startswith("transformers")]
        mine = [r for r in rows if r["variant"] == "moetune"]
        if not hf:
            continue
        best = min(hf, key=lambda r: r["ms_per_step"])
        for r in hf:
            r["best_transformers"] = r is best
        for r in mine:
            r["baseline"] = best["variant"]
            r["speedup"] = best["ms_per_step"] / r["ms_per_step"]
            cmp = first_divergence(runs[(best["variant"], b)], runs[("moetune", b)])
            result["comparison"].append(dict(batch=b, ref=best["variant"], other="moetune", **cmp))


def report_generation(result: dict) -> None:
    if not result:
        return
    print(f"{result['model']}: first {result['layers']} of {result['layers_of']} layers, {result['weights']}, "
          f"vocab {result['vocab']}, prompt {result['prompt']}, {result['new']} new tokens, compile "
          f"{result['compile']}, {result['device']}, torch {result['torch']}, transformers {result['transformers']}")
    for c in result["comparison"]:
        if c["identical"]:
            print(f"batch {c['batch']}: moetune's greedy tokens identical to {c['ref']}'s over {c['tokens']} tokens")
        else:
            gap = (f"; there max |Δlogit| {c['max_abs_dlogit']:.3g}, {c['ref']}'s top-2 margin "
                   f"{c['ref_top2_margin']:.3g}" if "max_abs_dlogit" in c else "")
            print(f"batch {c['batch']}: tokens differ first at decode step {c['step']} of sequence {c['row']} "
                  f"({c['ref_token']} vs {c['token']}; {c['sequences_differing']} of {c['batch']} "
                  f"sequences differ){gap}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['variant']} batch {r['batch']}: failed: {r['error']}")
    head = (f"{'model':18s} {'layers':>7s} {'batch':>5s} {'variant':26s} {'ms/step':>9s} {'tokens/s':>10s} "
            f"{'MoE µs/step':>11s} {'MoE share':>9s} {'profiled':>9s} {'vs (a)':>7s}")
    print(head)

    def num(v, width):
        return f"{v:{width}.1f}" if v is not None else f"{'–':>{width}s}"

    for r in result["rows"]:
        if "ms_per_step" not in r:
            continue
        share = r.get("moe_share")
        speed = r.get("speedup")
        best = "*" if r.get("best_transformers") else ""
        print(f"{result['model']:18s} {result['layers']:>3d}/{result['layers_of']:<3d} {r['batch']:5d} "
              f"{r['variant'] + best:26s} {r['ms_per_step']:9.3f} {r['tokens_per_s']:10.1f} "
              f"{num(r.get('moe_us_ablation'), 11)} {num(None if share is None else 100 * share, 8)}% "
              f"{num(r.get('moe_us_per_step'), 9)}" + (f" {speed:6.2f}×" if speed is not None else f" {'':>7s}"))
    print("(a) = the fastest transformers variant at the batch size (*); MoE µs/step = the step less the no-experts "
          "step (same compile), MoE share = that over the step; profiled = the experts' kernels per step of an "
          "uncompiled, profiled generate")


def _moe_pair(a: dict, m: dict) -> str:
    """The MoE µs per step of two rows by ablation, with the share of each one's step, or "–" where not measured."""
    if "moe_us_ablation" not in a or "moe_us_ablation" not in m:
        return "–"
    if min(a["moe_us_ablation"], m["moe_us_ablation"]) <= 0:  # the step no longer than without the experts
        return "not resolved (a step no longer than the no-experts one: host-bound)"
    return (f"{a['moe_us_ablation']:,.0f} ({100 * a['moe_share']:.0f} %) → {m['moe_us_ablation']:,.0f} "
            f"({100 * m['moe_share']:.0f} %), {a['moe_us_ablation'] / max(m['moe_us_ablation'], 1e-9):.1f}×")


def readme_table(paths) -> str:
    """Markdown: tokens/s of whole models per batch size, transformers' fastest experts implementation against
    moetune, from `decode.json` files (generate mode)."""
    lines = ["| model | layers | weights | device | batch | transformers tokens/s (experts) | moetune tokens/s | "
             "speed-up | MoE µs per step, transformers → moetune |", "|---|---|---|---|---|---|---|---|---|"]
    for p in paths:
        res = json.loads(Path(p).read_text())
        for b in res["batches"]:
            rows = [r for r in res["rows"] if r["batch"] == b and "tokens_per_s" in r]
            hf = [r for r in rows if r.get("best_transformers")]
            mine = [r for r in rows if r["variant"] == "moetune"]
            if not hf or not mine:
                continue
            a, m = hf[0], mine[0]
            dev = res.get("device", "").removeprefix("NVIDIA ")
            lines.append(f"| {res['model']} | {res['layers']} of {res['layers_of']} | {res['weights']} | {dev} | {b} | "
                         f"{a['tokens_per_s']:,.0f} ({a['variant'].split(':', 1)[1]}) | {m['tokens_per_s']:,.0f} | "
                         f"{m['speedup']:.2f}× | {_moe_pair(a, m)} |")
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--mode", choices=("generate", "step"), default="generate",
                    help="generate: end-to-end greedy generation (default); step: one decode step without KV cache")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help=f"one of {', '.join(PRESETS)} (default qwen3-30b-a3b)")
    src.add_argument("--family", default=None, help="a tiny model family of moetune.testing instead")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (generate: default as many as --mem-gb holds; step: default 2)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size (generate: default the config's own; step: default 1024)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="the weights' dtype (step; generate with --family; default: bfloat16, float32 for step "
                         "mode's --family on the CPU)")
    ap.add_argument("--cache", default=None, help="moetune's dispatch table or a folder of them (default: cache/, "
                    "whose <target>.sqlite is the GPU's, on a GPU; none on the CPU; '' for none)")
    ap.add_argument("--out", type=Path, default=None)
    g = ap.add_argument_group("generate mode")
    g.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                   help="bf16, or the experts as transformers' FP8Experts (e4m3, a float32 scale per 128×128 block)")
    g.add_argument("--mem-gb", type=float, default=120.0, help="GiB the model, cache and transients may take when "
                   "the depth is picked (no --layers); at most the device's free memory")
    g.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    g.add_argument("--new", type=int, default=128, help="new tokens per sequence")
    g.add_argument("--batch", default="1,4,16,64", help="batch sizes (sequences in flight), comma-separated")
    g.add_argument("--compile", default=None, help="torch.compile mode of the decode steps' forward, or none "
                   "(default reduce-overhead on a GPU, none on the CPU)")
    g.add_argument("--impls", default="default,grouped_mm",
                   help="transformers' experts implementations timed: default (as built; generate's own swap at "
                        "decode), grouped_mm (kept at decode), eager, batched_mm, ...")
    g.add_argument("--warmup", type=int, default=2, help="untimed generations per variant and batch")
    g.add_argument("--timed", type=int, default=1, help="timed generations per variant and batch")
    g.add_argument("--profile-steps", type=int, default=4, help="decode steps profiled for the MoE share (0: none)")
    g.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="on a GPU, also profile the compiled decode steps (the replayed graphs) and keep the N kernels "
                        "that took the most time per step, with the GPU's busy time, the N largest idle gaps between "
                        "kernels (by the kernels either side) and the host's CUDA calls per step (0: not)")
    g.add_argument("--compare-gb", type=float, default=16.0,
                   help="largest logits (GiB, float32, on the host) kept per run for the token check's logit gap")
    g.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True,
                   help="also time each batch with the experts returning zeros (no-experts): a variant's MoE µs per "
                        "step is its step less that one")
    g.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"what is timed, in this order (comma-separated, of {', '.join(VARIANTS)})")
    g.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="each variant in a process of its own (default on a GPU): what one compiled and recorded is "
                        "gone when the next runs")
    g.add_argument("--keep-runs", action="store_true", help=argparse.SUPPRESS)  # an isolated child's token runs
    g.add_argument("--quick", action="store_true", help="1 warm-up generation and at most 2 profiled steps")
    g.add_argument("--hf-fp8-kernel", metavar="DIR",
                   help="transformers' FP8 experts run the finegrained-fp8 kernel from this local copy of its source "
                        "(the folder holding its finegrained_fp8 package) instead of the hub download")
    g.add_argument("--render", nargs="+", metavar="JSON", help="print the markdown tokens/s table of decode.json "
                   "files (readme_table), then exit")
    s = ap.add_argument_group("step mode")
    s.add_argument("--tokens", default="1,8,64")
    s.add_argument("--reps", type=int, default=50)


def run(args) -> int:
    if args.render:
        print(readme_table(args.render))
        return 0
    if args.mode == "step":
        steps(args)
        return 0
    if args.hf_fp8_kernel:
        from bench.baselines import fp8_kernel_package

        try:
            fp8_kernel_package(args.hf_fp8_kernel)
        except FileNotFoundError as e:
            print(f"python -m bench decode: {e}", file=sys.stderr)
            return 2
    try:
        variants(args)
    except ValueError as e:
        print(f"python -m bench decode: {e}", file=sys.stderr)
        return 2
    isolate = args.isolate if args.isolate is not None else torch.cuda.is_available()
    if isolate and not args.render:
        return 0 if isolated(args, sys.argv[1:]) else 1
    return 0 if generation(args) else 1

