"""The Pallas GPU backend (moetune.codegen.pallas_gpu) on CPU.

Numerics in Pallas' interpreter (MOETUNE_PALLAS_GPU_INTERPRET=1), every kind through its torch-facing build
(`bridged(build_jax)`) against the float32 torch reference, by the package's tolerance: routings with
zero-row experts, one hot expert, one row per expert, k = 1, sentinel ids and odd T, in f32 and bf16, with
tiles small enough that every K loop and grid axis takes several steps; FP8 block-quantised weights (the
GEMV and the w8a16 GEMM); every layout (standard, transposed,
interleaved, biases), both activations and both weight applications; each kind's default. Each build is
compiled once (a few seconds in the interpreter) and checked on several routings of one T.
Lowering for "cuda" without a GPU (the Triton lowering runs in Python): every kind's default at the real
shapes of qwen3-30b-a3b and qwen3.5-397b-a17b (and their -fp8 variants) over the token range; the FP8 GEMV at
qwen3.5-397b-a17b-fp8, whose 2^32-byte gate_up is read as uint32 words; and the lowered Triton IR of each
kernel compiled for sm_90 by Triton (where it is installed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest
import torch

pytest.importorskip("jax")

from moetune.codegen.backend import get  # noqa: E402
from moetune.codegen.pallas_gpu import GemmParams, GemvParams, HybridParams  # noqa: E402
from moetune.codegen.pallas_gpu import routing as tile_plan  # noqa: E402
from moetune.codegen.pallas_gpu._common import INTERPRET_ENV  # noqa: E402
from moetune.codegen.torch import experts_reference, worst_error  # noqa: E402
from moetune.ir import Activation, MoEBlock, Schedule, UnsupportedSchedule, WeightFormat, WeightLayout  # noqa: E402
from moetune.ir.presets import preset  # noqa: E402
from moetune.search.objective import expert_tensors  # noqa: E402

BE = get("pallas_gpu")
KINDS = ("stream_gemv", "grouped_gemm", "hybrid")
# tiles that divide D = 64, F = 32 several times: two K steps and two or more output tiles per projection
SMALL = {
    "stream_gemv": Schedule("stream_gemv", backend="pallas_gpu",
                            params=GemvParams(block_n=8, block_k=32, down_block_n=16, down_block_k=16)),
    "grouped_gemm": Schedule("grouped_gemm", backend="pallas_gpu",
                             params=GemmParams(block_m=16, block_n=16, block_k=16)),
    "hybrid": Schedule("hybrid", row_threshold=2, backend="pallas_gpu",
                       params=HybridParams(block_m=16, block_n=16, block_k=16, gemv_block_n=8, gemv_block_k=16)),
}


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "1")


def block_of(E=8, k=2, D=64, F=32, dtype="float32", act=None, layout=None, apply="output") -> MoEBlock:
    return MoEBlock(E=E, k=k, D=D, F=F, activation=act or Activation(), layout=layout or WeightLayout(),
                    weight_dtype=dtype, routing_weight_dtype=dtype, weight_application=apply, name="case")


def distinct_ids(T: int, E: int, k: int, gen: torch.Generator, pool: int | None = None) -> torch.Tensor:
    """[T, k]: k distinct experts per token drawn from the first `pool` experts (all E when None)."""
    return torch.stack([torch.randperm(pool or E, generator=gen)[:k] for _ in range(T)])


def routing(case: str, E: int, k: int, gen: torch.Generator, T: int = 7) -> torch.Tensor:
    """[T, k] ids of a named case (one_row_per_expert needs T·k = E)."""
    if case == "uniform":
        return distinct_ids(T, E, k, gen)
    if case == "zero_row_experts":  # experts k..E-1 get no row
        return distinct_ids(T, E, k, gen, pool=k)
    if case == "one_hot_expert":  # every token routes to expert 3 (the tile of many rows), the rest spread
        ids = distinct_ids(T, E - 1, k - 1, gen)
        return torch.cat([torch.full((T, 1), 3), ids + (ids >= 3).long()], dim=1)
    if case == "one_row_per_expert":
        return torch.randperm(E, generator=gen).view(T, k)
    if case == "sentinels":  # expert-parallel sentinels: below 0, E itself and beyond
        ids = distinct_ids(T, E, k, gen)
        ids[0, 0], ids[2, -1], ids[3, 0], ids[4, :] = -1, E, E + 5, -1
        return ids
    raise KeyError(case)


CASES = ("uniform", "zero_row_experts", "one_hot_expert", "one_row_per_expert", "sentinels")


def check(block: MoEBlock, schedule: Schedule, routings: list[torch.Tensor], seed: int = 0) -> None:
    """The build on fresh x and routing weights for each routing (one compile: the routings share T) against
    the float32 reference, within the package's tolerance of the dtype."""
    gen = torch.Generator().manual_seed(seed)
    w = expert_tensors(block, seed=seed)
    dt = getattr(torch, block.weight_format.compute_dtype)
    fn = BE.build(block, schedule)
    for ids in routings:
        T = ids.shape[0]
        x = torch.randn(T, block.D, generator=gen).to(dt)
        wts = torch.softmax(torch.randn(T, block.k, generator=gen), dim=1).to(dt)
        out = fn(x, ids, wts, w)
        assert out.dtype == dt and out.shape == (T, block.D)
        err = worst_error(out, experts_reference(block, x, ids, wts, w))
        assert err <= 1.0, f"{schedule.describe()} on ids {ids.tolist()}: worst error {err:.3g} of the bound"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_kernels_match_the_float32_reference(interpreted, kind, dtype):
    """Odd T = 7 over E = 14 experts, k = 2: every routing case of CASES."""
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    block = block_of(E=14, dtype=dtype)
    check(block, SMALL[kind], [routing(c, block.E, block.k, gen) for c in CASES])


