"""Four real models' expert shapes, as MoEBlocks (the shipped presets' E, k, D, F; bf16 weights)."""

from moetune.ir import MoEBlock
from moetune.ir.presets import preset

GPU_SHAPES = {name: (b.E, b.k, b.D, b.F) for name, b in (
    (n, preset(n)) for n in ("qwen3-30b-a3b", "deepseek-v3", "qwen3.5-397b-a17b", "mixtral-8x7b"))}


def gpu_block(name: str, T_max: int = 4096) -> MoEBlock:
    E, k, D, F = GPU_SHAPES[name]
    return MoEBlock(E, k, D, F, T_max=T_max, name=name)
