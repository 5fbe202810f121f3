"""The property matrix's pieces: its cells (backend × kind × weight format, read off the backends), the
hypothesis strategy of a hostile problem, and the one check against the float32 reference.

A cell is (route, kind, format). Routes are the codegen backends (torch, triton, pallas_tpu, pallas_gpu) and
the JAX front end's routes (`jax/<backend>`: moetune.jax.experts with that backend, its kind the route's
choice at T). Formats are the weight formats with their activation rule:

    bf16, fp16, f32            unquantised weights in that dtype
    fp8/w8a16/<scales>         fp8_block weights, activations in the compute dtype (act_quant "none")
    fp8/w8a8/<scales>          fp8_block weights, activations quantised per 1 × the block's columns
    <scales>                   f32 (float32 block scales) or ue8m0 (powers of two in one byte)

A cell is offered when its kind has a kernel file for the format's scheme, its parameters carry `act_quant`
where the format quantises activations, and the kind runs a block of the format at the route's shapes; the
others must be refused by the package with the reason (test_property_matrix.test_unoffered_cells_are_refused).

A problem draws E, k, D, F, T within the route's shape rule, a routing (ROUTINGS: the hostile ones), a layout,
inputs that may be non-contiguous views and may hold a NaN or an infinity (in x, or in an expert's weights or
scales), and, for the kernel backends, parameters from the kind's space (its default where the sample is
refused) and a hybrid's row threshold.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from triton_cases import ON_GPU

from moetune.codegen.backend import get
from moetune.codegen.quant import activation_group
from moetune.codegen.tensors import ExpertTensors
from moetune.codegen.torch.reference import experts_reference
from moetune.codegen.torch.tolerance import worst_error
from moetune.ir import Activation, MoEBlock, Schedule, UnsupportedSchedule, WeightFormat, WeightLayout
from moetune.search.objective import expert_tensors

BACKENDS = ("torch", "triton", "pallas_tpu", "pallas_gpu")
JAX_ROUTES = ("reference", "torch", "triton", "pallas_tpu", "pallas_gpu")
FORMATS = ("bf16", "fp16", "f32", "fp8/w8a16/f32", "fp8/w8a16/ue8m0", "fp8/w8a8/f32", "fp8/w8a8/ue8m0")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "f32": "float32"}
ROUTINGS = ("uniform", "skewed", "one_expert", "all_once", "k_is_E", "duplicates", "last_expert", "sentinels",
            "empty")
NON_FINITE = ("nan_x", "inf_x", "nan_weight", "inf_weight")
VIEWS = ("contiguous", "strided_rows", "column_major", "offset_columns")
CLAMPED = Activation("clamped_swiglu", alpha=1.702, limit=7.0)
LAYOUTS = {  # name → (layout, activation); a layout the cell's kind refuses falls back to "standard"
    "standard": (WeightLayout(), Activation()),
    "transposed+bias": (WeightLayout(transposed=True, has_bias=True), Activation()),
    "gpt-oss": (WeightLayout(transposed=True, interleaved=True, has_bias=True), CLAMPED),
}
E4M3_NAN = 0x7F  # float8_e4m3fn has no infinity; this byte is its NaN
UE8M0_NAN = 0xFF


@dataclass(frozen=True)
class Shapes:
    """What a route's kernels take and what its interpreter affords: E in [1, E_max], k ≤ k_max, D and F from
    `dims` (unquantised) or `fp8_dims` with scale blocks from `blocks`, T in [1, T_max]."""

    E_max: int
    k_max: int
    T_max: int
    dims: tuple[int, ...]
    fp8_dims: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...]


ANY = tuple(range(8, 97, 4))
SHAPES = {
    "torch": Shapes(12, 4, 24, ANY, ANY, ((16, 16), (32, 32), (16, 32))),
    "triton": Shapes(8, 3, 8, ANY, (32, 64, 96), ((32, 32),)),
    "pallas_tpu": Shapes(6, 3, 8, (128, 256), (128, 256), ((128, 128),)),
    "pallas_gpu": Shapes(6, 3, 8, (16, 32, 48, 64), (64, 128), ((64, 64),)),
    "jax/reference": Shapes(8, 3, 12, ANY, (32, 64, 96), ((16, 16), (32, 32))),
    "jax/torch": Shapes(8, 3, 12, ANY, (32, 64, 96), ((16, 16), (32, 32))),
    "jax/triton": Shapes(6, 3, 6, (32, 64), (32, 64), ((32, 32),)),
    "jax/pallas_tpu": Shapes(4, 2, 4, (128,), (128,), ((128, 128),)),
    "jax/pallas_gpu": Shapes(4, 2, 4, (32,), (64,), ((64, 64),)),
}

# examples per cell on CPU (interpreted kernels get fewer); on a GPU (MOETUNE_TEST_GPU=1) the compiled Triton cells
# take GPU_TRITON each; MOETUNE_PROPERTY_EXAMPLES multiplies every count
EXAMPLES = {"torch": 120, "triton": 5, "pallas_tpu": 2, "pallas_gpu": 3, "jax/reference": 20, "jax/torch": 20,
            "jax/triton": 2, "jax/pallas_tpu": 1, "jax/pallas_gpu": 1}
GPU_TRITON = 500
SCALE_ENV = "MOETUNE_PROPERTY_EXAMPLES"


def examples(route: str) -> int:
    base = GPU_TRITON if ON_GPU and route == "triton" else EXAMPLES[route]
    return max(1, math.ceil(base * float(os.environ.get(SCALE_ENV, "1"))))


def cell_seed(cell_id: str) -> int:
    """Each cell its own deterministic stream of examples."""
    return zlib.crc32(cell_id.encode())


# ---- cells ---------------------------------------------------------------------------------------------------


def make_block(fmt: str, E: int, k: int, D: int, F: int, block=(32, 32), layout: str = "standard",
               apply: str = "output", compute: str = "bfloat16") -> MoEBlock:
    lay, act = LAYOUTS[layout]
    if fmt in DTYPES:
        dt = DTYPES[fmt]
        return MoEBlock(E=E, k=k, D=D, F=F, weight_dtype=dt, routing_weight_dtype=dt, layout=lay, activation=act,
                        weight_application=apply, name="property")
    scales = "float32" if fmt.endswith("f32") else "ue8m0"
    return MoEBlock(E=E, k=k, D=D, F=F, routing_weight_dtype=compute, layout=lay, activation=act,
                    weight_application=apply, name="property").with_weight_format(
        WeightFormat.fp8_block(block, scales, compute))


def a8(fmt: str) -> bool:
    return "/w8a8/" in fmt


def has_act_quant(params_type: type) -> bool:
    return any(f.name == "act_quant" for f in dataclasses.fields(params_type))


def representative(route: str, fmt: str) -> MoEBlock:
    s = SHAPES[route]
    dims = s.fp8_dims if fmt not in DTYPES else s.dims
    return make_block(fmt, min(4, s.E_max), min(2, s.k_max), dims[0], dims[-1], s.blocks[0])


def offer(backend: str, kind: str, fmt: str) -> str | None:
    """None when the backend's `kind` runs `fmt` (module doc), else why not, in the package's words where
    it has them."""
    be = get(backend)
    block = representative(backend, fmt)
    scheme = block.weight_format.scheme
    if scheme not in be.schemes(kind):
        return be.kinds(block)[kind]
    why = be.kinds(block)[kind]
    if why is None and a8(fmt) and not has_act_quant(be.kind(kind, block).params):
        return f"{backend} {kind} on fp8_block weights has no act_quant: its activations are not quantised"
    return why


def kernel_cells() -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str, str]]]:
    """(offered cells, unoffered cells with the reason) of every backend available here."""
    offered, refused = [], []
    for name in BACKENDS:
        try:
            be = get(name)
        except ImportError:
            continue
        if be.available():
            continue
        for kind in be.kinds(representative(name, "f32")):
            for fmt in FORMATS:
                why = offer(name, kind, fmt)
                (offered.append((name, kind, fmt)) if why is None else refused.append((name, kind, fmt, why)))
    return offered, refused


def jax_cells() -> list[tuple[str, str]]:
    """(jax/<backend>, format) of every JAX route that runs here; the formats its kernels take (jax/pallas_*:
    the ones the Pallas backends' kinds run, jax/triton and jax/torch: every format, w8a8 where the route's
    schedule quantises activations, which the check reads off the route)."""
    try:
        import moetune.jax as mj
    except ImportError:
        return []
    cells = []
    for name in JAX_ROUTES:
        if name != "reference":
            try:
                mj.jax_backend(name)
            except Exception:  # noqa: BLE001 - not usable here: the route is not in the matrix
                continue
        for fmt in FORMATS:
            if a8(fmt):
                continue  # which activation rule runs is the route's schedule's (the check reads it)
            if name.startswith("pallas") and all(offer(name, k, fmt) for k in get(name).kinds(
                    representative(name, fmt))):
                continue
            cells.append((f"jax/{name}", fmt))
    return cells


# ---- problems --------------------------------------------------------------------------------------------------


@dataclass
class Problem:
    block: MoEBlock
    x: torch.Tensor  # [T, D]
    ids: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    w: ExpertTensors
    routing: str
    view: str
    non_finite: str | None

    def describe(self) -> str:
        b = self.block
        return (f"E={b.E} k={b.k} D={b.D} F={b.F} T={self.x.shape[0]} {b.weight_format} layout={b.layout} "
                f"{b.activation} apply={b.weight_application} routing={self.routing} view={self.view} "
                f"non_finite={self.non_finite} ids={self.ids.tolist()}")


def route_ids(routing: str, T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    """ids [T, k] int64 of a ROUTINGS pattern (k and T already fitted to it by `problems`)."""
    def distinct(n_tok, pool=E):
        return torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(n_tok)]) if n_tok else \
            torch.zeros(0, k, dtype=torch.long)

    if routing in ("uniform", "k_is_E"):
        return distinct(T)
    if routing == "skewed":  # experts of random popularity: a few take many rows, many none
        pop = torch.rand(E, generator=g) ** 4 + 1e-3
        return torch.stack([torch.multinomial(pop, k, replacement=False, generator=g) for _ in range(T)])
    if routing in ("one_expert", "last_expert"):  # one expert in every token, at a random slot
        hot = E - 1 if routing == "last_expert" else int(torch.randint(E, (1,), generator=g))
        rest = distinct(T, E - 1) if k > 1 else torch.zeros(T, 0, dtype=torch.long)
        rest = rest[:, : k - 1] + (rest[:, : k - 1] >= hot).long()
        slot = int(torch.randint(k, (1,), generator=g))
        return torch.cat([rest[:, :slot], torch.full((T, 1), hot), rest[:, slot:]], dim=1)
    if routing == "all_once":  # every expert exactly one row; the slots left over are sentinels
        flat = torch.cat([torch.randperm(E, generator=g), torch.full((T * k - E,), -1)])
        return flat.view(T, k)
    if routing == "duplicates":  # an id repeated within a token's top-k: both slots count, as in the reference
        ids = distinct(T)
        for t in range(T):
            if t == 0 or torch.rand(1, generator=g) < 0.5:
                j = int(torch.randint(1, k, (1,), generator=g))
                ids[t, j] = ids[t, 0]
        ids[-1, :] = ids[-1, 0]  # one token all k slots the same expert
        return ids
    if routing == "sentinels":  # expert-parallel ids outside [0, E): contribute nothing
        ids = distinct(T)
        bad = torch.tensor([-1, E, E + 7, -(2**20)])
        mask = torch.rand(T, k, generator=g) < 0.4
        ids[mask] = bad[torch.randint(4, (int(mask.sum()),), generator=g)]
        ids[0, :] = -1  # one token routed nowhere
        return ids
    if routing == "empty":
        return torch.zeros(0, k, dtype=torch.long)
    raise KeyError(routing)


def as_view(t: torch.Tensor, view: str) -> torch.Tensor:
    """`t` [T, n] as a non-contiguous view with equal values."""
    if view == "contiguous":
        return t
    T, n = t.shape
    if view == "strided_rows":
        buf = torch.zeros(2 * T, n, dtype=t.dtype, device=t.device)
        buf[::2] = t
        return buf[::2]
    if view == "column_major":
        return t.t().contiguous().t()
    if view == "offset_columns":
        buf = torch.zeros(T, n + 3, dtype=t.dtype, device=t.device)
        buf[:, 1 : n + 1] = t
        return buf[:, 1 : n + 1]
    raise KeyError(view)


def interpreted_e4m3_nan(route: str, kind: str) -> bool:
    """Whether `kind`'s FP8 kernels read an e4m3 NaN byte as NaN where they run here: Triton's interpreter widens
    0x7F / 0xFF to ±480 in a plain cast, which only the grouped GEMM's `_widen_e4m3` corrects; compiled, the
    conversion keeps NaN (the GPU run checks it)."""
    return not (route == "triton" and not ON_GPU and kind != "grouped_gemm")


def spoil(p: Problem, what: str, g: torch.Generator) -> None:
    """One NaN or infinity in x, or in an expert's weights or scales (an expert some token is routed to)."""
    T, D = p.x.shape
    if what in ("nan_x", "inf_x"):
        t, d = (int(torch.randint(n, (1,), generator=g)) for n in (T, D))
        sign = 1 if torch.rand(1, generator=g) < 0.5 else -1
        p.x[t, d] = float("nan") if what == "nan_x" else sign * float("inf")
        return
    valid = p.ids[(p.ids >= 0) & (p.ids < p.block.E)]
    e = int(valid[0]) if valid.numel() else 0
    fmt, w = p.block.weight_format, p.w
    target = w.gate_up if what == "nan_weight" else w.down
    i, j = (int(torch.randint(n, (1,), generator=g)) for n in target.shape[1:])
    if not fmt.quantized:
        target[e, i, j] = float("nan") if what == "nan_weight" else float("inf")
    elif what == "nan_weight":
        target.view(torch.uint8)[e, i, j] = E4M3_NAN
    elif fmt.scale_dtype == "float32":  # e4m3fn has no infinity: an infinite block scale
        w.down_scale[e, 0, 0] = float("inf")
    else:
        w.down_scale.view(torch.uint8)[e, 0, 0] = UE8M0_NAN


