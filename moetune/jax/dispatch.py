"""Which JAX kernel runs a block at a token count: the backend, then the route of the bucket holding T.

    be = jax_backend(None)                        # "reference" | a registered backend with JAX kernels
    r = route(block, T, table=…, backend=…)       # Route(lo, hi, schedule, source, fn), fn a JaxExpertsFn

A JAX backend is "reference" (the float32 JAX reference, moetune.codegen.pallas_tpu.reference, cast to x's
dtype; it runs no schedule), a registered backend whose kernel kinds have a `build_jax` ("pallas_tpu";
"pallas_gpu" where that backend is installed), or any other registered backend, whose torch kernels run at
an XLA FFI call (moetune.jax.xla_call: "triton", "torch"). With no name: the first of DEFAULT_ORDER whose
platform JAX sees and which is usable there, else the reference.

The routes of a (block, backend, table, target) are built once, the first time a trace asks, the way the
torch runtime builds its dispatcher (moetune.runtime.dispatch): the table's usable entries of that backend
(`load_entries` / `DispatchTable.lookup`: stale, foreign and overlapping entries are left out) and, in the
token ranges they leave uncovered, the default buckets with their default schedules (moetune.runtime.default,
the pass pipeline's). A table entry serves only the backend it names: a triton entry serves the JAX path on
the triton backend exactly as it serves the torch runtime, and entries of other backends are never read.
One DispatchWarning names the buckets that run a default, and why;
with no table every bucket runs its default and nothing is said. A default the backend cannot build runs the
reference, said in that warning. A backend that runs none of its kernels on the block is refused when it
was asked for by name; chosen by default, it gives way to the reference, said once. T above the last bucket
takes the last bucket's route.
"""

from __future__ import annotations

import bisect
import os
import warnings
from dataclasses import dataclass

from ..codegen.backend import for_target, get
from ..ir import MoEBlock, MoetuneError, Schedule, UnsupportedSchedule
from ..runtime.default import default_buckets, default_for, pass_target
from ..runtime.dispatch import DispatchWarning, Route, _gaps

REFERENCE = "reference"
DEFAULT_ORDER = (("tpu", "pallas_tpu"), ("gpu", "pallas_gpu"))  # JAX platform → the backend it runs by default


def reference_fn(block: MoEBlock):
    """The JaxExpertsFn of the float32 JAX reference, its result in x's dtype."""
    from ..codegen.pallas_tpu.reference import experts_reference

    def run(x, ids, weights, w):
        return experts_reference(block, x, ids, weights, w).astype(x.dtype)

    return run


def _platforms() -> set[str]:
    import jax

    return {d.platform for d in jax.devices()}


def _kernel_backend(name: str):
    """The registered backend `name` if it runs JAX kernels here; MoetuneError saying why not."""
    try:
        be = get(name)
    except (MoetuneError, ImportError) as e:
        raise UnsupportedSchedule(f"moetune.jax: backend {name!r} is not installed in this moetune ({e}); "
                                  f"backend={REFERENCE!r} runs anywhere") from e
    if not any(getattr(k, "build_jax", None) is not None for k in getattr(be, "KINDS", ())):
        from .xla_call import bridged_backend

        be = bridged_backend(be)  # its torch kernels, called through the XLA FFI
    why = be.available()
    if why:
        raise UnsupportedSchedule(f"moetune.jax: backend {name!r} is not usable here: {why}")
    return be


def jax_backend(name: str | None):
    """REFERENCE or the kernel backend object `name` names (module doc for None)."""
    if name == REFERENCE:
        return REFERENCE
    if name is not None:
        return _kernel_backend(name)
    here = _platforms()
    for platform, backend in DEFAULT_ORDER:
        if platform in here:
            try:
                return _kernel_backend(backend)
            except MoetuneError:
                continue
    return REFERENCE


