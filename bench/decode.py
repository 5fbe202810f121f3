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
flush; µs per step and per layer beside the experts' floor per layer (`moetune.passes.targets.floor`, this
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

from bench.kernels import TARGET
from moetune.ir.presets import PRESETS, preset
from moetune.passes.targets import floor
from moetune.search.timing import Case, CpuTimer, CudaGraphTimer, NotCapturable

SCOPE = "moetune.bench::experts"  # the profiler scope around each experts call
KEPT_GROUPED_MM = "grouped_mm_kept"  # transformers' grouped_mm under a name generate does not swap at decode
FP8_BLOCK = (128, 128)


def preset_config(name: str, layers: int | None, vocab: int | None, moe_only: bool = True):
    """The transformers config of preset `name` (its `-fp8` twin: the same config) with `layers` decoder layers
    (None: the preset's depth) and `vocab` tokens (None: the config's own vocabulary). `moe_only`: every layer an
    MoE layer (DeepSeek's dense first layers made MoE)."""
    import transformers

    cfg = {k: v for k, v in PRESETS[name].items() if k not in ("model_type", "dtype", "quantization_config")}
    cfg["tie_word_embeddings"] = False
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if vocab is not None:
        cfg["vocab_size"] = vocab
    if moe_only and "first_k_dense_replace" in cfg:
        cfg["first_k_dense_replace"] = 0
    config = transformers.AutoConfig.for_model(PRESETS[name]["model_type"], **cfg)
    if getattr(config, "text_config", None) is not None:  # a multimodal config: its text model alone
        config = type(config.text_config)(**cfg)
    return config


def build_preset(name: str, layers: int | None, vocab: int | None, device: str, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, moe_only: bool = True) -> torch.nn.Module:
    """The preset's real model class with `layers` decoder layers (`preset_config`), random weights in `dtype`,
    eval."""
    import transformers

    config = preset_config(name, layers, vocab, moe_only)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for m in model.modules():  # a zero correction bias at init would route every token alike
        if hasattr(m, "e_score_correction_bias") and m.e_score_correction_bias.device.type != "meta":
            with torch.no_grad():
                m.e_score_correction_bias.copy_(torch.randn_like(m.e_score_correction_bias) * 0.1)
    return model.eval()


# ------------------------------------------------------------------------------- memory and depth --


