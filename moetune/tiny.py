"""Tiny, randomly initialised HuggingFace MoE models built offline from config.

These are the real transformers model classes that moetune's capture, tests, demo and
`moetune record --tiny` run against. Nothing is downloaded: every model is built from a config object, so it
works with HF_HUB_OFFLINE=1 and no network.

Usage:
    python -m moetune.tiny              # all families
    python -m moetune.tiny qwen3_moe    # some families
    ... --dtype bfloat16 --tokens 7 --experts-impl eager

As a library:
    from moetune.tiny import FAMILIES, build
    model = build("qwen3_moe")             # eval mode, float32, seeded
    for name, block in moe_blocks(model): ...

Tested with transformers 5.24.0 and torch 2.13.0 (CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

# Shared small sizes, all distinct: E in {4, 8, 16}, k in {1, 2, 4}, D = 64,
# F = 40 (so 2F = 80), shared-expert sizes 48, dense-MLP sizes 96. A capture
# that swaps or transposes a weight layout then meets a shape mismatch instead
# of silently working on square matrices.
D = 64  # hidden size
F = 40  # expert intermediate size
VOCAB = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2


def _common(**kw) -> dict:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=D,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return base


def _mixtral():
    cfg = transformers.MixtralConfig(
        **_common(intermediate_size=F, num_local_experts=8, num_experts_per_tok=2)
    )
    return transformers.MixtralForCausalLM, cfg


def _qwen2_moe():
    cfg = transformers.Qwen2MoeConfig(
        **_common(
            intermediate_size=96,  # dense MLP size (unused unless mlp_only_layers)
            moe_intermediate_size=F,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
    )
    return transformers.Qwen2MoeForCausalLM, cfg


def _qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(
        **_common(
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=F,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            mlp_only_layers=[],
        )
    )
    return transformers.Qwen3MoeForCausalLM, cfg


def _qwen3_next():
    cfg = transformers.Qwen3NextConfig(
        **_common(
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=F,
            shared_expert_intermediate_size=48,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"],
        )
    )
    return transformers.Qwen3NextForCausalLM, cfg


def _qwen3_5_moe():
    cfg = transformers.Qwen3_5MoeTextConfig(
        **_common(
            head_dim=16,
            moe_intermediate_size=F,
            shared_expert_intermediate_size=48,
            num_experts=16,
            num_experts_per_tok=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"],
        )
    )
    return transformers.Qwen3_5MoeForCausalLM, cfg


def _deepseek_v3():
    cfg = transformers.DeepseekV3Config(
        **_common(
            num_key_value_heads=HEADS,
            intermediate_size=96,  # dense MLP of the first layer
            moe_intermediate_size=F,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        )
    )
    return transformers.DeepseekV3ForCausalLM, cfg


def _olmoe():
    cfg = transformers.OlmoeConfig(
        **_common(intermediate_size=F, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    )
    return transformers.OlmoeForCausalLM, cfg


def _gpt_oss():
    cfg = transformers.GptOssConfig(
        **_common(
            head_dim=16,
            intermediate_size=F,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    )
    return transformers.GptOssForCausalLM, cfg


def _llama4():
    cfg = transformers.Llama4TextConfig(
        **_common(
            head_dim=16,
            intermediate_size=F,  # expert size
            intermediate_size_mlp=96,  # dense MLP size of non-MoE layers
            num_local_experts=4,
            num_experts_per_tok=1,
            moe_layers=[1],  # layer 0 dense, layer 1 MoE
            interleave_moe_layer_step=2,
            attention_chunk_size=16,
            layer_types=["chunked_attention", "full_attention"],
        )
    )
    return transformers.Llama4ForCausalLM, cfg


def _granitemoe():
    cfg = transformers.GraniteMoeConfig(
        **_common(intermediate_size=F, num_local_experts=8, num_experts_per_tok=2)
    )
    return transformers.GraniteMoeForCausalLM, cfg


def _granitemoeshared():
    cfg = transformers.GraniteMoeSharedConfig(
        **_common(
            intermediate_size=F, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48
        )
    )
    return transformers.GraniteMoeSharedForCausalLM, cfg


def _dbrx():
    # Not ported to @use_experts_implementation: flat [E*F, D] weights, no hook.
    # transformers 5.24 DBRX needs rope_theta in attn_config (AttributeError
    # otherwise) and a non-None clip_qkv (torch.clamp(None, None) otherwise).
    cfg = transformers.DbrxConfig(
        d_model=D,
        n_heads=HEADS,
        n_layers=LAYERS,
        max_seq_len=128,
        vocab_size=VOCAB,
        attn_config={"kv_n_heads": KV_HEADS, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": F, "moe_num_experts": 8, "moe_top_k": 2},
    )
    return transformers.DbrxForCausalLM, cfg


FAMILIES: dict[str, Callable[[], tuple[type, object]]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen3_next,
    "qwen3_5_moe": _qwen3_5_moe,
    "deepseek_v3": _deepseek_v3,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "granitemoe": _granitemoe,
    "granitemoeshared": _granitemoeshared,
    "dbrx": _dbrx,
}


# Families whose experts class lacks @use_experts_implementation: transformers
# keeps them on "eager", and `build(..., experts_implementation="grouped_mm")`
# raises ValueError for them (a custom registered name is accepted and ignored).
UNHOOKED = {"llama4", "dbrx"}


def build(
    family: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    experts_implementation: str | None = None,
) -> torch.nn.Module:
    """Build a tiny random model of `family` (eval mode, on CPU).

    `experts_implementation` is passed to transformers unchanged: "eager",
    "grouped_mm", "batched_mm" or any name registered in
    `transformers.integrations.moe.ExpertsInterface`.
    """
    model_cls, cfg = FAMILIES[family]()
    torch.manual_seed(seed)
    kwargs = {"dtype": dtype}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    model = model_cls._from_config(cfg, **kwargs)
    # DeepSeek-V3's correction bias is a zero buffer at init; give it values so
    # that a capture which ignores it produces different routing.
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):
            with torch.no_grad():
                m.e_score_correction_bias.copy_(torch.randn_like(m.e_score_correction_bias) * 0.1)
    return model.eval()


def moe_blocks(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Yield (qualified name, module) for modules that own an `experts` child.

    This is a crude structural finder for the printout only, not moetune's capture.
    """
    for name, mod in model.named_modules():
        if "experts" in dict(mod.named_children()):
            yield name, mod


