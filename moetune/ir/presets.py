"""Presets: the MoE blocks of real published models, as minimal config.json dicts (numbers only).

Each preset goes through `block_from_config`, so a preset and the model's own config.json give
the same MoEBlock. Weights are bfloat16 as published. qwen3.5-397b-a17b: E and k as published,
D = 4096 and F = 1024 assumed, shared expert size = F assumed, layer count left out.

The `-fp8` presets are the same models' FP8 checkpoints: the bf16 preset's config plus the
`quantization_config` DeepSeek-V3 and Qwen3-FP8 publish (e4m3 weights, one float32 scale per 128×128
block, activations quantised dynamically), so their experts have an fp8_block weight format.
"""

from __future__ import annotations

from .block import MoEBlock
from .config import block_from_config
from .errors import CaptureError

PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "hidden_act": "silu", "dtype": "bfloat16",
        "num_hidden_layers": 48,
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "hidden_size": 4096, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536, "norm_topk_prob": True, "hidden_act": "silu", "dtype": "bfloat16",
        "num_hidden_layers": 94,
    },
    "qwen3.5-397b-a17b": {
        "model_type": "qwen3_5_moe", "hidden_size": 4096, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024, "hidden_act": "silu",
        "dtype": "bfloat16",
    },
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next", "hidden_size": 2048, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "hidden_act": "silu", "dtype": "bfloat16",
        "num_hidden_layers": 48,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "hidden_act": "silu", "dtype": "bfloat16",
        "num_hidden_layers": 61, "first_k_dense_replace": 3,
    },
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 14336, "hidden_act": "silu", "dtype": "bfloat16",
        "num_hidden_layers": 32,
    },
    "gpt-oss-120b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_local_experts": 128, "num_experts_per_tok": 4,
        "intermediate_size": 2880, "swiglu_limit": 7.0, "hidden_act": "silu", "dtype": "bfloat16",
        "num_hidden_layers": 36,
    },
    "olmoe-1b-7b": {
        "model_type": "olmoe", "hidden_size": 2048, "num_experts": 64, "num_experts_per_tok": 8,
        "intermediate_size": 1024, "norm_topk_prob": False, "hidden_act": "silu", "dtype": "bfloat16",
        "num_hidden_layers": 16,
    },
}

FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                    "activation_scheme": "dynamic"}
PRESETS.update({f"{name}-fp8": {**PRESETS[name], "quantization_config": dict(FP8_QUANTIZATION)}
                for name in ("qwen3.5-397b-a17b", "deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")})


def preset(name: str, dtype: str | None = None) -> MoEBlock:
    """The MoEBlock of a shipped preset; CaptureError listing the presets for an unknown name."""
    cfg = PRESETS.get(name)
    if cfg is None:
        raise CaptureError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return block_from_config(cfg, name=name, dtype=dtype)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def table() -> list[str]:
    """The `moetune presets` table, one line per preset."""
    rows = [("name", "E", "k", "D", "F", "router", "weights", "expert bytes")]
    for name in PRESETS:
        b = preset(name)
        fmt = b.weight_format
        weights = fmt.dtype if not fmt.quantized else f"fp8 {fmt.block[0]}x{fmt.block[1]} {fmt.scale_dtype}"
        rows.append((name, str(b.E), str(b.k), str(b.D), str(b.F), str(b.router), weights,
                     _human(b.weight_bytes_per_expert)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {1, 2, 3, 4, 7}
    def cell(i: int, text: str) -> str:
        return text.rjust(widths[i]) if i in right else text.ljust(widths[i])

    return ["  ".join(cell(i, c) for i, c in enumerate(r)).rstrip() for r in rows]

