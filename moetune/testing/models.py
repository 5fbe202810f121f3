"""Tiny, randomly initialised transformers MoE models, built offline from their config classes.

Each family is one row of `FAMILIES`: the transformers config class and the keyword arguments that
differ from `BASE`. `build` is the one function that turns a row into a model (eval mode, on CPU,
seeded); the model class is transformers' own causal-LM class for that config. Nothing is
downloaded: the caller sets HF_HUB_OFFLINE where it wants the hub kept out (tests/conftest.py does).

    from moetune.testing import FAMILIES, build, moe_blocks
    model = build("qwen3_moe")                                  # float32, seed 0
    model = build("qwen2_moe", shared_expert_intermediate_size=0)  # a config field changed
    for name, block in moe_blocks(model): ...
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# Small sizes, all distinct: E in {4, 8, 16}, k in {1, 2, 4}, D = 64, F = 40 (so 2F = 80), shared
# experts 48, dense MLPs 96. A capture that swaps or transposes a weight layout then meets a shape
# mismatch instead of silently working on square matrices.
D = 64  # hidden size
F = 40  # expert intermediate size
SHARED = 48  # shared-expert intermediate size
DENSE = 96  # dense MLP intermediate size
VOCAB = 128
HEADS = 4

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=D,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Family:
    """One tiny model: a transformers config class (by name) and its fields that differ from BASE."""

    config: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    hooked: bool = True  # False: its experts lack transformers' experts hook (@use_experts_implementation)


_LINEAR_ATTENTION = dict(
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
)

FAMILIES: dict[str, Family] = {
    "mixtral": Family("MixtralConfig", dict(intermediate_size=F, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": Family("Qwen2MoeConfig", dict(
        intermediate_size=DENSE, moe_intermediate_size=F, shared_expert_intermediate_size=SHARED,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    "qwen3_moe": Family("Qwen3MoeConfig", dict(
        head_dim=16, intermediate_size=DENSE, moe_intermediate_size=F, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, mlp_only_layers=[])),
    "qwen3_next": Family("Qwen3NextConfig", dict(
        head_dim=16, intermediate_size=DENSE, moe_intermediate_size=F, shared_expert_intermediate_size=SHARED,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, **_LINEAR_ATTENTION)),
    "qwen3_5_moe": Family("Qwen3_5MoeTextConfig", dict(
        head_dim=16, moe_intermediate_size=F, shared_expert_intermediate_size=SHARED, num_experts=16,
        num_experts_per_tok=4, **_LINEAR_ATTENTION)),
    "deepseek_v3": Family("DeepseekV3Config", dict(  # layer 0 dense, layer 1 MoE
        num_key_value_heads=HEADS, intermediate_size=DENSE, moe_intermediate_size=F, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16)),
    "olmoe": Family("OlmoeConfig", dict(
        intermediate_size=F, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    "gpt_oss": Family("GptOssConfig", dict(
        head_dim=16, intermediate_size=F, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"])),
    "llama4": Family("Llama4TextConfig", dict(  # layer 0 dense, layer 1 MoE
        head_dim=16, intermediate_size=F, intermediate_size_mlp=DENSE, num_local_experts=4,
        num_experts_per_tok=1, moe_layers=[1], interleave_moe_layer_step=2, attention_chunk_size=16,
        layer_types=["chunked_attention", "full_attention"]), hooked=False),
    "granitemoe": Family("GraniteMoeConfig", dict(
        intermediate_size=F, num_local_experts=8, num_experts_per_tok=2)),
    "granitemoeshared": Family("GraniteMoeSharedConfig", dict(
        intermediate_size=F, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=SHARED)),
    # flat [E·F, D] weights; its attention needs rope_theta and a non-None clip_qkv in attn_config, and
    # its ffn_config takes hidden_size from the d_model argument (BASE's hidden_size is set after it)
    "dbrx": Family("DbrxConfig", dict(
        d_model=D, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": F, "moe_num_experts": 8, "moe_top_k": 2}), hooked=False),
}

# Families whose experts class lacks @use_experts_implementation: transformers keeps them on "eager",
# and `build(..., experts_implementation="grouped_mm")` raises ValueError for them.
UNHOOKED = frozenset(name for name, fam in FAMILIES.items() if not fam.hooked)


def config(family: str, **overrides: Any):
    """The transformers config of `family`: BASE, then the family's fields, then `overrides`."""
    import transformers

    fam = FAMILIES[family]
    return getattr(transformers, fam.config)(**{**BASE, **fam.kwargs, **overrides})


def build(
    family: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    experts_implementation: str | None = None,
    **overrides: Any,
) -> torch.nn.Module:
    """A tiny random model of `family` in eval mode, on the current default device (CPU).

    `experts_implementation` goes to transformers unchanged ("eager", "grouped_mm", "batched_mm" or
    any name registered in its ExpertsInterface); `overrides` change config fields.
    """
    import transformers

    cfg = config(family, **overrides)
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    model = transformers.AutoModelForCausalLM.from_config(cfg, **kwargs)
    # DeepSeek-V3's correction bias is a zero buffer at init: random values make a capture that
    # ignores it route differently.
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):
            with torch.no_grad():
                m.e_score_correction_bias.copy_(torch.randn_like(m.e_score_correction_bias) * 0.1)
    return model.eval()


def moe_blocks(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every module with an `experts` child: a structural finder for
    `describe`, not moetune's capture."""
    for name, mod in model.named_modules():
        if "experts" in mod._modules:
            yield name, mod


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def describe(model: torch.nn.Module) -> list[str]:
    """The model's experts implementation, its MoE blocks, and once per block class the children with
    their experts-hook flags and their parameter and buffer shapes."""
    impl = getattr(model.config, "_experts_implementation", None)
    lines = [f"model: {type(model).__name__}  experts_implementation={impl!r}"]
    seen = set()
    for name, block in moe_blocks(model):
        key = type(block).__name__
        lines.append(f"  block {name}: {key}")
        if key in seen:
            continue
        seen.add(key)
        for cname, child in block.named_children():
            flags = ""
            if hasattr(child, "has_gate"):
                flags = (f" [hook: has_gate={child.has_gate} is_transposed={child.is_transposed} "
                         f"is_concatenated={child.is_concatenated} has_bias={child.has_bias}]")
            lines.append(f"    .{cname}: {type(child).__name__}{flags}")
            for pname, p in child.named_parameters():
                lines.append(f"      {cname}.{pname}: {tuple(p.shape)} {_dtype(p)}")
            for bname, b in child.named_buffers():
                lines.append(f"      {cname}.{bname} (buffer): {tuple(b.shape)} {_dtype(b)}")
    return lines


def run_forward(
    model: torch.nn.Module, tokens: int = 7, batch: int = 2, repeats: int = 15
) -> tuple[torch.Tensor, float]:
    """Forward passes on fixed random ids [batch, tokens]: (logits, median seconds per forward)."""
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(1))
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model(input_ids=ids)
            times.append(time.perf_counter() - t0)
    return out.logits, statistics.median(times)
