"""hybrid: experts with m_e ≥ R rows through grouped GEMM tiles of tile_m rows, the rest through light tiles
of light_tile_m rows — both passes the grouped matmul kernels of grouped_gemm.py.

The light side is the grouped GEMM with a small row tile, not a separate GEMV kernel: on a TPU a
matrix-vector product runs on the MXU as a matmul with few rows either way, and a light expert's tile
(light_tile_m ≥ 16 rows, one per bf16 sublane tile) streams its weights once for all of its < R rows,
which is the GEMV's work; what it saves over one grouped GEMM is the padded rows of large tiles.

    route      once (grouped_gemm.route): rows sorted by expert, sentinels last
    rows       xs [Pp, D], ws [Pp, 1] (Pp = P rounded up to both row tiles, powers of two)
    heavy      tiles of the experts with counts ≥ R (tile_m rows), both GEMMs → h_H, y_H
    light      tiles of the experts with 1 ≤ counts < R (light_tile_m rows), both GEMMs → h_L, y_L
    combine    each pair takes y_H or y_L by its expert's side, then grouped_gemm.combine (f32 unsort + sum)

Rows a pass does not own are never written by it (masked stores), and a matmul row depends only on its
own lhs row, so each side reads the other side's rows of a shared tile as garbage that lands nowhere.
Weight formats: grouped_gemm's (block-quantised FP8 as w8a16). R is the Schedule's row_threshold (≥ 2,
checked by the IR; by default the policy's, moetune.passes.policy.hybrid_threshold).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ...passes.policy import hybrid_threshold, rows_per_active
from ...passes.stats import uniform
from ...targets import Target
from ..contract import KernelKind, sources
from ..space import ParamSpace
from . import grouped_gemm as gg
from . import tiles as gt
from ._common import JaxExperts, bridged, interpret

SOURCES = ("hybrid.py", "grouped_gemm.py", "tiles.py", "_common.py", "reference.py")

LIGHT_M_CHOICES = (16, 32)


@dataclass(frozen=True)
class HybridParams:
    """The heavy side's tiles (as grouped_gemm's GemmParams) and the light side's row tile; the light side
    takes the heavy side's column and reduction tiles."""

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 512
    down_tile_n: int = 256
    down_tile_k: int = 512
    light_tile_m: int = 16

    def __post_init__(self) -> None:
        gt.check_tiles("HybridParams", self.tile_m, self.tile_n, self.tile_k, self.down_tile_n, self.down_tile_k)
        gt.check_tiles("HybridParams (light)", self.light_tile_m)
        for name in ("tile_m", "light_tile_m"):
            v = getattr(self, name)
            if v & (v - 1):
                raise UnsupportedSchedule(f"HybridParams.{name} = {v}: a power of two (both row tiles divide "
                                          "the padded row count)")


def light_tiles(p: HybridParams) -> tuple[gt.Tiles, gt.Tiles]:
    return (gt.Tiles(p.light_tile_m, p.tile_n, p.tile_k), gt.Tiles(p.light_tile_m, p.down_tile_n, p.down_tile_k))


def check(p: HybridParams, block: MoEBlock, target: Target) -> None:
    gt.check_block(block)
    gt.check_divides(block, gt.gate_up_tiles(p), gt.down_tiles(p))
    gt.check_vmem(block, target, {"HybridParams heavy": (gt.gate_up_tiles(p), gt.down_tiles(p)),
                                  "HybridParams light": light_tiles(p)})


def space(block: MoEBlock, target: Target) -> ParamSpace:
    return ParamSpace(HybridParams, (*gt.tile_choices(block), ("light_tile_m", LIGHT_M_CHOICES)),
                      check=partial(check, block=block, target=target))


def sides(block: MoEBlock, T: int, R: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((rows, experts) heavy, (rows, experts) light): the expected split at T under uniform routing."""
    model = uniform(block.E, block.k)
    P, distinct = T * block.k, model.distinct(T)
    heavy_rows, heavy = P * model.row_share_ge(T, R), distinct * model.share_ge(T, R)
    return (heavy_rows, heavy), (P - heavy_rows, distinct - heavy)


@functools.lru_cache(maxsize=1024)
def default_params(block: MoEBlock, T: int, target: Target) -> HybridParams:
    """The heavy side's tiles of least modelled time (grouped_gemm.fastest) over the rows and experts the
    uniform router puts at or above R (the policy's threshold at T); the light side's 16-row tiles
    (experts below R ≤ 32 rows: one or two tiles each)."""
    R = hybrid_threshold(rows_per_active(block, T))
    (rows, experts), _ = sides(block, T, R)
    gu, dn = gt.fastest(block, target, max(rows, 1.0), max(experts, 1.0))
    return HybridParams(gu.m, gu.n, gu.k, dn.n, dn.k, LIGHT_M_CHOICES[0])


def cost(block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
    """(flops, bytes): the two sides' GEMMs (grouped_gemm.pass_cost) over their expected rows and experts,
    plus the glue."""
    p, R = schedule.params, schedule.row_threshold
    (hr, he), (lr, le) = sides(block, tokens, R)
    lgu, ldn = light_tiles(p)
    f1, b1, _ = gt.pass_cost(block, gt.gate_up_tiles(p), gt.down_tiles(p), hr, he)
    f2, b2, _ = gt.pass_cost(block, lgu, ldn, lr, le)
    return f1 + f2, b1 + b2 + gt.glue_bytes(block, tokens)


def experts_fn(block: MoEBlock, p: HybridParams, R: int, interp):
    """The JaxExpertsFn of HybridParams `p` and threshold R, its pallas_calls given `interp` as interpret=."""
    import jax.numpy as jnp

    gt.check_block(block)
    heavy_t = (gt.gate_up_tiles(p), gt.down_tiles(p))
    light_t = light_tiles(p)
    gt.check_divides(block, *heavy_t)

    def fn(x, ids, weights, w: JaxExperts):
        T, k = ids.shape
        if T == 0:
            return jnp.zeros_like(x)
        r = gg.route(block, ids)
        rows = gg.round_up(T * k, max(p.tile_m, p.light_tile_m))
        xs, ws = gg.sorted_rows(x, weights, r.order, k, rows)
        heavy = r.counts >= R  # [E]
        ys = []
        for active, (gu_t, dn_t) in ((heavy, heavy_t), (~heavy, light_t)):
            meta = gg.tile_metadata(r, active, gu_t.m, rows)
            h = gg.gate_up_pass(block, gu_t, xs, ws, w, r, meta, interp)
            ys.append(gg.unsorted(gg.down_pass(block, dn_t, h, ws, w, r, meta, interp), r.order))
        pair_heavy = jnp.concatenate([heavy, jnp.zeros(1, bool)])[r.key]  # [P]; sentinels: light, masked later
        return gg.combine(jnp.where(pair_heavy[:, None], *ys), ids, block, x.dtype)

    return fn


def build_jax(block: MoEBlock, schedule: Schedule):
    return experts_fn(block, schedule.params, schedule.row_threshold, interpret())


def build(block: MoEBlock, schedule: Schedule):
    return bridged(block, build_jax(block, schedule))


KIND = KernelKind("hybrid", HybridParams, space, default_params, build, cost, sources(__file__, SOURCES),
                  refusal=gt.refusal, formats=gg.FORMATS, build_jax=build_jax)
