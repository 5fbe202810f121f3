"""Every kind of every backend implements the whole per-kind contract (moetune.codegen.contract), and each
backend's defaults are points of its own spaces, so every tuning study tries them first."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

from moetune.codegen import backend as registry
from moetune.codegen.backend import Backend, get
from moetune.codegen.contract import KernelBackend, KernelKind
from moetune.ir import SCHEDULE_KINDS, MoEBlock, Schedule
from moetune.ir.presets import PRESETS, preset
from moetune.passes.policy import hybrid_threshold, rows_per_active

CODEGEN = Path(registry.__file__).resolve().parent
NEEDS = {"triton": "triton", "pallas_tpu": "jax", "pallas_gpu": "jax"}  # the library a backend's package imports
BACKENDS = [n for n in registry._MODULES if importlib.util.find_spec(NEEDS.get(n, "torch"))]
FOLDERS = {n: m.rsplit(".", 1)[1] for n, m in registry._MODULES.items()}
TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 4096)
BLOCKS = [preset(name) for name in PRESETS] + [
    MoEBlock(E=E, k=k, D=512, F=256) for E, k in ((8, 1), (8, 2), (16, 4), (64, 6), (256, 9), (512, 16))]


def test_nothing_names_a_backend_that_does_not_exist():
    assert sorted(registry._MODULES) == ["pallas_gpu", "pallas_tpu", "torch", "triton"]
    assert sorted(p.name for p in CODEGEN.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        FOLDERS.values())


@pytest.mark.parametrize("name", BACKENDS)
def test_every_kind_implements_the_contract(name):
    be = get(name)
    assert isinstance(be, KernelBackend) and be.name == name
    protocol = {n for n, v in vars(Backend).items() if inspect.isfunction(v)}
    assert protocol >= {"available", "kinds", "space", "default", "build", "cost", "sources"}
    assert all(callable(getattr(be, n)) for n in protocol)
    kinds = {k.kind for k in be.KINDS}  # the three base kinds everywhere; fused_gemv where a backend has it
    assert kinds <= set(SCHEDULE_KINDS) and kinds >= {"grouped_gemm", "stream_gemv", "hybrid"}, kinds
    folder = CODEGEN / FOLDERS[name]
    for k in be.KINDS:
        assert isinstance(k, KernelKind)
        assert dataclasses.is_dataclass(k.params) and k.params.__dataclass_params__.frozen, k.kind
        for f in (k.space, k.default_params, k.build, k.cost, k.refusal):
            assert callable(f), (k.kind, f)
        if k.kind == "hybrid":  # the policy's threshold, not the kernel's
            b = BLOCKS[0]
            assert be.default(b, "hybrid", 3).row_threshold == hybrid_threshold(rows_per_active(b, 3))
        module = importlib.import_module(k.build.__module__)
        file = Path(module.__file__).name  # one file per kind and weight format: <kind>.py, <kind>_<format>.py
        assert module.KIND is k and (file == f"{k.kind}.py" if "none" in k.formats
                                     else file.startswith(f"{k.kind}_")), (k.kind, file)
        assert module.SOURCES and module.SOURCES[0] == file
        assert k.sources == tuple(folder / n for n in module.SOURCES)
        srcs = be.sources(k.kind, k.formats[0])
        assert srcs and all(p.is_file() for p in srcs), srcs
        assert {p.parent for p in srcs} <= {folder, CODEGEN}


def _sibling_imports(path: Path) -> set[str]:
    """The files of `path`'s folder that it imports (`from . import x`, `from .x import ...`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            out |= {f"{n.split('.')[0]}.py" for n in names if (path.parent / f"{n.split('.')[0]}.py").is_file()}
    return out


