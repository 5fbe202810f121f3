"""The TPU backend's grouped GEMM tiles and its tile rule: the parameters of the grouped GEMM (`GemmParams`), their
VMEM footprints and checks, the space, and the modelled time the defaults minimise.

The rule: `default_params(block, T, target)` is the candidate of least modelled time (`seconds`) at T tokens.
P = T·k rows over T·k / rows_per_active(block, T) active experts fill P/tile_m + experts tiles; each tile streams
its expert's weights and re-reads its rows once per output column tile; the MXU time pads tile columns and
reduction steps to the systolic array (128 on v5e, 256 on v6e and v7); each grid step costs target.grid_step_s.
Few rows per expert pick small row tiles (the weights dominate, padded rows waste MXU time); many rows pick large
ones (fewer weight re-reads). The hybrid's heavy side takes the same rule (`fastest`) over its rows; the GEMV's
default minimises its own model (stream_gemv.py). There are no cuts: the model places them per target.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from ...ir import DTYPE_BYTES, MoEBlock, Schedule, UnsupportedSchedule
from ...passes.policy import rows_per_active
from ...passes.stats import uniform_distinct
from ...targets import Target
from ..space import ParamSpace

LANE = 128  # TPU vector lanes: the last dimension of every block
ROW_TILE = 16  # rows per sublane tile of a 16-bit operand (f32: 8), the step of tile_m
MXU = {"tpu-v5e": 128, "tpu-v6e": 256, "tpu-v7": 256}  # systolic array side per target (others: 128)
FP8_BLOCKS_PER_TILE = 4  # scale blocks per block-quantised weight tile: each is one unrolled matmul of the body
VMEM_SHARE = 0.75  # a space's double-buffered tiles fill at most this share of a core's VMEM
M_CHOICES = (16, 32, 64, 128, 256, 512)
N_CHOICES = (128, 256, 512, 1024)
K_CHOICES = (128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class GemmParams:
    """Tiles of the two grouped GEMMs (module doc).

    tile_m       rows of a tile (both GEMMs; a multiple of 16)
    tile_n       gate/up: F columns per tile (a gate and an up tile each)
    tile_k       gate/up: D per K step
    down_tile_n  down: D columns per tile
    down_tile_k  down: F per K step
    """

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 512
    down_tile_n: int = 256
    down_tile_k: int = 512

    def __post_init__(self) -> None:
        check_tiles("GemmParams", self.tile_m, self.tile_n, self.tile_k, self.down_tile_n, self.down_tile_k)


def check_tiles(name: str, tile_m: int, *lane_tiles: int) -> None:
    if not isinstance(tile_m, int) or tile_m < ROW_TILE or tile_m % ROW_TILE:
        raise UnsupportedSchedule(f"{name}.tile_m = {tile_m!r}: a positive multiple of {ROW_TILE}")
    bad = [t for t in lane_tiles if not isinstance(t, int) or t < LANE or t % LANE]
    if bad:
        raise UnsupportedSchedule(f"{name}: tiles {bad} are not positive multiples of {LANE} (TPU lanes)")


class Tiles(NamedTuple):
    """One GEMM pass's tiles: rows, output columns, reduction step."""

    m: int
    n: int
    k: int


def gate_up_tiles(p) -> Tiles:
    return Tiles(p.tile_m, p.tile_n, p.tile_k)


def down_tiles(p) -> Tiles:
    return Tiles(p.tile_m, p.down_tile_n, p.down_tile_k)


def refusal(block: MoEBlock) -> str | None:
    if block.D % LANE or block.F % LANE:
        return (f"pallas_tpu grouped GEMM tiles D and F in multiples of {LANE} (TPU lanes); "
                f"D = {block.D}, F = {block.F}")
    fmt = block.weight_format
    if fmt.quantized:
        r, c = fmt.block
        if fmt.scale_dtype != "float32":
            return f"pallas_tpu FP8 GEMMs read float32 block scales, not {fmt.scale_dtype}"
        if r % LANE or c % LANE or block.D % r or block.F % r or block.D % c or block.F % c:
            return (f"pallas_tpu FP8 GEMMs need scale blocks {r}×{c} in multiples of {LANE} that divide "
                    f"D = {block.D} and F = {block.F} (whole blocks per tile)")
    return None


# ---- VMEM footprints, the space ------------------------------------------------------------------------

def gate_up_vmem(block: MoEBlock, t: Tiles, xb: int, wb: int) -> int:
    """Bytes of VMEM the gate/up pass holds: double-buffered x, weight, bias, routing-weight and h tiles,
    the f32 accumulators and the epilogue's f32 values (interleaved: the two 0/1 selection matrices)."""
    by = 2 * t.m * t.k * xb + 2 * 2 * t.n * t.k * wb + 2 * t.m * t.n * xb  # x, gate + up, h
    by += 2 * t.m * t.n * 4 + 3 * t.m * t.n * 4  # accumulators; gate, up, h values
    if block.weight_application == "input":
        by += 2 * t.m * LANE * 4  # [tile_m, 1] f32, lane-padded
    if block.layout.has_bias:
        by += 2 * 2 * 8 * t.n * wb  # [1, tile_n] rows, sublane-padded
    if block.layout.interleaved:
        by += 2 * 2 * t.n * t.n * 4
    return by