@pytest.mark.parametrize("kind", ["stream_gemv", "grouped_gemm"])  # the hybrid runs these two on its halves
def test_top_1(interpreted, kind):
    gen = torch.Generator().manual_seed(1)
    block = block_of(k=1)
    check(block, SMALL[kind], [routing(c, block.E, 1, gen, T=8 if c == "one_row_per_expert" else 5)
                               for c in ("uniform", "one_row_per_expert", "sentinels")])


LAYOUTS = {  # together: standard and transposed, halves and interleaved, biases, both activations and applications
    "transposed+bias/input": dict(layout=WeightLayout(transposed=True, has_bias=True), apply="input"),
    "interleaved": dict(layout=WeightLayout(interleaved=True)),
    "clamped/input": dict(act=Activation("clamped_swiglu", alpha=1.702, limit=7.0), apply="input"),
    "gpt-oss": dict(layout=WeightLayout(transposed=True, interleaved=True, has_bias=True),
                    act=Activation("clamped_swiglu", alpha=1.702, limit=7.0)),
}


@pytest.mark.parametrize("variant", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["stream_gemv", "grouped_gemm"])
def test_every_layout_activation_and_weight_application(interpreted, kind, variant):
    dtype = "bfloat16" if variant == "gpt-oss" else "float32"
    block = block_of(dtype=dtype, **LAYOUTS[variant])
    gen = torch.Generator().manual_seed(3)
    check(block, SMALL[kind], [routing(c, block.E, block.k, gen) for c in ("sentinels", "one_hot_expert")])


@pytest.mark.parametrize("pairs", [1, 2])
def test_the_hybrid_on_the_gpt_oss_layout(interpreted, pairs):
    """Its GEMV half's down with one pair a group and with both pairs of a token in one."""
    block = block_of(dtype="bfloat16", **LAYOUTS["gpt-oss"])
    gen = torch.Generator().manual_seed(4)
    s = dataclasses.replace(SMALL["hybrid"], params=dataclasses.replace(SMALL["hybrid"].params, gemv_pairs=pairs))
    check(block, s, [routing(c, block.E, block.k, gen) for c in ("sentinels", "one_hot_expert")])


DOWN_GROUPS = {  # k = 3 pairs a token, loaded G at a time by the GEMV's down
    "G=1/bias": (1, dict(layout=WeightLayout(has_bias=True)), None),
    "G=2/transposed+bias": (2, dict(layout=WeightLayout(transposed=True, has_bias=True)), None),  # 2 groups, 1 idle
    "G=4/bias/input": (4, dict(layout=WeightLayout(has_bias=True), apply="input"), None),  # 1 group, 1 idle lane
    "G=2/fp8": (2, dict(D=128, F=64, dtype="bfloat16"), WeightFormat.fp8_block((32, 64))),
}


