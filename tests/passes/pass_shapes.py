"""Four real models' expert shapes, as MoEBlocks (E, k, D, F; bf16 weights)."""

from moetune.ir import MoEBlock

GPU_SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
    "qwen3.5-397b-a17b": (512, 10, 4096, 1024),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def gpu_block(name: str, T_max: int = 4096) -> MoEBlock:
    E, k, D, F = GPU_SHAPES[name]
    return MoEBlock(E, k, D, F, T_max=T_max, name=name)