def down_vmem(block: MoEBlock, t: Tiles, xb: int, wb: int) -> int:
    """Bytes of VMEM the down pass holds: double-buffered h, weight, bias, routing-weight and y tiles, the
    f32 accumulator and the epilogue's value."""
    by = 2 * t.m * t.k * xb + 2 * t.n * t.k * wb + 2 * t.m * t.n * 4 + 2 * t.m * t.n * 4
    if block.weight_application == "output":
        by += 2 * t.m * LANE * 4
    if block.layout.has_bias:
        by += 2 * 8 * t.n * wb
    return by


def dtype_bytes(block: MoEBlock) -> tuple[int, int]:
    """(activation bytes, weight bytes) per element."""
    return DTYPE_BYTES[block.weight_format.compute_dtype], DTYPE_BYTES[block.weight_dtype]


def check_vmem(block: MoEBlock, target: Target, passes: dict[str, tuple[Tiles, Tiles]]) -> None:
    """UnsupportedSchedule when a pass's tiles fill more than VMEM_SHARE of the target's VMEM per core.
    `passes`: name → (gate/up tiles, down tiles)."""
    xb, wb = dtype_bytes(block)
    limit = VMEM_SHARE * target.vmem_bytes
    for name, (gu, dn) in passes.items():
        for what, by in (("gate/up", gate_up_vmem(block, gu, xb, wb)), ("down", down_vmem(block, dn, xb, wb))):
            if by > limit:
                raise UnsupportedSchedule(
                    f"{name} {what} tiles {tuple(gu if what == 'gate/up' else dn)} hold {by / 2**20:.1f} MiB of "
                    f"VMEM, over {VMEM_SHARE:.0%} of {target.name}'s {target.vmem_bytes / 2**20:.0f} MiB per core")


