"""A MoEBlock from a HuggingFace `config.json` alone: no weights, no transformers import.

Each supported `model_type` maps the config's field names onto E, k, D, F, the router, the
activation and the shared experts, with the defaults of transformers 5.24's config classes for
optional flags. The sizes themselves (E, k, D, F) must be in the file: a missing one is an
error naming the field, never a guess. VLM configs are read through their `text_config`.

A `quantization_config` with quant_method "fp8" (as DeepSeek-V3 and Qwen3-FP8 publish it: fmt e4m3,
weight_block_size [128, 128], activation_scheme dynamic, optionally scale_fmt ue8m0) gives the block an
fp8_block weight format, its activations in the config's dtype: the experts transformers loads into
FP8Experts on a GPU. FP8 settings moetune's kernels cannot read are refused with the reason; other
quantisation methods leave the block in the config's dtype (`quantization(cfg)` names them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .block import DTYPES, Activation, MoEBlock, Router, SharedExperts, WeightFormat, WeightLayout
from .errors import CaptureError, IRError


@dataclass(frozen=True)
class Family:
    """How one model_type names its MoE fields (each a tuple of accepted aliases, first preferred)."""

    E: tuple[str, ...]
    F: tuple[str, ...]
    router: str  # "softmax_topk" | "softmax_topk_flag" | "topk_softmax" | "deepseek_v3"
    renorm_default: bool = False  # value of norm_topk_prob when the file has none
    routing_fp32: bool = False  # the router hands the experts float32 weights
    shared: str | None = None  # "gated" | "ungated" | "outside": how shared experts are attached
    gpt_oss: bool = False  # transposed, interleaved, biased layout; clamped SwiGLU; router logit bias
    layers: str = "all"  # which decoder layers hold the block: "all" | "sparse_step" | "first_k_dense"
    defaults: dict = field(default_factory=dict)


_E_LOCAL = ("num_local_experts", "num_experts")
_E_QWEN = ("num_experts", "num_local_experts")

FAMILIES: dict[str, Family] = {
    "mixtral": Family(_E_LOCAL, ("intermediate_size",), "softmax_topk", routing_fp32=True),
    "qwen2_moe": Family(_E_QWEN, ("moe_intermediate_size",), "softmax_topk_flag", shared="gated",
                        layers="sparse_step"),
    "qwen3_moe": Family(_E_QWEN, ("moe_intermediate_size",), "softmax_topk_flag", layers="sparse_step"),
    "qwen3_next": Family(_E_QWEN, ("moe_intermediate_size",), "softmax_topk_flag", renorm_default=True,
                         shared="gated", layers="sparse_step"),
    "qwen3_5_moe": Family(_E_QWEN, ("moe_intermediate_size",), "softmax_topk", shared="gated"),
    "deepseek_v3": Family(("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",),
                          "deepseek_v3", renorm_default=True, routing_fp32=True, shared="ungated",
                          layers="first_k_dense",
                          defaults={"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                                    "n_shared_experts": 1, "first_k_dense_replace": 3}),
    "olmoe": Family(_E_QWEN, ("intermediate_size",), "softmax_topk_flag"),
    "gpt_oss": Family(_E_LOCAL, ("intermediate_size",), "topk_softmax", gpt_oss=True,
                      defaults={"swiglu_alpha": 1.702, "swiglu_limit": 7.0}),
    "granitemoe": Family(_E_LOCAL, ("intermediate_size",), "topk_softmax"),
    "granitemoeshared": Family(_E_LOCAL, ("intermediate_size",), "topk_softmax", shared="outside"),
}
ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}
REFUSED = {
    "llama4": "Llama4 scales the expert input by the routing score and runs every expert on all tokens",
    "llama4_text": "Llama4 scales the expert input by the routing score and runs every expert on all tokens",
    "dbrx": "DBRX keeps flat [E·F, D] expert weights and p-norm renormalisation",
}
_SHARED_F = {"gated": "shared_expert_intermediate_size", "outside": "shared_intermediate_size"}


def load_config(path: str | Path) -> dict:
    """The dict of a config.json, given the file or the model folder holding it."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        with open(p) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise CaptureError(f"config file {p} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CaptureError(f"config file {p} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CaptureError(f"config file {p}: top level is {type(cfg).__name__}, expected an object")
    return cfg


def _family(cfg: dict, src: str) -> tuple[dict, str, Family]:
    """(the language-model config, the model_type, its Family); CaptureError for anything else."""
    top = cfg
    if isinstance(cfg.get("text_config"), dict):  # a VLM: the MoE lives in the language model
        cfg = {**cfg["text_config"]}
    model_type = cfg.get("model_type") or top.get("model_type")
    if model_type is None:
        raise CaptureError(f"{src}: no field 'model_type'")
    mt = ALIASES.get(model_type, model_type)
    if mt in REFUSED:
        raise CaptureError(f"{src}: model_type {model_type!r} is not supported: {REFUSED[mt]}")
    fam = FAMILIES.get(mt)
    if fam is None:
        raise CaptureError(f"{src}: unknown model_type {model_type!r}; "
                           f"supported: {', '.join(sorted(FAMILIES))}")
    return cfg, model_type, fam


def moe_layers(cfg: dict, name: str = "") -> list[int] | None:
    """Indices of the decoder layers that hold an MoE block (None when the file gives no layer count)."""
    text, _, fam = _family(cfg, f"config {name!r}" if name else "config")
    n = text.get("num_hidden_layers")
    if not isinstance(n, int):
        return None
    if fam.layers == "sparse_step":
        dense, step = set(text.get("mlp_only_layers") or ()), text.get("decoder_sparse_step") or 1
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if fam.layers == "first_k_dense":
        first = text.get("first_k_dense_replace")
        return list(range(fam.defaults["first_k_dense_replace"] if first is None else first, n))
    return list(range(n))


def block_from_config(cfg: dict, name: str = "", dtype: str | None = None, *, T_max: int = 4096) -> MoEBlock:
    """The MoEBlock of every MoE layer of the model `cfg` describes (they share one shape).

    `dtype` overrides the config's own `dtype`/`torch_dtype` (default bfloat16). Raises
    CaptureError naming `name` (the file or preset) and the missing or unsupported field.
    """
    src = f"config {name!r}" if name else "config"
    top = cfg
    cfg, model_type, fam = _family(cfg, src)
    src += f" (model_type {model_type})"

    def need(names: tuple[str, ...]) -> int:
        for n in names:
            if cfg.get(n) is not None:
                v = cfg[n]
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise CaptureError(f"{src}: field {n!r} = {v!r}, expected a positive integer")
                return v
        raise CaptureError(f"{src}: missing MoE field {' / '.join(repr(n) for n in names)}")

    def opt(n: str, default=None):
        v = cfg.get(n)
        return fam.defaults.get(n, default) if v is None else v

    E, k = need(fam.E), need(("num_experts_per_tok",))
    D, F = need(("hidden_size",)), need(fam.F)

    act_name = cfg.get("hidden_act", "silu")
    if fam.gpt_oss:
        activation = Activation("clamped_swiglu", alpha=float(opt("swiglu_alpha")),
                                limit=float(opt("swiglu_limit")))
    elif act_name in ("silu", "swish"):
        activation = Activation("swiglu")
    else:
        raise CaptureError(f"{src}: field 'hidden_act' = {act_name!r} is not supported; "
                           "supported: silu (SwiGLU)")

    if fam.router == "deepseek_v3":
        if opt("scoring_func", "sigmoid") != "sigmoid" or opt("topk_method", "noaux_tc") != "noaux_tc":
            raise CaptureError(f"{src}: scoring_func={cfg.get('scoring_func')!r} topk_method="
                               f"{cfg.get('topk_method')!r}; supported: sigmoid with noaux_tc")
        router = Router("sigmoid_grouped_topk", renormalize=bool(opt("norm_topk_prob", fam.renorm_default)),
                        score_bias=True, n_group=int(opt("n_group")), topk_group=int(opt("topk_group")),
                        scaling=float(opt("routed_scaling_factor")), compute_dtype="float32",
                        weights_dtype="float32")
    elif fam.router == "topk_softmax":
        router = Router("topk_softmax", logit_bias=fam.gpt_oss, compute_dtype="model")
    else:
        renorm = True if fam.router == "softmax_topk" else bool(opt("norm_topk_prob", fam.renorm_default))
        router = Router("softmax_topk", renormalize=renorm, compute_dtype="model",
                        weights_dtype="float32" if fam.routing_fp32 else "model")

    shared = None
    if fam.shared == "ungated":
        n = opt("n_shared_experts")
        if n:
            shared = SharedExperts(F * int(n), gated=False)
    elif fam.shared is not None:
        fs = opt(_SHARED_F[fam.shared], 0)
        if fs:
            shared = SharedExperts(int(fs), gated=fam.shared == "gated", inside_block=fam.shared != "outside")

    wdt = dtype or cfg.get("dtype") or cfg.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype") \
        or "bfloat16"
    if wdt not in DTYPES:
        raise CaptureError(f"{src}: dtype {wdt!r} is not supported; supported: {', '.join(DTYPES)}")
    layout = WeightLayout(transposed=True, interleaved=True, has_bias=True) if fam.gpt_oss else WeightLayout()
    fmt = fp8_format(quantization(top), wdt, src)
    if fmt is not None:
        partial = fmt.partial_blocks(D, F)
        if partial:
            raise CaptureError(f"{src}: FP8 experts of D={D}, F={F}: {partial}; moetune reads whole blocks only")
    try:
        block = MoEBlock(E=E, k=k, D=D, F=F, activation=activation, router=router, shared=shared,
                         layout=layout,
                         weight_dtype=wdt, routing_weight_dtype="float32" if fam.routing_fp32 else wdt,
                         T_max=T_max, name=name)
        return block if fmt is None else block.with_weight_format(fmt)
    except IRError as e:
        raise CaptureError(f"{src}: {e}") from None


def quantization(cfg: dict) -> dict | None:
    """The config's `quantization_config` (top level, else the text config's), None when it has none."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict) and isinstance(cfg.get("text_config"), dict):
        q = cfg["text_config"].get("quantization_config")
    return q if isinstance(q, dict) else None


def fp8_format(quant: dict | None, compute_dtype: str, src: str = "config") -> WeightFormat | None:
    """The fp8_block WeightFormat a `quantization_config` declares (None for none, or another method);
    CaptureError for FP8 settings the kernels cannot read."""
    if quant is None or quant.get("quant_method") != "fp8":
        return None
    where = f"{src}: quantization_config"
    fmt = quant.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise CaptureError(f"{where} fmt={fmt!r} is not supported; supported: e4m3")
    if quant.get("expert_dtype", "fp8") != "fp8":
        raise CaptureError(f"{where} expert_dtype={quant['expert_dtype']!r} (FP4 experts) is not supported; "
                           "supported: fp8")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CaptureError(f"{where} activation_scheme={scheme!r} is not supported; supported: dynamic")
    bs = quant.get("weight_block_size")
    if bs is None:
        raise CaptureError(f"{where} has no weight_block_size (per-tensor scales), not supported; "
                           "supported: block scales, e.g. weight_block_size [128, 128]")
    if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
        raise CaptureError(f"{where} weight_block_size={bs!r}, expected [rows, cols] positive integers")
    scale = quant.get("scale_fmt") or "float"
    if scale not in ("float", "float32", "ue8m0"):
        raise CaptureError(f"{where} scale_fmt={scale!r} is not supported; supported: float (float32), ue8m0")
    return WeightFormat.fp8_block(tuple(bs), "ue8m0" if scale == "ue8m0" else "float32", compute_dtype)