def _kv_bytes_per_layer(config, batch: int, length: int, elem: int = 2) -> int:
    """A static KV cache layer of `batch` sequences of `length` tokens (keys and values; every layer counted
    as full attention: a bound)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    k_dim = getattr(config, "qk_head_dim", None) or head
    v_dim = getattr(config, "v_head_dim", None) or head
    return batch * length * heads * (k_dim + v_dim) * elem


def model_bytes(name: str, vocab: int | None, moe_only: bool = False) -> tuple[int, list[int]]:
    """(bytes outside the decoder layers, bytes of each decoder layer) of preset `name` at its full depth in
    bf16, counted on the meta device (nothing allocated)."""
    model = build_preset(name, None, vocab, "meta", moe_only=moe_only)
    layers = [0] * model.config.num_hidden_layers
    base = 0
    for pname, p in model.named_parameters():
        parts = pname.split(".")
        i = next((int(parts[j + 1]) for j, s in enumerate(parts[:-1]) if s == "layers" and parts[j + 1].isdigit()),
                 None)
        b = p.numel() * p.element_size()
        if i is None:
            base += b
        else:
            layers[i] += b
    return base, layers


def fit_layers(name: str, vocab: int | None, mem_gb: float, batch: int, length: int, *, fp8: bool = False,
               logits_bytes: int = 0) -> dict:
    """The most leading decoder layers of preset `name` whose model, static KV cache (`batch` × `length`) and
    transients fit `mem_gb` GiB: {layers, of, bytes, budget}. The model is built in bf16 (FP8 experts are
    quantised from it layer by layer, so bf16 bounds the depth for both); transients: the largest layer's
    expert weights gathered once per (token, expert) pair (transformers' batched_mm at `batch`), three copies
    of one layer (the FP8 quantisation's float32 copy), the kept logits and a fixed margin."""
    base, layers = model_bytes(name, vocab)
    config = preset_config(name, None, vocab)
    block = preset(name)
    kv = _kv_bytes_per_layer(config, batch, length)
    gathered = batch * block.k * 3 * block.D * block.F * 2
    transient = max(gathered, 3 * max(layers) if fp8 else 0) + logits_bytes + (4 << 30)
    budget = int(mem_gb * (1 << 30))
    used, n = base + transient, 0
    for b in layers:
        if used + b + kv > budget:
            break
        used, n = used + b + kv, n + 1
    return dict(layers=n, of=len(layers), bytes=used, budget=budget)


# ------------------------------------------------------------------------------------ the models --


def fp8_experts(model: torch.nn.Module, block: tuple[int, int] = FP8_BLOCK) -> torch.nn.Module:
    """`model` with each MoE block's experts replaced, one block at a time (the bf16 weights of one freed before
    the next is quantised), by transformers' FP8Experts holding them quantised per `block` (rows, columns)."""
    from moetune.testing import fp8, moe_blocks

    block_size = block
    for n in [n for n, _ in moe_blocks(model)]:
        block = model.get_submodule(n)
        if hasattr(block.experts, "gate_up_proj") and block.experts.gate_up_proj.dtype != torch.float8_e4m3fn:
            block.experts = fp8.fp8_experts(block.experts, block_size)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return model


def register_kept_grouped_mm() -> None:
    """transformers' grouped_mm experts functions (bf16 and FP8) under KEPT_GROUPED_MM: `generate` swaps only
    the name "grouped_mm" for batched_mm in its decode steps on a GPU."""
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    ExpertsInterface.register(KEPT_GROUPED_MM, grouped_mm_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface, fp8_grouped_mm_experts_forward
    except ImportError:
        return
    FP8ExpertsInterface.register(KEPT_GROUPED_MM, fp8_grouped_mm_experts_forward)


def _impl_name(impl: str) -> str:
    return "grouped_mm" if impl == KEPT_GROUPED_MM else impl


# ------------------------------------------------------------------------------------ generation --


class StepClock:
    """A logits processor that marks each forward of a `generate` call as its logits arrive (a CUDA event on a
    GPU, the host clock on the CPU) and notes the experts implementation the prefill and the first decode step
    ran."""

    def __init__(self, model: torch.nn.Module, cuda: bool):
        self.model, self.cuda = model, cuda
        self.marks: list = []
        self.impls: list[str] = []

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.marks.append(self.mark())
        if len(self.marks) <= 2:  # the prefill's and the decode steps' (one for all of them: host time kept out)
            self.impls.append(",".join(sorted(set(self.model.get_experts_implementation().values()))))
        return scores

    def intervals_ms(self, start) -> list[float]:
        """ms from `start` to the first mark (prefill), then between consecutive marks (decode steps)."""
        marks = [start, *self.marks]
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(marks, marks[1:], strict=False)]
        return [(b - a) * 1e3 for a, b in zip(marks, marks[1:], strict=False)]


class ProfileWindow:
    """A logits processor that runs `prof` over the forwards of decode steps 1..`steps` of a `generate` call
    (started once the prefill's logits are there, stopped once step `steps`' are)."""

    def __init__(self, prof, steps: int, cuda: bool):
        self.prof, self.steps, self.cuda, self.calls, self.running = prof, steps, cuda, 0, False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.cuda:
            torch.cuda.synchronize()  # no prefill kernel in the window, every step's kernel in it
        if self.calls == 1:
            self.prof.start()
            self.running = True
        elif self.calls == self.steps + 1 and self.running:
            self.prof.stop()
            self.running = False
        return scores


def generation_config(new: int, compile_mode: str, cuda: bool, keep_logits: bool = False):
    """Greedy generation of exactly `new` tokens with a static KV cache, the decode steps under transformers'
    compile config (`compile_mode`: a torch.compile mode, or "none"), its dynamic shapes left to torch (a graph for
    the first batch size, one for all others)."""
    from transformers import CompileConfig, GenerationConfig

    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
              cache_implementation="static", return_dict_in_generate=True, output_logits=keep_logits)
    if compile_mode == "none":
        kw["disable_compile"] = True
    else:
        cc = CompileConfig(fullgraph=False, mode=compile_mode)
        if not cuda:
            cc._compile_all_devices = True  # transformers compiles generate's forward on accelerators only
        kw["compile_config"] = cc
    return GenerationConfig(**kw)


def generate_once(model: torch.nn.Module, ids: torch.Tensor, config, processors: tuple = ()) -> dict:
    """One `generate` of `ids` [B, prompt]: {prefill_ms, steps_ms (each decode step), sequences [B, new] and
    logits [new, B, V] (float32, None unless the config keeps them) on the host, decode_impl}."""
    from transformers import LogitsProcessorList

    cuda = ids.device.type == "cuda"
    clock = StepClock(model, cuda)
    start = clock.mark()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                         logits_processor=LogitsProcessorList([clock, *processors]))
    ms = clock.intervals_ms(start)
    logits = torch.stack(out.logits).cpu() if getattr(out, "logits", None) else None
    return dict(prefill_ms=ms[0], steps_ms=ms[1:], sequences=out.sequences[:, ids.shape[1]:].cpu(), logits=logits,
                decode_impl=clock.impls[-1])