def _for_target(be, target: str):
    """`be` made for the target description of the table target `target` (codegen.backend.for_target), bridged
    to the XLA FFI as `be` is."""
    registered = get(be.name)
    made = for_target(be.name, pass_target(target))
    if made is registered:
        return be
    if be is registered:
        return made
    from .xla_call import bridged_backend

    return bridged_backend(made)


def _gpu_target(be) -> str | None:
    """The table target of the CUDA GPU a GPU backend runs on here ("h100"), None off one."""
    if be.target.kind != "gpu" or _device() != "cuda":
        return None
    from ..runtime.versions import target_of

    return target_of("cuda")


def _device() -> str:
    """The device name the table's versions are judged against ("tpu", "cuda" or "cpu")."""
    here = _platforms()
    if "tpu" in here:
        return "tpu"
    if "gpu" in here:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


@dataclass(frozen=True)
class Routes:
    """A block's routes on one JAX backend, sorted and covering [1, hi of the last]."""

    block: MoEBlock
    backend: str
    routes: tuple[Route, ...]

    def at(self, tokens: int) -> Route:
        his = [r.hi for r in self.routes]
        return self.routes[min(bisect.bisect_left(his, tokens), len(self.routes) - 1)]

    def describe(self) -> str:
        return "\n".join(f"  T∈{r.label:<12} {_describe(r)}  ({r.source})" for r in self.routes)


def _describe(r: Route) -> str:
    return r.schedule.describe() if r.schedule is not None else REFERENCE


_ROUTES: dict[tuple, Routes] = {}


def routes(block: MoEBlock, *, table=None, backend: str | None = None, target: str | None = None) -> Routes:
    """The routes of `block` (module doc), built once per (block, backend, table, target)."""
    be = jax_backend(backend)
    name = REFERENCE if be == REFERENCE else be.name
    tkey = None if table is None else (os.fspath(table) if isinstance(table, (str, os.PathLike)) else id(table))
    key = (block, name, id(be), tkey, target)
    hit = _ROUTES.get(key)
    if hit is None:
        if be != REFERENCE and all(be.kinds(block).values()):
            why = "; ".join(f"{k}: {v}" for k, v in be.kinds(block).items()) or "it has no kernels"
            why = f"backend {be.name} runs none of its kernels on {_name(block)} ({why})"
            if backend is not None:
                raise UnsupportedSchedule(f"moetune.jax: {why}")
            warnings.warn(f"{why}; it runs {REFERENCE}", DispatchWarning, stacklevel=3)
            be, name = REFERENCE, REFERENCE
        if be == REFERENCE:
            if table is not None:
                warnings.warn(f"{_name(block)}: backend {REFERENCE!r} runs no schedule; dispatch table "
                              f"{_where(table)} not read", DispatchWarning, stacklevel=3)
            built = (Route(1, block.T_max, None, REFERENCE, reference_fn(block)),)
        else:
            tgt = target or _gpu_target(be) or be.target.name
            built = _kernel_routes(block, _for_target(be, tgt), table, tgt)
        if len(_ROUTES) >= 256:
            _ROUTES.clear()
        hit = _ROUTES[key] = Routes(block, name, built)
    return hit


def route(block: MoEBlock, tokens: int, *, table=None, backend: str | None = None,
          target: str | None = None) -> Route:
    """The route serving `tokens` tokens of `block`: what moetune.jax.experts runs at that T."""
    return routes(block, table=table, backend=backend, target=target).at(tokens)


def _name(block: MoEBlock) -> str:
    return block.name or block.signature_hash()


def _where(table) -> str:
    return os.fspath(table) if isinstance(table, (str, os.PathLike)) else str(getattr(table, "path", table))