@st.composite
def problems(draw, route: str, fmt: str, layouts=tuple(LAYOUTS), views=VIEWS, device="cpu", accepts=None,
             non_finite=NON_FINITE):
    """A Problem of the route's shapes in `fmt` (module doc). `accepts(block)` → None or a refusal: a block it
    refuses falls back to the standard layout, then to bfloat16 activations."""
    s = SHAPES[route]
    routing = draw(st.sampled_from(ROUTINGS))
    E = draw(st.integers(2 if routing == "duplicates" else 1, s.E_max))
    if routing == "k_is_E":
        k = E
    else:
        k = draw(st.integers(2 if routing == "duplicates" else 1, max(1, min(E, s.k_max))))
    T = 0 if routing == "empty" else -(-E // k) if routing == "all_once" else draw(st.integers(1, s.T_max))
    quantized = fmt not in DTYPES
    dims = s.fp8_dims if quantized else s.dims
    D, F = draw(st.sampled_from(dims)), draw(st.sampled_from(dims))
    blk = draw(st.sampled_from(s.blocks))
    if quantized:
        D, F = max(D, blk[1]) // blk[1] * blk[1], max(F, blk[1]) // blk[1] * blk[1]
    layout = draw(st.sampled_from(layouts)) if not quantized else "standard"
    apply = draw(st.sampled_from(("output", "output", "input")))
    compute = draw(st.sampled_from(("bfloat16", "bfloat16", "float16", "float32")))
    block = make_block(fmt, E, k, D, F, blk, layout, apply, compute)
    for fallback in (dict(layout="standard"), dict(layout="standard", compute="bfloat16")):
        if accepts is None or not accepts(block):
            break
        layout, compute = fallback["layout"], fallback.get("compute", compute)
        block = make_block(fmt, E, k, D, F, blk, layout, apply, compute)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, block.weight_format.compute_dtype)
    ids = route_ids(routing, T, E, k, g)
    x = torch.randn(T, D, generator=g).to(dt)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(dt)
    w = expert_tensors(block, "cpu", seed)
    view = draw(st.sampled_from(("contiguous",) + views))  # contiguous, the common case, twice as often
    p = Problem(block, x, ids, weights, w, routing, view, None)
    if T and draw(st.integers(0, 3)) == 0:
        p.non_finite = draw(st.sampled_from(non_finite))
        spoil(p, p.non_finite, g)
    if device != "cpu":
        p.x, p.ids, p.weights = p.x.to(device), p.ids.to(device), p.weights.to(device)
        p.w = ExpertTensors(*(None if t is None else t.to(device) for t in dataclasses.astuple(p.w)))
    p.x, p.ids, p.weights = (as_view(t, view) for t in (p.x, p.ids, p.weights))
    return p