def reset_compile(model: torch.nn.Module) -> None:
    """Forget every compiled graph (and transformers' compiled forward of `model`): the next variant compiles
    from scratch, as in a process of its own."""
    import torch._dynamo

    torch._dynamo.reset()
    for attr in ("_compiled_call", "_last_compile_config"):
        model.__dict__.pop(attr, None)
    for limit in ("recompile_limit", "cache_size_limit"):  # a graph per batch size and phase, not a fallback
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))


def profile_moe(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> dict:
    """`steps` decode steps of an uncompiled `generate` of `ids` under torch.profiler, each experts module's call
    in a `record_function` scope (hooks that exist for this call only): {moe_us, kernels_us} per step, device
    time on a GPU (the scopes' kernels; all kernels), CPU time on the CPU (the scopes; every top-level op)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from moetune.testing import moe_blocks

    cuda = ids.device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    scopes: list = []

    def enter(mod, args):
        scope = torch.profiler.record_function(SCOPE)
        scope.__enter__()
        scopes.append(scope)

    def leave(mod, args, out):
        scopes.pop().__exit__(None, None, None)

    hooks = []
    for _, block in moe_blocks(model):
        hooks += [block.experts.register_forward_pre_hook(enter), block.experts.register_forward_hook(leave)]
    window = ProfileWindow(prof, steps, cuda)
    try:
        generate_once(model, ids, generation_config(steps + 1, "none", cuda), (window,))
    finally:
        for h in hooks:
            h.remove()
        if window.running:
            prof.stop()
    events = prof.events()
    mine = [e for e in events if e.name == SCOPE and e.device_type == DeviceType.CPU]
    if cuda:
        work = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.name != SCOPE]
        kernels = sum(e.time_range.elapsed_us() for e in work)
        spans = [e.time_range for e in events if e.name == SCOPE and e.device_type == DeviceType.CUDA]
        if spans:  # the kernels inside a scope's span on the GPU timeline (one stream: the scope's own), so that
            # kernels no aten op launches (Triton's) count too, and the host's gaps inside the span do not
            moe = sum(e.time_range.elapsed_us() for e in work if any(
                s.start <= e.time_range.start and e.time_range.end <= s.end for s in spans))
        else:  # the scope's linked kernels
            moe = sum(e.device_time_total for e in mine)
    else:
        moe = sum(e.cpu_time_total for e in mine)
        kernels = sum(e.cpu_time_total for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None)
    return dict(moe_us=moe / steps, kernels_us=kernels / steps, profiled_steps=steps, scopes=len(mine))


def compiled_kernels(model: torch.nn.Module, ids: torch.Tensor, new: int, mode: str, steps: int, top: int) -> dict:
    """The GPU kernels of decode steps 1..`steps` of a `generate` under the compile `mode` (the graphs the timed runs
    replayed; kernels inside CUDA graphs are traced as themselves): `timeline` of the kernels, with host_calls, the
    `top` CUDA runtime and driver calls of the host per step by count."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    window = ProfileWindow(prof, steps, True)
    try:
        generate_once(model, ids, generation_config(new, mode, True), (window,))
    finally:
        if window.running:
            prof.stop()
    events = prof.events()
    work = [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    line = timeline(work, steps, top)
    host: dict[str, int] = {}
    for e in events:  # the host's launches: graph replays, kernels launched outside a graph, copies, syncs
        if e.device_type == DeviceType.CPU and e.name.startswith(("cuda", "cu")) and not e.is_user_annotation:
            host[e.name] = host.get(e.name, 0) + 1
    return dict(line, host_calls={n: c / steps for n, c in sorted(host.items(), key=lambda kv: -kv[1])[:top]},
                steps=steps)


def timeline(work: list[tuple[str, float, float]], steps: int, top: int) -> dict:
    """The device's time of `steps` steps from its activities `work` [(name, start, end)] in µs: busy_us (the
    union of their intervals) and kernels_us (their sum) per step; kernels, the `top` names by time
    [{name, calls, us}] per step; idle_us, the time per step between the end of all earlier work and the start of
    the next, and gaps, the `top` of it keyed by the activities either side [{after, before, count, us}]."""
    by: dict[str, list[float]] = {}
    gaps: dict[tuple[str, str], list[float]] = {}
    busy, end, last = 0.0, None, None
    for name, a, b in sorted(work, key=lambda w: w[1]):
        by.setdefault(name, []).append(b - a)
        if end is not None and a > end:
            gaps.setdefault((last[:60], name[:60]), []).append(a - end)
        if end is None or a >= end:
            busy += b - a
            end, last = b, name
        elif b > end:
            busy += b - end
            end, last = b, name
    rows = sorted(({"name": n[:120], "calls": len(v) / steps, "us": sum(v) / steps} for n, v in by.items()),
                  key=lambda r: -r["us"])
    idle = sorted(({"after": a, "before": b, "count": len(v) / steps, "us": sum(v) / steps}
                   for (a, b), v in gaps.items()), key=lambda r: -r["us"])
    return dict(busy_us=busy / steps, kernels_us=sum(r["us"] for r in rows), kernels=rows[:top],
                idle_us=sum(r["us"] for r in idle), gaps=idle[:top])


class ExpertsOff:
    """Within the context every experts module of `model` returns zeros of its input's shape (the router, the
    attention and the rest of the step unchanged): a step without the experts, so that a variant's MoE time is its
    step time less this one's under the same compile."""

    def __init__(self, model: torch.nn.Module):
        from moetune.testing import moe_blocks

        self.experts = [block.experts for _, block in moe_blocks(model)]

    def __enter__(self):
        for m in self.experts:
            m.forward = lambda hidden, *args, **kw: torch.zeros_like(hidden)
        return self

    def __exit__(self, *exc):
        for m in self.experts:
            del m.forward


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
    return variant if impl is None else f"{variant}:{_impl_name(impl)}"


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
            from bench.kernels import use_fp8_kernel_source

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
    row = dict(decode_impl=_impl_name(runs[-1]["decode_impl"]), batch=b,
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


# -------------------------------------------------------------------------------------- step mode --


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
        from bench.kernels import fp8_kernel_package

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
