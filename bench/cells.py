"""The kernels suite's cells: the four presets' shapes, the twelve token counts, the best open-source figure of
each cell (the bar to beat, bench/README.md), the target the floors and table rows are of, and the names of the
results files. The other GPU suites take their target and file names from here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moetune.ir import MoEBlock
from moetune.ir.presets import preset
from moetune.runtime.versions import target_of
from moetune.targets import DEFAULT_GPU

ROOT = Path(__file__).resolve().parents[1]
SHAPE_NAMES = ("qwen3-30b-a3b", "deepseek-v3", "qwen3.5-397b-a17b", "mixtral-8x7b")
SHAPES = {n: (b.E, b.k, b.D, b.F) for n, b in ((n, preset(n)) for n in SHAPE_NAMES)}  # name: (E, k, D, F)
TOKENS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# graph-mode µs of the best open-source experts implementation per cell (bench/README.md: the bar to beat)
BEST_OPEN = {
    "qwen3-30b-a3b": (37.0, 53.7, 70.0, 84.3, 137, 206, 272, 307, 313, 344, 364, 433),
    "deepseek-v3": (189, 343, 493, 646, 1264, 2005, 3194, 4359, 5226, 5374, 5492, 6295),
    "qwen3.5-397b-a17b": (81.4, 142, 199, 257, 479, 816, 1388, 2116, 2771, 3069, 3164, 3665),
    "mixtral-8x7b": (188, 344, 437, 447, 582, 660, 688, 669, 688, 758, 1069, 1664),
}
# the same for FP8 experts: the open-source Triton fused MoE, w8a8, 128×128 weight blocks, dynamic 1×128
# activation groups, its shipped H200 configuration where one exists (bench/README.md)
BEST_OPEN_FP8 = {
    "qwen3-30b-a3b": (33.0, 41.0, 50.0, 56.3, 86.2, 120, 156, 173, 186, 230, 260, 366),
    "deepseek-v3": (104, 184, 266, 345, 648, 1025, 1625, 2193, 2792, 2914, 3043, 3247),
    "qwen3.5-397b-a17b": (53.3, 81.8, 112, 138, 249, 429, 717, 1077, 1557, 1723, 1817, 1955),
    "mixtral-8x7b": (120, 188, 226, 229, 305, 349, 356, 386, 410, 576, 864, 1516),
}
N_ROUT = 32
# the target of the floors and of the table's rows: this machine's GPU (DEFAULT_GPU off a GPU)
TARGET = target_of("cuda") if torch.cuda.is_available() else DEFAULT_GPU
WEIGHTS = ("bf16", "fp8")  # --weights: the presets' bf16 experts, or the same quantised per 128×128 block


def bench_block(shape: str, weights: str = "bf16") -> MoEBlock:
    """The routed experts of a preset as the bench times them: its E, k, D, F in bf16 (bf16 routing weights,
    as transformers' experts functions are handed them here); with weights "fp8" the same experts stored as
    float8_e4m3fn with fp32 scales per 128×128 block, activations bf16."""
    from moetune.ir import WeightFormat

    E, k, D, F = SHAPES[shape]
    block = MoEBlock(E=E, k=k, D=D, F=F, name=shape)
    return block.with_weight_format(WeightFormat.fp8_block()) if weights == "fp8" else block


def best_open(shape: str, T: int, weights: str) -> float | None:
    figures = (BEST_OPEN_FP8 if weights == "fp8" else BEST_OPEN)[shape]
    return figures[TOKENS.index(T)] if T in TOKENS else None


def device_stem() -> str:
    """This GPU's name as the results files begin with it (`nvidia-h200`)."""
    return torch.cuda.get_device_name().replace(" ", "-").lower()
