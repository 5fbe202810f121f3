"""The baseline every tuned time is compared with: transformers' own experts implementations.

`transformers.integrations.moe.grouped_mm_experts_forward` (the default experts backend of transformers 5)
or `batched_mm_experts_forward` (what `generate()` switches to for decode on a GPU), called on the same
expert tensors through a minimal stand-in for the experts module (the attributes its contract names). FP8
experts take transformers' FP8 experts functions of the same names (`finegrained_fp8`, its FP8 experts hook),
with the block scales and dynamic activation quantisation FP8Experts holds; their kernel is the hub's
finegrained-fp8, so where it cannot be fetched the baseline's failure says so.
"""

from __future__ import annotations

import types

import torch

from ..codegen.tensors import ExpertsFn, ExpertTensors
from ..codegen.torch import apply_activation, split_gate_up
from ..ir import MoEBlock

BASELINES = ("grouped_mm", "batched_mm")


def default_baseline(device: str | torch.device) -> str:
    """What transformers' users get at decode: batched_mm on a GPU, grouped_mm on CPU."""
    return "batched_mm" if torch.device(device).type == "cuda" else "grouped_mm"


def baseline_fn(block: MoEBlock, name: str = "grouped_mm") -> tuple[ExpertsFn | None, str]:
    """(fn, label) of transformers' `name` experts function for `block`, or (None, reason)."""
    if name not in BASELINES:
        return None, f"unknown baseline {name!r}; known: {', '.join(BASELINES)}"
    if block.weight_application != "output":
        return None, "transformers' experts functions weight the output; this block weights the input"
    fmt = block.weight_format
    try:
        if fmt.quantized:
            from transformers.integrations import finegrained_fp8 as hf_moe
        else:
            from transformers.integrations import moe as hf_moe
    except ImportError as e:
        return None, f"transformers not importable ({e})"
    fn_name = f"fp8_{name}_experts_forward" if fmt.quantized else f"{name}_experts_forward"
    forward = getattr(hf_moe, fn_name, None)
    if forward is None:
        return None, f"transformers has no {fn_name}"

    def apply_gate(gu: torch.Tensor) -> torch.Tensor:
        return apply_activation(block.activation, *split_gate_up(block, gu))  # [S, F]

    def fn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        mod = types.SimpleNamespace(
            num_experts=block.E, has_gate=True, has_bias=block.layout.has_bias,
            is_transposed=block.layout.transposed, is_concatenated=True, has_post_expert_norm=False,
            _is_expert_parallel=False, gate_up_proj=w.gate_up, down_proj=w.down,
            gate_up_proj_bias=w.gate_up_bias, down_proj_bias=w.down_bias,
            _apply_gate=apply_gate, act_fn=torch.nn.functional.silu,
        )
        if fmt.quantized:  # FP8Experts' own attributes: its scales, block and activation scheme
            mod.gate_up_proj_scale_inv, mod.down_proj_scale_inv = w.gate_up_scale, w.down_scale
            mod.block_size, mod.activation_scheme = fmt.block, "dynamic"
        return forward(mod, x, ids, weights)  # [T, D]

    return fn, f"transformers:{fn_name.removesuffix('_experts_forward')}"
