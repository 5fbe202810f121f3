"""The decode suites' models: a preset's real transformers model class built from its config with random weights,
its depth sized to the memory it may take, its experts made transformers' FP8Experts, and transformers' own
`generate` driven with a static KV cache and its compile config (`bench.decode`, `bench.router`).
"""

from __future__ import annotations

import time

import torch

from moetune.ir.presets import PRESETS, preset

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


def impl_name(impl: str) -> str:
    return "grouped_mm" if impl == KEPT_GROUPED_MM else impl


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