@pytest.mark.parametrize("variant", list(DOWN_GROUPS))
def test_the_gemv_down_in_groups_of_pairs(interpreted, variant):
    """The down's groups of pairs (down_pairs): one lane per pair, groups that leave lanes past k idle, over
    sentinels and a hot expert, with biases, both layouts, both weight applications and FP8 words."""
    G, kw, fmt = DOWN_GROUPS[variant]
    block = block_of(E=10, k=3, **kw)
    if fmt is not None:
        block = block.with_weight_format(fmt)
    s = Schedule("stream_gemv", backend="pallas_gpu",
                 params=GemvParams(block_n=8, block_k=32, down_block_n=16, down_block_k=16, down_pairs=G))
    gen = torch.Generator().manual_seed(8)
    check(block, s, [routing(c, block.E, block.k, gen) for c in ("sentinels", "one_hot_expert")])


@pytest.mark.parametrize("kind", KINDS)
def test_each_kinds_default_matches_the_reference(interpreted, kind):
    block = block_of(E=16, k=4, D=128, F=64, dtype="bfloat16")
    gen = torch.Generator().manual_seed(5)
    check(block, BE.default(block, kind, 7), [routing(c, block.E, block.k, gen) for c in ("sentinels", "uniform")])


@pytest.mark.parametrize("blocks", [(128, 128), (32, 64)])
@pytest.mark.parametrize("kind", ["stream_gemv", "grouped_gemm"])
def test_the_fp8_kernels_match_the_reference(interpreted, kind, blocks):
    """e4m3 weights with float32 scales per block, bf16 activations: against the reference on the dequantised
    weights, with the tiles' default (one scale block per tile, several K steps over two or more scale block
    columns) over every routing case."""
    block = block_of(E=14, D=256, F=256, dtype="bfloat16").with_weight_format(WeightFormat.fp8_block(blocks))
    gen = torch.Generator().manual_seed(6)
    s = BE.default(block, kind, 7)
    ks = (s.params.block_k, s.params.down_block_k) if kind == "stream_gemv" else (s.params.block_k,)
    assert all(bk <= blocks[1] for bk in ks) and max(ks) < block.D
    check(block, s, [routing(c, block.E, block.k, gen) for c in CASES])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_fp8_grouped_gemm_in_f32_and_f16_with_input_weights(interpreted, dtype):
    """The w8a16 GEMM with f32 (HIGHEST-precision dots) and f16 activations, the routing weight on the input,
    16-row tiles over a hot expert of 20 rows (two tiles), top-1 over one row per expert."""
    fmt = WeightFormat.fp8_block((32, 64))
    block = block_of(E=8, D=128, F=64, dtype=dtype, apply="input").with_weight_format(fmt)
    s = Schedule("grouped_gemm", backend="pallas_gpu", params=GemmParams(block_m=16, block_n=16, block_k=64))
    gen = torch.Generator().manual_seed(7)
    check(block, s, [routing(c, block.E, block.k, gen, T=20) for c in ("one_hot_expert", "sentinels")])
    top1 = block_of(E=8, k=1, D=128, F=64, dtype=dtype).with_weight_format(fmt)
    check(top1, s, [routing(c, 8, 1, gen, T=8) for c in ("one_row_per_expert", "zero_row_experts")])


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3.5-397b-a17b"])
def test_the_fp8_gemv_default_is_the_bf16_one_cut_to_its_scale_blocks(name):
    """Every field of the bf16 default carries over (the down's groups of pairs among them); only the tiles
    are cut to one 128×128 scale block."""
    bf16, fp8 = preset(name), preset(f"{name}-fp8")
    for T in (1, 8, 64):
        a, b = BE.default(bf16, "stream_gemv", T).params, BE.default(fp8, "stream_gemv", T).params
        assert b == dataclasses.replace(a, block_n=min(a.block_n, 128), block_k=min(a.block_k, 128),
                                        down_block_n=min(a.down_block_n, 128), down_block_k=min(a.down_block_k, 128))
        assert b.down_pairs == (8 if bf16.k == 8 else 2)