def describe(model: torch.nn.Module) -> list[str]:
    lines = [f"model: {type(model).__name__}  experts_implementation="
             f"{getattr(model.config, '_experts_implementation', None)!r}"]
    seen = set()
    for name, block in moe_blocks(model):
        key = type(block).__name__
        lines.append(f"  block {name}: {key}")
        if key in seen:
            continue  # print shapes once per class
        seen.add(key)
        for cname, child in block.named_children():
            flags = ""
            if hasattr(child, "has_gate"):
                flags = (f" [hook: has_gate={child.has_gate} is_transposed={child.is_transposed} "
                         f"is_concatenated={child.is_concatenated} has_bias={child.has_bias}]")
            lines.append(f"    .{cname}: {type(child).__name__}{flags}")
            for pname, p in child.named_parameters():
                lines.append(f"      {cname}.{pname}: {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}")
            for bname, b in child.named_buffers():
                lines.append(f"      {cname}.{bname} (buffer): {tuple(b.shape)} {str(b.dtype).replace('torch.', '')}")
    return lines


def run_forward(
    model: torch.nn.Module, tokens: int = 7, batch: int = 2, repeats: int = 15
) -> tuple[torch.Tensor, float]:
    """Forward pass on random ids; returns (logits, median seconds per forward)."""
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(1))
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model(input_ids=ids)
            times.append(time.perf_counter() - t0)
    return out.logits, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=7)
    ap.add_argument("--experts-impl", default=None, help="eager | grouped_mm | batched_mm (default: transformers' own)")
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: steadier timings on a small shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}  transformers {transformers.__version__}  "
          f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}")
    for fam in args.families:
        # transformers raises if an unhooked model is asked for anything but eager
        impl = args.experts_impl if fam not in UNHOOKED else None
        t0 = time.perf_counter()
        model = build(fam, dtype=dtype, experts_implementation=impl)
        t_build = time.perf_counter() - t0
        n_params = sum(p.numel() for p in model.parameters())
        print(f"\n== {fam}: built in {t_build * 1e3:.0f} ms, {n_params / 1e3:.1f}k params")
        print("\n".join(describe(model)))
        if not args.no_forward:
            logits, dt = run_forward(model, tokens=args.tokens)
            ok = bool(torch.isfinite(logits).all())
            print(f"  forward (batch 2 x {args.tokens} tokens, median of 15): {dt * 1e3:.2f} ms, "
                  f"logits {tuple(logits.shape)} {logits.dtype}, finite={ok}")


if __name__ == "__main__":
    main()
