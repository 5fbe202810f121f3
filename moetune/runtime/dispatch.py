"""Run-time dispatch: token buckets → built kernels, resolved once at compile time.

    dispatcher = Dispatcher.default(block, backend)                      # no table: default buckets
    dispatcher = Dispatcher.from_entries(block, backend, entries)        # a table's (lo, hi, Schedule)
    out = dispatcher(x, ids, weights, w)                                 # bisect on T = x.shape[0]

A call reads only the host-side T (a shape, never a device value) and bisects precomputed bucket
ends: no device sync, no table lookup, no Python object built per call. T above the last bucket
uses the last bucket's kernel; T = 0 returns an empty [0, D] result without calling a kernel.

Default buckets (no table, or gaps between a table's entries) follow the rows-per-expert regime:
the bucketing pass of `moetune.passes` (uniform routing; the same ranges the search tunes) when it
is importable, else `regime_buckets` here: T ranges cut where the expected rows per active expert
(uniform routing) crosses REGIME_CUTS, so that no bucket spans the one-row and the many-rows regime.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..codegen.backend import Backend, get
from ..codegen.common import ExpertsFn, ExpertTensors
from ..ir import IRError, MoEBlock, MoetuneError, Schedule, UnsupportedSchedule
from .default import default_schedule, representative_tokens, rows_per_active

REGIME_CUTS = (1.5, 4.0, 16.0)  # rows per active expert where a default bucket ends

DefaultFactory = Callable[[int, int], Schedule]  # (lo, hi) → the bucket's default Schedule


class DispatchWarning(UserWarning):
    """Some buckets run the default schedule because the table had no usable entry for them."""


@dataclass(frozen=True)
class Route:
    """One bucket lo ≤ T ≤ hi, its schedule, where the schedule came from, and its built kernel."""

    lo: int
    hi: int
    schedule: Schedule
    source: str  # "table" | "default" | "default (table entry refused: …)"
    fn: ExpertsFn

    @property
    def label(self) -> str:
        return f"[{self.lo},{self.hi}]"


def regime_buckets(block: MoEBlock, cuts: Sequence[float] = REGIME_CUTS) -> list[tuple[int, int]]:
    """[1, T_max] cut where rows per active expert first reaches each of `cuts` (it grows with T)."""
    ends, lo = [], 1
    for c in cuts:
        if lo > block.T_max or rows_per_active(block, block.T_max) < c:
            break
        a, b = lo, block.T_max  # smallest T in [lo, T_max] with rows(T) ≥ c
        while a < b:
            m = (a + b) // 2
            if rows_per_active(block, m) >= c:
                b = m
            else:
                a = m + 1
        if a > lo:
            ends.append((lo, a - 1))
            lo = a
    ends.append((lo, block.T_max))
    return ends


def default_buckets(block: MoEBlock) -> list[tuple[int, int]]:
    """The bucketing pass's ranges (`moetune.passes.bucketing.split`, uniform routing) when the
    passes are importable, else `regime_buckets`."""
    try:
        from ..passes.bucketing import split
        from ..passes.pipeline import context
    except ImportError:  # a deployment may ship without the passes
        return regime_buckets(block)
    return [(int(lo), int(hi)) for lo, hi in split(block, context(block, "cpu"))]


class Dispatcher:
    """Sorted, non-overlapping routes covering [1, hi of the last]; `__call__` bisects on T."""

    def __init__(self, block: MoEBlock, backend: Backend, routes: Sequence[Route]):
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
        self.block, self.backend, self.routes = block, backend, tuple(routes)
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
            sch = default_schedule(self.block, torch_be, representative_tokens(r.lo, r.hi))
            new = _build(self.block, torch_be, r.lo, r.hi, sch, f"default ({why}), torch fallback")
        else:
            new = _build_default(self.block, self.backend, r.lo, r.hi, _default_factory(self.block, self.backend),
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
    ) -> Dispatcher:
        """Every bucket on the default heuristic (no table). A default the backend cannot build runs
        the torch backend's default instead, with one DispatchWarning naming the buckets."""
        factory = default_factory or _default_factory(block, backend)
        notes: list[str] = []
        routes = [
            _build_default(block, backend, lo, hi, factory, "default", notes)
            for lo, hi in (buckets or default_buckets(block))
        ]
        _warn_fallbacks(block, backend, notes)
        return cls(block, backend, routes)

    @classmethod
    def from_entries(
        cls,
        block: MoEBlock,
        backend: Backend,
        entries: Sequence[tuple[int, int, Schedule]],
        default_factory: DefaultFactory | None = None,
        *,
        where: str = "dispatch table",
        table_notes: Sequence[str] = (),
    ) -> Dispatcher:
        """Routes from a table's (lo, hi, Schedule) entries; the token ranges they leave uncovered in
        [1, T_max] are split by the default buckets and run the default, with ONE DispatchWarning
        naming those buckets (and any entry the backend refused to build, with its reason), led by
        `table_notes` (why the table's other entries were not usable).
        Overlapping entries raise IRError: a table never borrows a schedule across buckets."""
        factory = default_factory or _default_factory(block, backend)
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
                routes.append(_build(block, backend, lo, hi, sch, "table"))
            except MoetuneError as e:
                why = f"entry {sch.describe()} refused: {e}"
                routes.append(_build_default(block, backend, lo, hi, factory, f"default ({why})", notes))
                missing.append(f"[{lo},{hi}] ({why})")
        end = max(block.T_max, entries[-1][1] if entries else 0)
        gaps = _gaps([(r.lo, r.hi) for r in routes], end)
        defaults = default_buckets(block if end == block.T_max else block.replace(T_max=end)) if gaps else []
        for lo, hi in gaps:
            for blo, bhi in defaults:
                a, b = max(lo, blo), min(hi, bhi)
                if a <= b:
                    routes.append(_build_default(block, backend, a, b, factory, "default (no entry)", notes))
                    missing.append(f"[{a},{b}]")
        _warn_fallbacks(block, backend, notes)
        if missing or table_notes:
            said = [*table_notes]
            if missing:
                said.append(f"{node}, backend {backend.name}: no usable entry for bucket(s) "
                            f"{', '.join(missing)}; they run the default schedule")
            warnings.warn("; ".join(said), DispatchWarning, stacklevel=2)
        return cls(block, backend, routes)


def _default_factory(block: MoEBlock, backend: Backend) -> DefaultFactory:
    return lambda lo, hi: default_schedule(block, backend, representative_tokens(lo, hi))


def _build(block: MoEBlock, backend: Backend, lo: int, hi: int, sch: Schedule, source: str) -> Route:
    return Route(lo, hi, sch, source, backend.build(block, sch))


def _build_default(
    block: MoEBlock,
    backend: Backend,
    lo: int,
    hi: int,
    factory: DefaultFactory,
    source: str,
    notes: list[str],
) -> Route:
    """The bucket's default on `backend`; if that backend cannot build it, torch's default (which runs
    wherever torch does), noted in `notes` for the one warning."""
    try:
        sch = factory(lo, hi)
        return _build(block, backend, lo, hi, sch, source)
    except MoetuneError as e:
        if backend.name == "torch":
            raise
        torch_be = get("torch")
        alt = default_schedule(block, torch_be, representative_tokens(lo, hi))
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