def test_fp8_refusals():
    fp8 = WeightFormat.fp8_block()
    assert "F = 192 is not" in BE.kinds(block_of(D=256, F=192, dtype="bfloat16").with_weight_format(fp8))[
        "stream_gemv"]
    assert BE.kinds(preset("qwen3.5-397b-a17b-fp8"))["stream_gemv"] is None  # 2^32 bytes: read as 2^30 words
    q = block_of(D=256, F=256, dtype="bfloat16").with_weight_format(fp8)
    assert "unquantised" in BE.kinds(q)["hybrid"] and BE.kinds(q)["grouped_gemm"] is None
    with pytest.raises(UnsupportedSchedule, match="block_k = 256 does not divide 128"):
        BE.build(q, Schedule("stream_gemv", backend="pallas_gpu", params=GemvParams(block_k=256)))
    with pytest.raises(UnsupportedSchedule, match="block_k = 32 below 64"):
        BE.build(q, Schedule("grouped_gemm", backend="pallas_gpu", params=GemmParams(block_k=32)))
    with pytest.raises(UnsupportedSchedule, match="block_n = 64 does not divide 32"):
        BE.build(q.with_weight_format(WeightFormat.fp8_block((32, 64))),
                 Schedule("grouped_gemm", backend="pallas_gpu", params=GemmParams(block_n=64)))
    narrow = q.with_weight_format(WeightFormat.fp8_block((32, 32)))
    assert "blocks 32 wide" in BE.kinds(narrow)["grouped_gemm"] and BE.kinds(narrow)["stream_gemv"] is None


def test_the_hybrid_splits_by_rows_per_expert():
    import jax.numpy as jnp

    from moetune.codegen.pallas_gpu.hybrid import split

    ids = jnp.array([[0, 1], [0, 2], [0, 1], [7, -1], [8, 2]], jnp.int32)  # rows: e0 3, e1 2, e2 2, e7 1
    heavy, light = split(ids, 8, 3)
    assert heavy.tolist() == [[0, -1], [0, -1], [0, -1], [-1, -1], [-1, -1]]
    assert light.tolist() == [[-1, 1], [-1, 2], [-1, 1], [7, -1], [-1, 2]]


