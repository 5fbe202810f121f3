"""Run-time dispatch: token buckets → built kernels, resolved once at compile time.

    dispatcher = Dispatcher.default(block, backend)                      # no table: default buckets
    dispatcher = Dispatcher.from_entries(block, backend, entries)        # a table's (lo, hi, Schedule)
    out = dispatcher(x, ids, weights, w)                                 # bisect on T = x.shape[0]

A call reads only the host-side T (a shape, never a device value) and bisects precomputed bucket
ends: no device sync, no table lookup, no Python object built per call. T above the last bucket
uses the last bucket's kernel; T = 0 returns an empty [0, D] result without calling a kernel.

Default buckets and their schedules (no table, or the gaps between a table's entries) are the pass
pipeline's (`moetune.runtime.default`): the same buckets the search tunes, the same schedules
`moetune explain --passes` prints.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from ..codegen.backend import Backend, get
from ..codegen.tensors import ExpertsFn, ExpertTensors
from ..ir import IRError, MoEBlock, MoetuneError, Schedule, UnsupportedSchedule
from .default import default_buckets, default_for

DefaultFactory = Callable[[int, int], Schedule]  # (lo, hi) → the bucket's default Schedule


class DispatchWarning(UserWarning):
    """Some buckets run the default schedule because the table had no usable entry for them."""


@dataclass(frozen=True)
class Route:
    """One bucket lo ≤ T ≤ hi, its schedule, where the schedule came from, and its built kernel."""

    lo: int
    hi: int
    schedule: Schedule
    source: str  # "table" | "table (estimate)" | "default" | "default (table entry refused: …)"
    fn: ExpertsFn

    @property
    def label(self) -> str:
        return f"[{self.lo},{self.hi}]"


class Dispatcher:
    """Sorted, non-overlapping routes covering [1, hi of the last]; `__call__` bisects on T."""

    def __init__(self, block: MoEBlock, backend: Backend, routes: Sequence[Route], target: str = "cpu"):
        routes = sorted(routes, key=lambda r: r.lo)
        node = f"Dispatcher({block.name or block.signature_hash()})"
        if not routes:
            raise IRError(node, "routes", (), "empty")
        expect = 1
        for r in routes:
            if r.lo != expect:
                raise IRError(
                    node,
                    f"route {r.label}.lo",
                    r.lo,
                    f"{'gap' if r.lo > expect else 'overlap'}: the previous bucket ends at {expect - 1}",
                )
            expect = r.hi + 1
        self.block, self.backend, self.target, self.routes = block, backend, target, tuple(routes)
        self._his = [r.hi for r in self.routes]
        self._fns = [r.fn for r in self.routes]
        self._last = len(self._fns) - 1

    # ------------------------------------------------------------------------------------- call
    def index(self, tokens: int) -> int:
        """Position of the route serving `tokens` (the last one above its end)."""
        return min(bisect.bisect_left(self._his, tokens), self._last)

    def route(self, tokens: int) -> Route:
        return self.routes[self.index(tokens)]

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors
    ) -> torch.Tensor:
        T = x.shape[0]  # host-side int
        if T == 0:
            return x.new_zeros((0, x.shape[1]))
        i = self.index(T)
        try:
            return self._fns[i](x, ids, weights, w)
        except UnsupportedSchedule as e:  # the call's tensors, not the block, rule the kernel out
            err = e
        for _ in range(2):  # the backend's default, then torch's
            try:
                return self._refused(i, err)(x, ids, weights, w)
            except UnsupportedSchedule as e:
                err = e
        raise err

    def _refused(self, i: int, err: UnsupportedSchedule) -> ExpertsFn:
        """A route whose kernel refused a call (checked on the host before any output is written, e.g.
        weights a TMA descriptor cannot address) is replaced, for good, by the bucket's default on this
        backend, or by torch's default when the refused route already was one; one DispatchWarning."""
        r = self.routes[i]
        why = f"{r.schedule.describe()} refused a call: {err}"
        if r.source.startswith("default"):  # every default route's source, torch fallbacks included
            torch_be = get("torch")
            sch = default_for(self.block, torch_be, self.target, r.lo, r.hi)
            new = _build(self.block, torch_be, r.lo, r.hi, sch, f"default ({why}), torch fallback")
        else:
            new = _build_default(self.block, self.backend, self.target, r.lo, r.hi,
                                 _default_factory(self.block, self.backend, self.target),
                                 f"default ({why})", [])  # a torch fallback shows in the route's source
        warnings.warn(f"{self.block.name or self.block.signature_hash()}: bucket {r.label}: {why}; it runs "
                      f"{new.schedule.describe()} from now on", DispatchWarning, stacklevel=4)
        routes = list(self.routes)
        routes[i] = new
        self.routes = tuple(routes)
        self._fns[i] = new.fn
        return new.fn

    def describe(self) -> str:
        return "\n".join(f"  T∈{r.label:<12} {r.schedule.describe()}  ({r.source})" for r in self.routes)

    # --------------------------------------------------------------------------------- building
    @classmethod
    def default(
        cls,
        block: MoEBlock,
        backend: Backend,
        buckets: Sequence[tuple[int, int]] | None = None,
        default_factory: DefaultFactory | None = None,
        *,
        target: str = "cpu",
    ) -> Dispatcher:
        """Every bucket on its default schedule (no table). A default the backend cannot build runs
        the torch backend's default instead, with one DispatchWarning naming the buckets."""
        factory = default_factory or _default_factory(block, backend, target)
        notes: list[str] = []
        routes = [
            _build_default(block, backend, target, lo, hi, factory, "default", notes)
            for lo, hi in (buckets or default_buckets(block, backend, target))
        ]
        _warn_fallbacks(block, backend, notes)
        return cls(block, backend, routes, target)

    @classmethod
    def from_entries(
        cls,
        block: MoEBlock,
        backend: Backend,
        entries: Sequence[tuple[int, int, Schedule]],
        default_factory: DefaultFactory | None = None,
        *,
        target: str = "cpu",
        where: str = "dispatch table",
        table_notes: Sequence[str] = (),
        estimated: Collection[tuple[int, int]] = (),
    ) -> Dispatcher:
        """Routes from a table's (lo, hi, Schedule) entries; the token ranges they leave uncovered in
        [1, T_max] are split by the default buckets and run their defaults, with ONE DispatchWarning
        naming those buckets (and any entry the backend refused to build, with its reason), led by
        `table_notes` (why the table's other entries were not usable). The entries whose (lo, hi) are in
        `estimated` were chosen by a cost model, not timed (`load_entries`): their routes say so in their source.
        Overlapping entries raise IRError: a table never borrows a schedule across buckets."""
        factory = default_factory or _default_factory(block, backend, target)
        node = f"{where} for {block.name or block.signature_hash()}"
        entries = sorted(entries, key=lambda e: e[0])
        for (lo1, hi1, _), (lo2, hi2, _) in zip(entries, entries[1:], strict=False):
            if lo2 <= hi1:
                raise IRError(node, "entries", ((lo1, hi1), (lo2, hi2)), "overlapping buckets")
        routes: list[Route] = []
        missing: list[str] = []
        notes: list[str] = []
        for lo, hi, sch in entries:
            if not 1 <= lo <= hi:
                raise IRError(node, "entry", (lo, hi), "need 1 ≤ lo ≤ hi")
            try:
                routes.append(_build(block, backend, lo, hi, sch,
                                     "table (estimate)" if (lo, hi) in estimated else "table"))
            except MoetuneError as e:
                why = f"entry {sch.describe()} refused: {e}"
                routes.append(_build_default(block, backend, target, lo, hi, factory, f"default ({why})", notes))
                missing.append(f"[{lo},{hi}] ({why})")
        end = max(block.T_max, entries[-1][1] if entries else 0)
        gaps = _gaps([(r.lo, r.hi) for r in routes], end)
        wide = block if end == block.T_max else block.replace(T_max=end)
        defaults = default_buckets(wide, backend, target) if gaps else []
        for lo, hi in gaps:
            for blo, bhi in defaults:
                a, b = max(lo, blo), min(hi, bhi)
                if a <= b:  # a piece of a default bucket runs that bucket's default
                    routes.append(_build_default(block, backend, target, a, b, factory, "default (no entry)",
                                                 notes, judged_at=(blo, bhi)))
                    missing.append(f"[{a},{b}]")
        _warn_fallbacks(block, backend, notes)
        if missing or table_notes:
            said = [*table_notes]
            if missing:
                said.append(f"{node}, backend {backend.name}: no usable entry for bucket(s) "
                            f"{', '.join(missing)}; they run the default schedule")
            warnings.warn("; ".join(said), DispatchWarning, stacklevel=2)
        return cls(block, backend, routes, target)