@st.composite
def schedules(draw, backend: str, kind: str, fmt: str, block: MoEBlock, T: int, sample_space: bool = True):
    """The kind's default at T, or a sample of its space (the default where the sample is refused), with the
    format's activation rule; a hybrid's row threshold drawn so both of its halves run."""
    be = get(backend)
    space = be.space(block, kind)
    params = be.default(block, kind, max(T, 1)).params
    if sample_space and draw(st.booleans()):
        try:
            params = space.make(**{n: draw(st.sampled_from(v)) for n, v in space.choices})
        except UnsupportedSchedule:
            pass
    if has_act_quant(type(params)):
        rule = f"fp8_1x{block.weight_format.block[1]}" if a8(fmt) else "none"
        if params.act_quant != rule:
            try:
                params = space.admit(dataclasses.replace(params, act_quant=rule))
            except UnsupportedSchedule:
                params = space.admit(dataclasses.replace(be.default(block, kind, max(T, 1)).params,
                                                         act_quant=rule))
    rt = draw(st.integers(2, 4)) if kind == "hybrid" else None
    s = Schedule(kind, row_threshold=rt, backend=backend, params=params)
    try:
        be.build(block, s)
    except UnsupportedSchedule:  # refused for this block at build (a layout its loads cannot read): the default
        s = dataclasses.replace(s, params=be.default(block, kind, max(T, 1)).params)
    return s


