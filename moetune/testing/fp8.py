"""Tiny FP8 MoE models: transformers' FP8Experts built from a tiny model, and a pre-quantised FP8 checkpoint
written in the published format.

    from moetune.testing import fp8
    model = fp8.to_fp8(build("qwen3_moe", dtype=torch.bfloat16), block=(8, 8))  # experts → FP8Experts
    fp8.write_checkpoint(folder, "qwen3_moe")                                     # config.json + safetensors
    fp8.load_experts(model, folder)           # each block's experts → FP8Experts holding the checkpoint's tensors
    fp8.dequantizing_fp8_kernel()             # the hub kernel's entry points, by dequantising (no hub needed)

The checkpoint is what DeepSeek-V3 and Qwen3-FP8 publish: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`
(Mixtral: `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`) in float8_e4m3fn, each with its
`weight_scale_inv` in float32, one per 128×128 block, the other linear layers quantised the same way, and a
config.json whose `quantization_config` is {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[128, 128], "activation_scheme": "dynamic"}. transformers' checkpoint conversion (conversion_mapping.py,
"qwen2_moe" and "mixtral") merges the experts into FP8Experts' fused gate_up_proj [E, 2F, D] and down_proj
[E, D, F] and their scales the same way on a GPU; without one it dequantises them to bf16 on load.
Quantisation is moetune.codegen.quant's, the one rule (gate and up each in blocks of their own).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..codegen.quant import quantize_blocks, quantize_gate_up
from .models import build

# Sizes that keep whole 128×128 blocks: D = 256, F = 128 (2F = 256), attention 4 heads × 64.
FP8_SIZES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256, num_experts=8,
                      num_experts_per_tok=2, head_dim=64),
    "mixtral": dict(hidden_size=256, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                    head_dim=64),
}
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                "activation_scheme": "dynamic"}
_EXPERT_KEY = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# kept in the model dtype: embeddings, norms, the head and the routers (`mlp.gate`, Mixtral's `block_sparse_moe.gate`)
_UNQUANTISED = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "block_sparse_moe.gate.", "router")


def fp8_experts_class() -> type:
    """transformers' FP8Experts behind its FP8 experts hook, as its FP8 loading builds it (a subclass, so
    transformers' own class is left as it is)."""
    global _FP8_CLASS
    if _FP8_CLASS is None:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
        from transformers.integrations.moe import use_experts_implementation

        class TinyFP8Experts(FP8Experts):
            pass

        _FP8_CLASS = use_experts_implementation(experts_class=TinyFP8Experts,
                                                experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    return _FP8_CLASS


_FP8_CLASS: type | None = None


@torch.no_grad()
def fp8_experts(experts: torch.nn.Module, block: tuple[int, int] = (128, 128),
                scale_dtype: str = "float32") -> torch.nn.Module:
    """An FP8Experts module holding `experts`' weights (a bf16 / fp32 experts module of the standard layout)
    quantised per block; scales float32 or ue8m0 (float8_e8m0fnu)."""
    cls = fp8_experts_class()
    fp8 = cls(experts.config, block_size=tuple(block), scale_fmt="ue8m0" if scale_dtype == "ue8m0" else "float")
    fp8 = fp8.to(experts.gate_up_proj.device)
    gu, gus = quantize_gate_up(experts.gate_up_proj.float(), tuple(block), scale_dtype)
    dn, dns = quantize_blocks(experts.down_proj.float(), tuple(block), scale_dtype)
    for name, t in (("gate_up_proj", gu), ("gate_up_proj_scale_inv", gus), ("down_proj", dn),
                    ("down_proj_scale_inv", dns)):
        setattr(fp8, name, torch.nn.Parameter(t, requires_grad=False))
    return fp8.eval()


def to_fp8(model: torch.nn.Module, block: tuple[int, int] = (128, 128), scale_dtype: str = "float32"
           ) -> torch.nn.Module:
    """`model` with every `experts` child that has fused gate_up_proj / down_proj replaced by FP8Experts
    holding its weights quantised (`fp8_experts`); the rest of the model is unchanged."""
    for mod in list(model.modules()):
        experts = mod._modules.get("experts")
        if experts is not None and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
            mod.experts = fp8_experts(experts, block, scale_dtype)
    return model


def write_checkpoint(folder: str | Path, family: str = "qwen3_moe", *, seed: int = 0,
                     quantize_linears: bool = True, model: torch.nn.Module | None = None) -> Path:
    """A tiny pre-quantised FP8 checkpoint of `family` (FP8_SIZES) in `folder`: config.json with the
    published quantization_config and model.safetensors in the published per-expert layout.

    `quantize_linears=False` keeps the attention and dense layers in bf16 and lists them in
    `modules_to_not_convert` (as published configs list what they leave unquantised), so that only the
    experts are FP8. `model`: a bf16 model of one of the families to write instead of the tiny one (a
    preset's real shapes with few layers). Returns the folder."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    if model is None:
        model = build(family, dtype=torch.bfloat16, seed=seed, **FP8_SIZES[family])
    model.save_pretrained(folder)
    files = sorted(folder.glob("*.safetensors"))
    block = tuple(QUANTIZATION["weight_block_size"])
    kept: set[str] = set()
    for f in files:
        tensors = load_file(f)
        out = {}
        for key, t in tensors.items():
            expert = _EXPERT_KEY.search(key) is not None
            linear = (t.dim() == 2 and key.endswith(".weight") and not any(u in key for u in _UNQUANTISED))
            if expert or (linear and quantize_linears):
                q, s = quantize_blocks(t.float(), block)
                out[key], out[key.removesuffix("weight") + "weight_scale_inv"] = q, s.contiguous()
            else:
                out[key] = t
                if linear:
                    kept.add(key.removesuffix(".weight"))
        save_file(out, f, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    quant = dict(QUANTIZATION)
    quant["modules_to_not_convert"] = ["lm_head", *sorted(kept)]
    cfg["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def checkpoint_experts(folder: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's experts merged as transformers' conversion mapping merges them into FP8Experts:
    block path (as the model names it, e.g. "model.layers.0.mlp") → gate_up_proj [E, 2F, D] (the experts
    stacked, gate | up concatenated), down_proj [E, D, F], and their `_scale_inv` merged the same way."""
    from safetensors.torch import load_file

    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        for key, t in load_file(f).items():
            m = re.match(r"(.+)\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv)$", key)
            if m is None or m.group(3) not in _NAMES:
                continue
            path = m.group(1).replace(".block_sparse_moe", ".mlp")
            name = _NAMES[m.group(3)] + ("_scale" if m.group(4) == "weight_scale_inv" else "")
            parts.setdefault(path, {}).setdefault(name, {})[int(m.group(2))] = t
    out = {}
    for path, p in parts.items():
        stack = {n: torch.stack([v[e] for e in sorted(v)]) for n, v in p.items()}  # MergeModulelist(dim=0)
        out[path] = {"gate_up_proj": torch.cat([stack["gate"], stack["up"]], dim=1),  # Concatenate(dim=1)
                     "gate_up_proj_scale_inv": torch.cat([stack["gate_scale"], stack["up_scale"]], dim=1),
                     "down_proj": stack["down"], "down_proj_scale_inv": stack["down_scale"]}
    return out


@torch.no_grad()
def load_experts(model: torch.nn.Module, folder: str | Path) -> torch.nn.Module:
    """`model` (built from the checkpoint's config) with each block's experts replaced by transformers'
    FP8Experts holding the checkpoint's FP8 values and scales, merged as its loading merges them."""
    cfg = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    modules = dict(model.named_modules())
    for path, tensors in checkpoint_experts(folder).items():
        block = modules[path]
        experts = fp8_experts_class()(block.experts.config, block_size=tuple(cfg["weight_block_size"]),
                                      activation_scheme=cfg.get("activation_scheme", "dynamic"))
        for name, t in tensors.items():
            setattr(experts, name, torch.nn.Parameter(t.to(block.experts.gate_up_proj.device), requires_grad=False))
        block.experts = experts.eval()
    return model


def _dequantized(w: torch.Tensor, scale_inv: torch.Tensor, block_size) -> torch.Tensor:
    from ..codegen.quant import dequantize_blocks

    return dequantize_blocks(w.float(), scale_inv, tuple(block_size))  # [N, K] float32


def matmul_2d(A, B, Bs, block_size, output_dtype=None, activation_scale=None):
    """finegrained-fp8's `matmul_2d` computed in float32 on the dequantised weight: A [M, K] · B [N, K]ᵀ."""
    return (A.float() @ _dequantized(B, Bs, block_size).T).to(output_dtype or A.dtype)


def matmul_batched(A, B, Bs, block_size=None, expert_ids=None):
    """finegrained-fp8's `matmul_batched`, the same way: row i of A times expert `expert_ids[i]`'s weight."""
    rows = [A[i].float() @ _dequantized(B[e], Bs[e], block_size).T for i, e in enumerate(expert_ids.tolist())]
    return torch.stack(rows).to(A.dtype)  # [S, N]


def matmul_grouped(A, B, Bs, offsets, tokens_per_expert, block_size, output_dtype=None):
    """finegrained-fp8's `matmul_grouped`, the same way: A's rows sorted by expert, expert e's ending at
    offsets[e]."""
    out, start = A.new_zeros(A.shape[0], B.shape[1], dtype=output_dtype or A.dtype), 0  # [S, N]
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = A[start:end].float() @ _dequantized(B[e], Bs[e], block_size).T
        start = end
    return out


def dequantizing_fp8_kernel():
    """The three entry points transformers' FP8 experts take from the finegrained-fp8 hub kernel
    (`FineGrainedFP8`), computed by dequantising each weight and multiplying in float32: transformers' own FP8
    experts functions run on CPU where the hub kernel cannot be fetched (activations are not quantised)."""
    from transformers.integrations.finegrained_fp8 import FineGrainedFP8

    return FineGrainedFP8(matmul=matmul_2d, batched_matmul=matmul_batched, grouped_matmul=matmul_grouped)