@pytest.mark.parametrize("name", BACKENDS)
def test_declared_sources_cover_what_the_kernels_import(name):
    """Every file of the backend's folder that one of a kind's SOURCES imports is itself declared."""
    for k in get(name).KINDS:
        declared = {p.name for p in k.sources}
        for p in k.sources:
            missing = _sibling_imports(p) - declared
            assert not missing, f"{name} {k.kind}: {p.name} imports {sorted(missing)}, not in SOURCES"


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"E{b.E}k{b.k}D{b.D}F{b.F}")
def test_every_default_is_a_point_of_its_space(name, block):
    be = get(name)
    for kind, why in be.kinds(block).items():
        if why:
            continue
        space = be.space(block, kind)
        for T in TOKENS:
            s = be.default(block, kind, T)
            assert isinstance(s, Schedule) and s.kind == kind and s.backend == name
            assert isinstance(s.params, space.params_type)
            for field, values in space.choices:
                v = getattr(s.params, field)
                assert v in values, f"{kind} default at T={T}: {field} = {v!r} outside {values}"
            space.admit(s.params)  # within the target's limits
            flops, moved = be.cost(block, s, T)
            assert flops > 0 and moved > 0


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3.5-397b-a17b"])
def test_each_bucket_study_starts_from_every_kinds_default(name):
    """In every bucket the passes make, the first schedules a study enqueues include the Triton backend's
    default of each kind the bucket offers."""
    pytest.importorskip("triton")
    from moetune.passes.pipeline import schedule_block
    from moetune.search.seeds import default_schedules
    from moetune.search.space import build_space

    be = get("triton")
    block = preset(name)
    for b in schedule_block(block, "h200", tokens=(1, 1024)).buckets:
        space = build_space(block, be, b)
        first = default_schedules(block, be, space, (b.lo + b.hi) // 2)
        assert sorted({s.kind for s in first}) == sorted(ks.kind for ks in space.kinds), b.label  # (and launch twins)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_weight_format_no_kernel_reads_is_refused_with_the_reason(name):
    """The weight-format seam: a quantised block is refused by every kind that does not declare its scheme,
    at `kinds` (so the defaults and the search pass it over) and at `build`."""
    from moetune.ir import UnsupportedSchedule, WeightFormat

    be = get(name)
    fmt = WeightFormat("float8_e4m3fn", "fp8_block", (128, 128), "float32")
    q = MoEBlock(E=8, k=2, D=256, F=128, weight_dtype="float8_e4m3fn", weight_format=fmt)
    plain = MoEBlock(E=8, k=2, D=256, F=128)
    for kind, why in be.kinds(q).items():
        if "fp8_block" in be.schemes(kind):
            assert why is None, (kind, why)
            continue
        assert why and "fp8_block" in why, (kind, why)
        with pytest.raises(UnsupportedSchedule, match="fp8_block"):
            be.build(q, be.default(plain, kind, 1))
    assert all(why is None for why in be.kinds(plain).values())


def test_kernel_files_of_one_kind_split_by_weight_format():
    """Two kernel files of one kind: the block's weight format picks the file that builds, spaces and defaults
    it; two files reading the same format are refused when the backend is made."""
    import dataclasses

    from moetune.codegen.contract import KernelBackend
    from moetune.codegen.torch import stream_gemv as tsg
    from moetune.ir import UnsupportedSchedule, WeightFormat

    plain_kind = dataclasses.replace(tsg.KIND, formats=("none",))
    fp8 = dataclasses.replace(tsg.KIND, formats=("fp8_block",), space=lambda b, t: "fp8 space")

    class Split(KernelBackend):
        name, KINDS = "split", (plain_kind, fp8)

    be = Split()
    plain = MoEBlock(E=8, k=2, D=256, F=128)
    q = plain.with_weight_format(WeightFormat.fp8_block())
    assert be.kind("stream_gemv", q) is fp8 and be.kind("stream_gemv", plain) is plain_kind
    assert be.space(q, "stream_gemv") == "fp8 space" and be.space(plain, "stream_gemv") != "fp8 space"
    assert be.schemes("stream_gemv") == ("none", "fp8_block")
    assert be.kinds(q) == {"stream_gemv": None}
    assert be.sources("stream_gemv", "fp8_block")[-1].name == "quant.py"
    with pytest.raises(UnsupportedSchedule, match="no stream_gemv kernel reads ue8m0"):
        be.sources("stream_gemv", "ue8m0")

    class Clash(KernelBackend):
        name, KINDS = "clash", (plain_kind, dataclasses.replace(tsg.KIND, formats=("none", "fp8_block")))

    with pytest.raises(UnsupportedSchedule, match="two stream_gemv kernels read none"):
        Clash()