def check_divides(block: MoEBlock, gu: Tiles, dn: Tiles) -> None:
    """Each tile divides its dimension; with block-quantised weights each tile holds whole scale blocks."""
    fmt = block.weight_format
    r, c = fmt.block if fmt.quantized else (1, 1)
    for name, tile, dim, blk in (("tile_n", gu.n, block.F, r), ("tile_k", gu.k, block.D, c),
                                 ("down_tile_n", dn.n, block.D, r), ("down_tile_k", dn.k, block.F, c)):
        if dim % tile:
            raise UnsupportedSchedule(f"{name} = {tile} does not divide its dimension {dim}")
        if tile % blk:
            raise UnsupportedSchedule(f"{name} = {tile} does not hold whole {fmt.block} scale blocks")
    if fmt.quantized:
        for name, t in (("gate/up", gu), ("down", dn)):
            if (t.n // r) * (t.k // c) > FP8_BLOCKS_PER_TILE:
                raise UnsupportedSchedule(f"{name} tile {t.n}×{t.k} holds {(t.n // r) * (t.k // c)} scale blocks "
                                          f"{fmt.block}, over {FP8_BLOCKS_PER_TILE} (one unrolled matmul each)")


def check_block(block: MoEBlock) -> None:
    why = refusal(block)
    if why:
        raise UnsupportedSchedule(why)


def check(p: GemmParams, block: MoEBlock, target: Target) -> None:
    check_block(block)
    check_divides(block, gate_up_tiles(p), down_tiles(p))
    check_vmem(block, target, {"GemmParams": (gate_up_tiles(p), down_tiles(p))})


def divisors(dim: int, choices: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(c for c in choices if dim % c == 0) or (LANE,)


def tile_choices(block: MoEBlock) -> tuple[tuple[str, tuple], ...]:
    return (
        ("tile_m", M_CHOICES),
        ("tile_n", divisors(block.F, N_CHOICES)),
        ("tile_k", divisors(block.D, K_CHOICES)),
        ("down_tile_n", divisors(block.D, N_CHOICES)),
        ("down_tile_k", divisors(block.F, K_CHOICES)),
    )


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(GemmParams, tile_choices(block), check=partial(check, block=block, target=target))


# ---- the cost model -------------------------------------------------------------------------------------

def tile_visits(P: float, distinct: float, tm: int) -> float:
    """Expected grid tiles of P sorted rows over `distinct` active experts: the full tiles plus one tile
    per expert boundary inside a tile."""
    return P / tm + distinct if P else 0.0


def pass_cost(block: MoEBlock, gu: Tiles, dn: Tiles, P: float, distinct: float) -> tuple[float, float, float]:
    """(flops, bytes, grid steps) of the two GEMMs over P rows of `distinct` experts. Each tile visit
    streams its expert's weight tiles (the K axis is innermost), each tile's rows are read once per output
    column tile; flops count the tiles' padded rows."""
    xb, wb = dtype_bytes(block)
    D, F = block.D, block.F
    tiles = tile_visits(P, distinct, gu.m)
    flops = 2.0 * 3 * tiles * gu.m * D * F
    by = tiles * block.weight_bytes_per_expert
    by += tiles * gu.m * (D * xb * (F // gu.n) + F * xb)  # gate/up: x rows per column tile, h out
    by += tiles * dn.m * (F * xb * (D // dn.n) + D * 4)  # down: h rows per column tile, y out (f32)
    steps = math.ceil(tiles) * ((F // gu.n) * (D // gu.k) + (D // dn.n) * (F // dn.k))
    return flops, by, steps


def glue_bytes(block: MoEBlock, T: int) -> float:
    """Routing, the sorted copy of x, the combine: what every schedule of the file moves besides the GEMMs."""
    xb, _ = dtype_bytes(block)
    P = T * block.k
    return P * 4 * 4 + T * block.D * xb + 2 * P * block.D * xb + P * block.D * 4 + T * block.D * xb


def seconds(block: MoEBlock, target: Target, gu: Tiles, dn: Tiles, P: float, distinct: float) -> float:
    """Modelled time of one pass on `target`: max(MXU time, HBM time) + grid steps × target.grid_step_s, the MXU
    time counting tile columns and reduction steps padded to the systolic array's side."""
    flops, by, steps = pass_cost(block, gu, dn, P, distinct)
    mxu = MXU.get(target.name, LANE)

    def waste(t: int) -> float:
        return math.ceil(t / mxu) * mxu / t

    mxu_flops = flops * (2 * waste(gu.n) * waste(gu.k) + waste(dn.n) * waste(dn.k)) / 3
    return max(mxu_flops / target.peak_flops, by / target.bandwidth) + steps * target.grid_step_s


def candidates(block: MoEBlock, target: Target) -> list[tuple[Tiles, Tiles]]:
    """The points a default is picked from: every tile_m, and for each other tile the two largest choices
    that are multiples of the target's MXU side (all choices where none is); every choice for
    block-quantised weights (their tiles are bounded jointly by FP8_BLOCKS_PER_TILE)."""
    mxu = MXU.get(target.name, LANE)
    ch = dict(tile_choices(block))

    def best(name: str) -> tuple[int, ...]:
        if block.weight_format.quantized:
            return ch[name]
        fit = [v for v in ch[name] if v % mxu == 0] or list(ch[name])
        return tuple(fit[-2:])

    return [(Tiles(m, n, k), Tiles(m, dn_n, dn_k)) for m in ch["tile_m"] for n in best("tile_n")
            for k in best("tile_k") for dn_n in best("down_tile_n") for dn_k in best("down_tile_k")]


def fastest(block: MoEBlock, target: Target, P: float, distinct: float) -> tuple[Tiles, Tiles]:
    """The candidate of least modelled time whose tiles fit VMEM_SHARE of the target's VMEM."""
    xb, wb = dtype_bytes(block)
    limit = VMEM_SHARE * target.vmem_bytes
    fits = [(gu, dn) for gu, dn in candidates(block, target)
            if gate_up_vmem(block, gu, xb, wb) <= limit and down_vmem(block, dn, xb, wb) <= limit
            and _whole_blocks(block, gu, dn)]
    if not fits:
        raise UnsupportedSchedule(f"no grouped GEMM tiles of {block.D}×{block.F} fit {target.name}'s VMEM")
    return min(fits, key=lambda c: seconds(block, target, *c, P, distinct))


def _whole_blocks(block: MoEBlock, gu: Tiles, dn: Tiles) -> bool:
    try:
        check_divides(block, gu, dn)
    except UnsupportedSchedule:
        return False
    return True


@functools.lru_cache(maxsize=1024)
def default_params(block: MoEBlock, T: int, target: Target) -> GemmParams:
    """The tiles of least modelled time (`seconds`) at T tokens. The model: P = T·k rows over
    T·k / rows_per_active(block, T) active experts fill P/tile_m + experts tiles; each tile streams its
    expert's weights and re-reads its rows once per output column tile; the MXU time pads tile columns and
    reduction steps to the systolic array (128 on v5e, 256 on v6e and v7); each grid step costs
    target.grid_step_s. Few rows per expert pick small row tiles (the weights dominate, padded rows waste MXU
    time); many rows pick large ones (fewer weight re-reads)."""
    P = T * block.k
    gu, dn = fastest(block, target, P, P / rows_per_active(block, T))
    return GemmParams(gu.m, gu.n, gu.k, dn.n, dn.k)


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes) of one call: the two GEMMs' (padded rows, weights once per tile visit) and the glue."""
    p = schedule.params
    P = tokens * block.k
    flops, by, _ = pass_cost(block, gate_up_tiles(p), down_tiles(p), P, uniform_distinct(block.E, block.k, tokens))
    return flops, by + glue_bytes(block, tokens)