def test_availability_and_refusals(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    import jax

    if not any(d.platform == "gpu" for d in jax.devices()):
        assert INTERPRET_ENV in BE.available()
    monkeypatch.setenv(INTERPRET_ENV, "1")
    assert BE.available() is None
    odd = block_of(D=72, F=40)
    assert all("not a multiple" in why and "D = 72" in why for why in BE.kinds(odd).values())
    for kind in KINDS:
        with pytest.raises(UnsupportedSchedule, match="D = 72"):
            BE.build(odd, dataclasses.replace(SMALL[kind], params=BE.default(block_of(), kind, 1).params))
    block = block_of()
    with pytest.raises(UnsupportedSchedule, match="block_k = 128 does not divide 64"):
        BE.build(block, Schedule("stream_gemv", backend="pallas_gpu", params=GemvParams(block_k=128)))
    with pytest.raises(UnsupportedSchedule, match="block_n = 64 does not divide 32"):
        BE.build(block, Schedule("grouped_gemm", backend="pallas_gpu", params=GemmParams(block_n=64)))
    with pytest.raises(UnsupportedSchedule, match="down_pairs = 4: more than the k = 2 pairs"):
        BE.build(block, Schedule("stream_gemv", backend="pallas_gpu", params=GemvParams(down_block_k=16, down_pairs=4)))
    with pytest.raises(UnsupportedSchedule, match="down tile 8×16×128 over 4 warps: 128 elements per thread"):
        GemvParams(down_block_n=16, down_block_k=128, down_pairs=8)
    with pytest.raises(UnsupportedSchedule, match="not a power of two"):
        GemvParams(block_n=12)
    with pytest.raises(UnsupportedSchedule, match="below the dot's 16"):
        GemmParams(block_m=8)
    with pytest.raises(UnsupportedSchedule, match="elements per thread"):
        GemvParams(block_n=64, block_k=512, num_warps=2)
    with pytest.raises(UnsupportedSchedule, match="shared memory"):
        BE.space(preset("qwen3-30b-a3b"), "grouped_gemm").make(block_m=128, block_n=256, block_k=128,
                                                                num_stages=4)


# ------------------------------------------------------------------------------------------------ lowering

PRESET_NAMES = ("qwen3-30b-a3b", "qwen3.5-397b-a17b", "qwen3-30b-a3b-fp8", "qwen3.5-397b-a17b-fp8")
LOWER_TOKENS = (1, 16, 256, 4096)  # both regimes of the defaults, decode to prefill
LAUNCH = r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32'  # a launch: name, stages, warps


def lowered(block: MoEBlock, schedule: Schedule, T: int) -> str:
    """The StableHLO text of the kind's jitted function at T tokens, lowered for "cuda" (abstract inputs)."""
    import jax
    import jax.numpy as jnp

    from moetune.codegen.pallas_tpu._common import JaxExperts

    lay, fmt = block.layout, block.weight_format
    dt = jnp.dtype(fmt.compute_dtype)
    wdt = jnp.dtype(fmt.dtype)

    def sd(*shape, dtype=dt):
        return jax.ShapeDtypeStruct(shape, dtype)

    E, D, F = block.E, block.D, block.F
    bias = (sd(E, 2 * F), sd(E, D)) if lay.has_bias else (None, None)
    scales = ()
    if fmt.quantized:
        (r, c), f32 = fmt.block, jnp.float32
        scales = (sd(E, 2 * (F // r), D // c, dtype=f32), sd(E, D // r, F // c, dtype=f32))
    w = JaxExperts(sd(*lay.gate_up_shape(E, D, F), dtype=wdt), sd(*lay.down_shape(E, D, F), dtype=wdt), *bias,
                   *scales)
    fn = BE.kind(schedule.kind, block).build_jax(block, schedule)
    args = (sd(T, D), sd(T, block.k, dtype=jnp.int32), sd(T, block.k), w)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name,kind", [(n, k) for n in PRESET_NAMES for k, why in BE.kinds(preset(n)).items()
                                       if why is None])  # fp8_block presets: the GEMV alone reads them
def test_every_default_lowers_through_triton_at_the_presets_shapes(monkeypatch, name, kind):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    block = preset(name)
    for T in LOWER_TOKENS:
        text = lowered(block, BE.default(block, kind, T), T)
        assert sorted(launches(text)) == expected_launches(kind, block, T), (kind, T)


def launches(text: str) -> list[str]:
    """The names of the Triton kernels of a lowered program, one per launch."""
    assert text.count("xla.gpu.triton") == len(re.findall(LAUNCH, text))
    return [m.group(1) for m in re.finditer(LAUNCH, text)]



def expected_launches(kind: str, block: MoEBlock, T: int) -> list[str]:
    """The kernels of `kind`: the GEMV's two; the GEMM's two after its tile plan (routing.py: one launch where
    one program places the pairs, else two); the hybrid's four and the plan."""
    gemm, gemv = ["moetune_gemm_gate_up", "moetune_gemm_down"], ["moetune_gemv_gate_up", "moetune_gemv_down"]
    one = tile_plan.layout(T * block.k, block.E, 16).G == 1
    plan = ["moetune_route_plan"] + ([] if one else ["moetune_route_counts"])
    return sorted({"stream_gemv": gemv, "grouped_gemm": gemm + plan, "hybrid": gemm + gemv + plan}[kind])


def test_gpt_oss_layouts_lower_through_triton(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    block = block_of(E=32, k=4, D=512, F=256, dtype="bfloat16", **LAYOUTS["gpt-oss"])
    for kind in KINDS:
        assert lowered(block, BE.default(block, kind, 64), 64).count("xla.gpu.triton") >= 2


def test_the_lowered_kernels_compile_for_sm90(monkeypatch, tmp_path):
    """Each of the kernels, at the qwen3.5-397b-a17b default of its regime (the GEMM's tile plan in two
    launches there), the GEMV on qwen3-30b-a3b's and the GEMM on qwen3.5-397b-a17b's fp8_block weights, as
    Triton IR compiled to sm_90 by the Triton installed here with the launch's num_warps and num_stages (XLA
    compiles the same IR with its own Triton on the GPU)."""
    pytest.importorskip("triton")
    modules = captured_triton(monkeypatch)
    compiled_names = []
    for name, kind, T in (("qwen3.5-397b-a17b", "stream_gemv", 1), ("qwen3.5-397b-a17b", "grouped_gemm", 256),
                          ("qwen3-30b-a3b-fp8", "stream_gemv", 1), ("qwen3.5-397b-a17b-fp8", "grouped_gemm", 256)):
        block = preset(name)
        modules.clear()
        launch = {}
        text = lowered(block, BE.default(block, kind, T), T)
        for m in re.finditer(LAUNCH, text):
            launch[m.group(1)] = (int(m.group(2)), int(m.group(3)))
        assert sorted(modules) == sorted(launch) == expected_launches(kind, block, T), (name, kind, sorted(launch))
        if block.weight_format.quantized:
            assert all("f8E4M3FN" in asm for n, asm in modules.items() if "route" not in n), (name, kind)
        compiled_names += sorted(modules)
        compile_sm90(modules, launch, tmp_path)
    assert sorted(set(compiled_names)) == ["moetune_gemm_down", "moetune_gemm_gate_up", "moetune_gemv_down",
                                           "moetune_gemv_gate_up", "moetune_route_counts", "moetune_route_plan"]


def captured_triton(monkeypatch) -> dict[str, str]:
    """{kernel name: Triton IR} of every pallas_call lowered from now on (without the interpreter)."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    modules: dict[str, str] = {}
    real = reg.lowering.lower_jaxpr_to_triton_module

    def keep(*a, **kw):
        out = real(*a, **kw)
        asm = out.module.operation.get_asm()
        modules[re.search(r"module @(\w+)", asm).group(1)] = asm
        return out

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", keep)
    return modules


def test_the_fp8_gemv_lowers_at_qwen35_397bs_4_gib_gate_up(monkeypatch, tmp_path):
    """qwen3.5-397b-a17b-fp8 (E = 512, D = 4096, F = 1024): gate_up is 2^32 e4m3 bytes, past the 2^31 elements
    that Pallas' 32-bit offsets reach. Both kernels take the weights as 2^30 and 2^29 uint32 words (i32
    pointers, no e4m3 pointer), widen the e4m3 bytes in registers, and compile for sm_90 (where Triton is
    installed), at decode and at prefill."""
    block = preset("qwen3.5-397b-a17b-fp8")
    assert 2 * block.E * block.F * block.D == 2**32 and BE.kinds(block)["stream_gemv"] is None
    modules = captured_triton(monkeypatch)
    for T in (1, 4096):
        modules.clear()
        text = lowered(block, BE.default(block, "stream_gemv", T), T)
        assert text.count("xla.gpu.triton") == 2
        assert sorted(modules) == ["moetune_gemv_down", "moetune_gemv_gate_up"]
        for name, asm in modules.items():
            head = next(line for line in asm.splitlines() if "tt.func" in line)  # (ids, weights, x | h, w, scale, out)
            args = re.findall(r"%arg\d+: !tt\.ptr<(\w+)>", head)
            assert len(args) == 6 and args[3] == "i32" and "f8E4M3FN" not in args, (name, head)
            assert re.search(r"tt\.fp_to_fp %\w+ : tensor<\w+xf8E4M3FN> -> tensor<\w+xf32>", asm), name  # widened e4m3
    if importlib.util.find_spec("triton") is None:
        return
    launch = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in re.finditer(LAUNCH, text)}
    compile_sm90(modules, launch, tmp_path)


def compile_sm90(modules: dict[str, str], launch: dict[str, tuple[int, int]], tmp_path) -> None:
    """Each Triton module compiled to an sm_90 cubin with its launch's (num_stages, num_warps), within the
    H200's shared memory per block."""
    import triton
    from triton.backends.compiler import GPUTarget

    for name, asm in modules.items():
        path = tmp_path / f"{name}.ttir"
        path.write_text(asm)
        stages, warps = launch[name]
        compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        assert compiled.asm["cubin"], name
        assert compiled.metadata.shared <= 227 * 1024, (name, compiled.metadata.shared)


def test_schedules_of_another_backend_are_refused():
    from moetune.codegen.triton import GemvParams as TritonGemv

    with pytest.raises(UnsupportedSchedule, match="takes GemvParams"):
        BE.build(block_of(), Schedule("stream_gemv", backend="pallas_gpu", params=TritonGemv()))