def _entries(block: MoEBlock, be, table, target: str, notes: list[str]) -> list[tuple[int, int, Schedule]]:
    """The table's usable entries of `block` on (target, backend), its reasons for the others in `notes`."""
    from ..runtime.table import DispatchTable, load_entries, table_path

    if isinstance(table, DispatchTable):
        found = table.lookup(block, target, be.name, device=_device())
        if found.warning():
            notes.append(found.warning())
        usable, others = list(found.usable), _other_backends(table, block, target, be.name)
    else:
        usable, others = load_entries(table, block, target, be.name, device=_device(), notes=notes), []
        if table_path(table, target).exists():  # a folder of tables: its file of this target
            with DispatchTable(table_path(table, target), create=False) as t:
                others = _other_backends(t, block, target, be.name)
    if others and not usable:
        notes.append(f"dispatch table {_where(table)} holds entries of this block on {target} for backend(s) "
                     f"{', '.join(others)}, none for {be.name}")
    return usable


def _other_backends(table, block: MoEBlock, target: str, backend: str) -> list[str]:
    return sorted({e.backend for e in table.entries(target=target, signature=block.signature_hash())} - {backend})


def _kernel_routes(block: MoEBlock, be, table, target: str) -> tuple[Route, ...]:
    notes: list[str] = []
    entries = sorted(_entries(block, be, table, target, notes), key=lambda e: e[0]) if table is not None else []
    built: list[Route] = []
    missing: list[str] = []
    fallbacks: list[str] = []
    for lo, hi, sch in entries:
        try:
            built.append(Route(lo, hi, sch, "table", be.build_jax(block, sch)))
        except MoetuneError as e:
            why = f"entry {sch.describe()} refused: {e}"
            built.append(_default(block, be, target, (lo, hi), (lo, hi), f"default ({why})", fallbacks))
            missing.append(f"[{lo},{hi}] ({why})")
    end = max(block.T_max, entries[-1][1] if entries else 0)
    gaps = _gaps([(r.lo, r.hi) for r in built], end)
    wide = block if end == block.T_max else block.replace(T_max=end)
    try:
        defaults = default_buckets(wide, be, target) if gaps else []
    except MoetuneError as e:  # the pass pipeline found no default for some bucket: the gaps run the reference
        fallbacks.append(f"{', '.join(f'[{lo},{hi}]' for lo, hi in gaps)} ({e}; runs {REFERENCE})")
        defaults = []
        built += [Route(lo, hi, None, f"default, {REFERENCE} fallback", reference_fn(block)) for lo, hi in gaps]
    for lo, hi in gaps:
        for blo, bhi in defaults:
            a, b = max(lo, blo), min(hi, bhi)
            if a <= b:  # a piece of a default bucket runs that bucket's default
                source = "default (no entry)" if table is not None else "default"
                built.append(_default(block, be, target, (a, b), (blo, bhi), source, fallbacks))
                if table is not None:
                    missing.append(f"[{a},{b}]")
    said = list(notes)
    if missing:
        said.append(f"{_name(block)}, backend {be.name}, target {target}: no usable entry in dispatch table "
                    f"{_where(table)} for bucket(s) {', '.join(missing)}; they run the default schedule")
    if fallbacks:
        said.append(f"{_name(block)}: backend {be.name} cannot build its default in bucket(s) "
                    f"{', '.join(fallbacks)}")
    if said:
        warnings.warn("; ".join(said), DispatchWarning, stacklevel=4)
    return tuple(sorted(built, key=lambda r: r.lo))


def _default(block: MoEBlock, be, target: str, span: tuple[int, int], judged_at: tuple[int, int], source: str,
             fallbacks: list[str]) -> Route:
    """The default route of `span` (the schedule of the default bucket `judged_at`); the reference where the
    backend cannot build it, noted in `fallbacks`."""
    lo, hi = span
    try:
        sch = default_for(block, be, target, *judged_at)
        return Route(lo, hi, sch, source, be.build_jax(block, sch))
    except MoetuneError as e:
        fallbacks.append(f"[{lo},{hi}] ({e}; runs {REFERENCE})")
        return Route(lo, hi, None, f"{source}, {REFERENCE} fallback", reference_fn(block))