def _default_factory(block: MoEBlock, backend: Backend, target: str) -> DefaultFactory:
    return lambda lo, hi: default_for(block, backend, target, lo, hi)


def _build(block: MoEBlock, backend: Backend, lo: int, hi: int, sch: Schedule, source: str) -> Route:
    return Route(lo, hi, sch, source, backend.build(block, sch))


def _build_default(
    block: MoEBlock,
    backend: Backend,
    target: str,
    lo: int,
    hi: int,
    factory: DefaultFactory,
    source: str,
    notes: list[str],
    judged_at: tuple[int, int] | None = None,
) -> Route:
    """The default of [lo, hi] on `backend` (that of the range `judged_at` when given: a gap's piece of a
    default bucket runs the whole bucket's default); if that backend cannot build it, torch's default
    (which runs wherever torch does), noted in `notes` for the one warning."""
    jlo, jhi = judged_at or (lo, hi)
    try:
        sch = factory(jlo, jhi)
        return _build(block, backend, lo, hi, sch, source)
    except MoetuneError as e:
        if backend.name == "torch":
            raise
        torch_be = get("torch")
        alt = default_for(block, torch_be, target, jlo, jhi)
        notes.append(f"[{lo},{hi}] ({e}; runs {alt.describe()})")
        return _build(block, torch_be, lo, hi, alt, f"{source}, torch fallback")


def _warn_fallbacks(block: MoEBlock, backend: Backend, notes: list[str]) -> None:
    if notes:
        warnings.warn(
            f"{block.name or block.signature_hash()}: backend {backend.name} cannot build its default in "
            f"bucket(s) {', '.join(notes)}",
            DispatchWarning,
            stacklevel=3,
        )


def _gaps(covered: list[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    gaps, nxt = [], 1
    for lo, hi in sorted(covered):
        if lo > nxt:
            gaps.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt <= end:
        gaps.append((nxt, end))
    return gaps