# ---- the check -------------------------------------------------------------------------------------------------


def reference(p: Problem, group: int | None) -> torch.Tensor:
    """The float32 reference on contiguous CPU copies of the inputs (w8a8: on its rounded activations)."""
    w = ExpertTensors(*(None if t is None else t.cpu() for t in dataclasses.astuple(p.w)))
    return experts_reference(p.block, p.x.cpu().contiguous(), p.ids.cpu().contiguous(),
                             p.weights.cpu().contiguous(), w, group)


def check(out: torch.Tensor, p: Problem, group: int | None, tf32: bool = False) -> None:
    """`out` has x's dtype and shape, NaN and ±inf exactly where the float32 reference has them (an infinite
    block scale: the same rows non-finite, as the FP8 kernels' own tests state it, since whether a block's
    products meet the scale before or after their sum decides inf or NaN), and every row the reference computes
    finite within the package's tolerance of the dtype (w8a8: the a8 bound)."""
    ref = reference(p, group)
    out = out.cpu()
    what = p.describe()
    assert out.dtype == p.x.dtype and out.shape == ref.shape, f"{out.dtype} {tuple(out.shape)}: {what}"
    rows = torch.isfinite(ref).all(1)
    assert torch.equal(torch.isfinite(out).all(1), rows), f"non-finite rows other than the reference's: {what}"
    if p.non_finite == "inf_weight" and p.block.weight_format.quantized:
        out, ref = out[rows], ref[rows]
    assert torch.equal(out.isnan(), ref.isnan()), (
        f"NaN at {out.isnan().nonzero()[:4].tolist()}, the reference's at {ref.isnan().nonzero()[:4].tolist()}: "
        f"{what}")
    assert torch.equal(out.isposinf(), ref.isposinf()) and torch.equal(out.isneginf(), ref.isneginf()), (
        f"±inf other than the reference's: {what}")
    rows = torch.isfinite(ref).all(1)
    err = worst_error(out[rows], ref[rows], tf32=tf32, a8=group is not None)
    assert err <= 1, f"worst error {err:.3g}× the tolerance: {what}"


def run_kernel(backend: str, schedule: Schedule, p: Problem) -> torch.Tensor:
    return get(backend).build(p.block, schedule)(p.x, p.ids, p.weights, p.w)


def group_of(schedule: Schedule | None) -> int | None:
    return None if schedule is None or schedule.params is None else activation_group(schedule.params)

