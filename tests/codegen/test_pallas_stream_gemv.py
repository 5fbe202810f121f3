"""The Pallas TPU stream_gemv kernels (moetune.codegen.pallas_tpu.stream_gemv, stream_gemv_fp8): against the
float32 torch reference in TPU interpret mode with race detection, every layout, activation, weight
application, dtype and weight format, the routing corner cases and sentinel ids; lowered for TPU at the
presets' real shapes on every TPU target; their spaces within VMEM and holding their defaults."""

from __future__ import annotations

import os

import pytest
import torch

jax = pytest.importorskip("jax")
os.environ["MOETUNE_PALLAS_INTERPRET"] = "races"  # TPU interpret mode, DMA races detected (read per call)

import jax.numpy as jnp  # noqa: E402

from moetune.codegen.backend import get  # noqa: E402
from moetune.codegen.pallas_tpu import stream_gemv as sg  # noqa: E402
from moetune.codegen.pallas_tpu import stream_gemv_fp8 as sg8  # noqa: E402
from moetune.codegen.pallas_tpu._common import JaxExperts, jax_experts  # noqa: E402
from moetune.codegen.torch import experts_reference  # noqa: E402
from moetune.codegen.torch.tolerance import worst_error  # noqa: E402
from moetune.ir import Activation, MoEBlock, Schedule, UnsupportedSchedule, WeightFormat, WeightLayout  # noqa: E402
from moetune.ir.presets import preset  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402
from moetune.targets import get_target  # noqa: E402

CLAMPED = Activation("clamped_swiglu", alpha=1.702, limit=7.0)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TPUS = ("tpu-v5e", "tpu-v6e", "tpu-v7")
PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "qwen3.5-397b-a17b", "mixtral-8x7b")
SPLIT = sg.PallasGemvParams(block_f=128, split=2)  # F = 256 in two splits of one F-block
DMA = sg.PallasGemvParams(block_f=128, stream="dma", buffers=3)  # two F-blocks, the loads three deep


def _schedule(params) -> Schedule:
    return Schedule("stream_gemv", backend="pallas_tpu", params=params)


