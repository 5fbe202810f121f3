"""What every backend's kernels take: the model's own expert tensors, in place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ir import IRError, MoEBlock


@dataclass(frozen=True)
class ExpertTensors:
    """References to the experts module's parameters (never copies).

    standard layout:   gate_up [E, 2F, D], down [E, D, F]
    transposed layout: gate_up [E, D, 2F], down [E, F, D]
    biases (has_bias): gate_up_bias [E, 2F], down_bias [E, D]
    block scales (weight format fp8_block, blocks (r, c), standard layout; moetune.codegen.quant):
                       gate_up_scale [E, 2F/r, D/c], down_scale [E, D/r, F/c]   (the `*_scale_inv` tensors)
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @classmethod
    def of(cls, experts: torch.nn.Module) -> ExpertTensors:
        """The tensors of a transformers experts module (attributes of the experts hook)."""
        return cls(
            experts.gate_up_proj,
            experts.down_proj,
            getattr(experts, "gate_up_proj_bias", None),
            getattr(experts, "down_proj_bias", None),
            getattr(experts, "gate_up_proj_scale_inv", None),
            getattr(experts, "down_proj_scale_inv", None),
        )

    def check(self, block: MoEBlock) -> None:
        """Shapes against the block's layout; IRError names the tensor and both shapes."""
        lay = block.layout
        want = {
            "gate_up": lay.gate_up_shape(block.E, block.D, block.F),
            "down": lay.down_shape(block.E, block.D, block.F),
        }
        if lay.has_bias:
            want["gate_up_bias"] = (block.E, 2 * block.F)
            want["down_bias"] = (block.E, block.D)
        fmt = block.weight_format
        if fmt.quantized:
            r, c = fmt.block
            want["gate_up_scale"] = (block.E, -(-2 * block.F // r), -(-block.D // c))
            want["down_scale"] = (block.E, -(-block.D // r), -(-block.F // c))
        for name, shape in want.items():
            t = getattr(self, name)
            if t is None or tuple(t.shape) != shape:
                got = None if t is None else tuple(t.shape)
                raise IRError(f"ExpertTensors({block.name or block.signature_hash()})", name, got,
                              f"layout {lay} needs {shape}")


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertTensors], torch.Tensor]