def _inputs(block: MoEBlock, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[block.weight_format.compute_dtype]
    x = torch.randn(T, block.D, generator=g).to(dt)
    ids = torch.stack([torch.randperm(block.E, generator=g)[: block.k] for _ in range(T)])  # [T, k]
    wts = torch.softmax(torch.randn(T, block.k, generator=g), 1).to(dt)
    return x, ids, wts


def _check(block: MoEBlock, params, x, ids, wts, w=None, fn=None):
    w = w if w is not None else expert_tensors(block, seed=3)
    fn = fn or get("pallas_tpu").build(block, _schedule(params))
    out = fn(x, ids, wts, w)
    assert out.dtype == x.dtype and out.shape == x.shape
    err = worst_error(out, experts_reference(block, x, ids, wts, w))
    assert err <= 1, err


VARIANTS = {
    "standard_f32": MoEBlock(E=8, k=2, D=256, F=256, weight_dtype="float32"),
    "standard_bf16": MoEBlock(E=8, k=2, D=256, F=256),
    "transposed_bias_f32": MoEBlock(E=8, k=2, D=256, F=256, weight_dtype="float32",
                                    layout=WeightLayout(transposed=True, has_bias=True)),
    "interleaved_clamped_bf16": MoEBlock(E=8, k=2, D=256, F=256, layout=WeightLayout(interleaved=True),
                                         activation=CLAMPED),
    "transposed_interleaved_bias_clamped_bf16": MoEBlock(
        E=8, k=2, D=256, F=256, activation=CLAMPED,
        layout=WeightLayout(transposed=True, interleaved=True, has_bias=True)),
    "weight_on_input_bias_f32": MoEBlock(E=8, k=2, D=256, F=256, weight_dtype="float32",
                                         weight_application="input", layout=WeightLayout(has_bias=True)),
    "weight_on_input_bf16": MoEBlock(E=8, k=2, D=256, F=256, weight_application="input"),
    "fp8_block": MoEBlock(E=8, k=2, D=256, F=256).with_weight_format(WeightFormat.fp8_block()),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_matches_the_reference_with_sentinels(name):
    """Every layout / activation / weight application / dtype / format, split over two cores, with the two
    kinds of sentinel (−1 and E), one of them weighted on the input with a bias (it still adds nothing)."""
    block = VARIANTS[name]
    x, ids, wts = _inputs(block, 5, seed=1)
    ids[0, 1], ids[3, 0] = -1, block.E
    _check(block, SPLIT, x, ids, wts)


@pytest.mark.parametrize("name", ["standard_f32", "transposed_interleaved_bias_clamped_bf16",
                                  "weight_on_input_bias_f32", "fp8_block"])
def test_own_dma_streams_match_the_reference(name):
    """stream="dma": the kernel's own copies, three loads deep, over two F-blocks (the loads wrap from the
    last expert of one F-block to the first of the next)."""
    block = VARIANTS[name]
    x, ids, wts = _inputs(block, 5, seed=2)
    ids[1, 0] = -1
    _check(block, DMA, x, ids, wts)


@pytest.mark.parametrize("params", [SPLIT, DMA], ids=["pipeline", "dma"])
def test_routing_corner_cases(params):
    """One kernel, several routings: zero-row experts (two experts take every pair), one hot expert taking
    a row of every token, one row per expert (T·k = E distinct), every id a sentinel (one load: fewer than
    the DMA buffers), and one token."""
    block = MoEBlock(E=8, k=2, D=256, F=256, weight_dtype="float32")
    w = expert_tensors(block, seed=5)
    fn = get("pallas_tpu").build(block, _schedule(params))
    x, _, wts = _inputs(block, 4, seed=2)
    two = torch.tensor([[3, 6], [6, 3], [3, 6], [6, 3]])
    hot = torch.tensor([[5, 0], [1, 5], [5, 7], [2, 5]])
    each = torch.randperm(8, generator=torch.Generator().manual_seed(0)).reshape(4, 2)
    none = torch.tensor([[-1, 8], [8, -1], [-1, -1], [9, 8]])
    for ids in (two, hot, each, none):
        _check(block, params, x, ids, wts, w, fn)
    _check(block, params, x[:1], each[:1], wts[:1], w, fn)


def test_k1_more_tokens_than_block_t_and_none():
    """k = 1; T = 19 > block_t = 8: two calls of 8 tokens (one kernel scanned) and one of 3; T = 0."""
    block = MoEBlock(E=8, k=1, D=256, F=256)
    w = expert_tensors(block, seed=3)
    fn = get("pallas_tpu").build(block, _schedule(sg.PallasGemvParams(block_f=256, block_t=8)))
    x, ids, wts = _inputs(block, 19, seed=4)
    _check(block, None, x, ids, wts, w, fn)
    _check(block, None, x[:0], ids[:0], wts[:0], w, fn)


@pytest.mark.parametrize("p", [sg.PallasGemvParams(block_f=128), DMA], ids=["pipeline", "dma"])
def test_an_unmapped_out_of_range_id_is_caught_by_the_bounds_check(p):
    """Interpret mode's bounds check is live: the pallas_call given an expert id of E as a DMA index
    raises (a block index of the pipeline, a window of an own copy); the same ids through pair_scalars
    (sentinels mapped) run and add nothing for the sentinel."""
    block = MoEBlock(E=8, k=2, D=256, F=256, weight_dtype="float32")
    tw = expert_tensors(block, seed=1)
    w = jax_experts(tw)
    x, _, wts = _inputs(block, 2, seed=0)
    ids = torch.tensor([[0, 8], [1, 2]])
    eid, tok, s_in, s_out = sg.pair_scalars(block, jnp.asarray(ids.numpy(), jnp.int32), jnp.asarray(wts.numpy()))
    assert 8 not in eid.tolist() and float(s_out[-1]) == 0.0  # the sentinel sorts last, weighted 0
    xj = jnp.asarray(x.numpy())
    raw = jnp.asarray(ids.reshape(-1).numpy(), jnp.int32)  # [P] in pair order, id 8 unmapped
    with pytest.raises(Exception, match="Out-of-bounds (block index|read)"):
        jax.block_until_ready(sg.pallas_gemv(block, p, raw, jnp.array([0, 0, 1, 1], jnp.int32), s_in, s_out, xj, w))
    out = sg.pallas_gemv(block, p, eid, tok, s_in, s_out, xj, w).sum(axis=0)
    err = worst_error(torch.from_dlpack(out), experts_reference(block, x, ids, wts, tw))
    assert err <= 1, err


# ---------------------------------------------------------------------------------------------- TPU lowering


def _abstract(block: MoEBlock, T: int):
    """ShapeDtypeStructs of x, ids, weights and the experts at the block's real shapes (nothing allocated)."""
    S = jax.ShapeDtypeStruct
    E, D, F, lay = block.E, block.D, block.F, block.layout
    cdt = jnp.dtype(block.weight_format.compute_dtype)
    wdt = jnp.float8_e4m3fn if block.weight_format.quantized else cdt
    gs = ds = gb = db = None
    if block.weight_format.quantized:
        gs, ds = S((E, 2 * F // 128, D // 128), jnp.float32), S((E, D // 128, F // 128), jnp.float32)
    if lay.has_bias:
        gb, db = S((E, 2 * F), cdt), S((E, D), cdt)
    w = JaxExperts(S(lay.gate_up_shape(E, D, F), wdt), S(lay.down_shape(E, D, F), wdt), gb, db, gs, ds)
    return S((T, D), cdt), S((T, block.k), jnp.int32), S((T, block.k), cdt), w


def _lower(block: MoEBlock, params, T: int) -> str:
    fn = sg.build_jax(block, _schedule(params), interpret_mode=False)
    return jax.jit(fn).trace(*_abstract(block, T)).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("target", TPUS)
@pytest.mark.parametrize("name", PRESETS + tuple(f"{n}-fp8" for n in PRESETS))
def test_every_default_lowers_for_tpu_at_the_presets_shapes(name, target):
    block, tgt = preset(name), get_target(target)
    if block.weight_format.quantized and tgt.fp8_flops is None:
        with pytest.raises(UnsupportedSchedule, match="no FP8 units"):
            sg8.default_params(block, 1, tgt)
        return
    for T in (1, 8):
        p = sg.default_params(block, T, tgt)
        assert "tpu_custom_call" in _lower(block, p, T)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3-fp8"])
def test_space_points_lower_for_tpu(name):
    """The space's first point, its largest admitted footprint, its widest token block and its deepest own-DMA
    point, lowered (tpu-v7)."""
    block, tgt = preset(name), get_target("tpu-v7")
    space = sg.space(block, tgt)
    admitted = []
    for values in space.grid():
        try:
            admitted.append(space.make(**values))
        except UnsupportedSchedule:
            pass
    picks = {admitted[0], max(admitted, key=lambda p: sg.footprint(block, p)),
             max(admitted, key=lambda p: (p.block_t, -p.block_f)),
             max((p for p in admitted if p.stream == "dma"), key=lambda p: (p.buffers, p.split, p.block_f))}
    for p in picks:
        assert "tpu_custom_call" in _lower(block, p, 8)


def test_lowering_refuses_an_untileable_block():
    """The tiling rules are checked where the lowering checks them: a block of D = 200 is refused at build."""
    block = MoEBlock(E=8, k=2, D=200, F=256)
    assert "D = 200" in sg.refusal(block)
    with pytest.raises(UnsupportedSchedule, match="D = 200"):
        sg.build_jax(block, _schedule(sg.PallasGemvParams()))


# ---------------------------------------------------------------------------------------------- spaces


@pytest.mark.parametrize("target", TPUS)
@pytest.mark.parametrize("name", PRESETS + tuple(f"{n}-fp8" for n in PRESETS))
def test_the_space_respects_vmem_and_holds_the_default(name, target):
    block, tgt = preset(name), get_target(target)
    space = sg.space(block, tgt)
    limit = 0.75 * tgt.vmem_bytes
    admitted = 0
    for values in space.grid():
        try:
            p = space.make(**values)
        except UnsupportedSchedule as e:
            assert str(e)
            continue
        admitted += 1
        assert sg.footprint(block, p) <= limit and sg.vmem_limit(block, p) < tgt.vmem_bytes
        assert p.split <= tgt.cores and block.F % (p.block_f * p.split) == 0
    if block.weight_format.quantized and tgt.fp8_flops is None:
        assert admitted == 0
        return
    assert admitted
    for T in (1, 8, 64, 4096):
        d = sg.default_params(block, T, tgt)
        assert space.admit(d) is d
        assert all(getattr(d, f) in vals for f, vals in space.choices)
        flops, moved = sg.cost(block, _schedule(d), T)
        assert flops > 0 and moved >= block.weight_bytes_per_expert


def test_bad_params_and_blocks_are_refused_with_the_reason():
    with pytest.raises(UnsupportedSchedule, match="block_f = 100"):
        sg.PallasGemvParams(block_f=100)
    with pytest.raises(UnsupportedSchedule, match="split = 3"):
        sg.PallasGemvParams(split=3)
    with pytest.raises(UnsupportedSchedule, match="buffers = 3"):
        sg.PallasGemvParams(buffers=3)  # the BlockSpec pipeline is double-buffered
    with pytest.raises(UnsupportedSchedule, match="stream = 'async'"):
        sg.PallasGemvParams(stream="async")
    block = MoEBlock(E=8, k=2, D=256, F=384)
    with pytest.raises(UnsupportedSchedule, match="multiple of block_f"):
        sg.space(block, get_target("tpu-v7")).make(block_f=256, split=1, block_t=8)
    with pytest.raises(UnsupportedSchedule, match="1 TensorCore"):
        sg.space(MoEBlock(E=8, k=2, D=256, F=256), get_target("tpu-v6e")).make(block_f=128, split=2, block_t=8)
    with pytest.raises(UnsupportedSchedule, match="over"):
        sg.space(preset("deepseek-v3"), get_target("tpu-v7")).make(block_f=2048, split=1, block_t=32)
    assert "fp8_block" in sg8.refusal(MoEBlock(E=8, k=2, D=256, F=256))
    with pytest.raises(UnsupportedSchedule, match="fp8_block"):
        sg8.build_jax(MoEBlock(E=8, k=2, D=256, F=256), _schedule(sg.PallasGemvParams()))
