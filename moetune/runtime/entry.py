"""One row of the dispatch table (`DispatchEntry`: a bucket's winner, its timing and the versions it was timed
on) and what a lookup finds for one block (`Lookup`). The file format is `moetune.runtime.schema`'s."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from dataclasses import dataclass

from ..ir import CacheError, MoEBlock, MoetuneError, Schedule
from .versions import Versions


def _tuplify(v):
    if isinstance(v, list):
        return tuple(_tuplify(x) for x in v)
    return v


@dataclass(frozen=True)
class DispatchEntry:
    """One row of the table; `schedule(block)` rebuilds the winner with the backend's params class."""

    target: str
    backend: str
    signature: str
    bucket_lo: int
    bucket_hi: int
    signature_text: str
    kind: str
    row_threshold: int | None
    params_type: str | None
    params: str | None  # JSON object of the params dataclass's fields
    time_us: float
    floor_us: float | None
    pct_of_floor: float | None
    default_time_us: float | None
    baseline_time_us: float | None
    baseline: str | None
    timer: str | None
    trials: int | None
    versions: Versions
    tuned_at: str
    spread_us: float | None = None  # the spread of the re-timings the winner beat the default by more than
    estimated: bool = False  # time_us (and default_time_us) are cost-model estimates, not measurements

    def __post_init__(self) -> None:
        object.__setattr__(self, "estimated", bool(self.estimated))  # the column reads 1, 0 or NULL

    @classmethod
    def of(
        cls, *, target: str, block: MoEBlock, bucket: tuple[int, int], schedule: Schedule, time_us: float,
        versions: Versions, floor_us: float | None = None, default_time_us: float | None = None,
        baseline_time_us: float | None = None, baseline: str | None = None, timer: str | None = None,
        trials: int | None = None, tuned_at: str | None = None, spread_us: float | None = None,
        estimated: bool = False,
    ) -> DispatchEntry:
        if schedule.backend is None:
            raise CacheError(f"entry {target}/{bucket}: schedule {schedule.describe()} names no backend")
        p = schedule.params
        return cls(
            target=target, backend=schedule.backend, signature=block.signature_hash(),
            bucket_lo=int(bucket[0]), bucket_hi=int(bucket[1]), signature_text=block.signature(),
            kind=schedule.kind, row_threshold=schedule.row_threshold,
            params_type=None if p is None else type(p).__name__,
            params=None if p is None else json.dumps(dataclasses.asdict(p), sort_keys=True),
            time_us=float(time_us), floor_us=floor_us,
            pct_of_floor=None if not floor_us else 100.0 * floor_us / time_us,
            default_time_us=default_time_us, baseline_time_us=baseline_time_us, baseline=baseline,
            timer=timer, trials=trials, versions=versions,
            tuned_at=tuned_at or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), spread_us=spread_us,
            estimated=estimated,
        )

    @property
    def bucket(self) -> tuple[int, int]:
        return (self.bucket_lo, self.bucket_hi)

    def schedule(self, block: MoEBlock) -> Schedule:
        """The stored winner as a Schedule; the params dataclass comes from the backend's ParamSpace.

        Raises CacheError when the backend no longer offers that kind, params class or fields."""
        where = f"entry {self.target}/{self.backend} {self.bucket}"
        try:
            params = None
            if self.params is not None:
                from ..codegen.backend import get

                space = get(self.backend).space(block, self.kind)
                ptype = space.params_type
                if ptype.__name__ != self.params_type:
                    raise CacheError(f"{where}: params class {self.params_type}, "
                                     f"backend now has {ptype.__name__}")
                values = json.loads(self.params)
                if not isinstance(values, dict):
                    raise CacheError(f"{where}: params {self.params[:60]!r} is not a JSON object")
                values = {k: _tuplify(v) for k, v in values.items()}
                params = ptype(**values)
            return Schedule(self.kind, row_threshold=self.row_threshold, backend=self.backend, params=params)
        except CacheError:
            raise
        except (MoetuneError, TypeError, ValueError, KeyError, ImportError) as e:
            raise CacheError(f"{where}: cannot rebuild its schedule ({type(e).__name__}: {e})") from e

    def row(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "versions"}
        d.update(dataclasses.asdict(self.versions))
        return d

    @classmethod
    def from_row(cls, row: dict) -> DispatchEntry:
        v = Versions(**{f.name: row[f.name] for f in dataclasses.fields(Versions)})
        names = {f.name for f in dataclasses.fields(cls)} - {"versions"}
        return cls(versions=v, **{n: row[n] for n in names})

    def describe(self) -> str:
        s = self.kind + (f"(R={self.row_threshold})" if self.row_threshold is not None else "")
        if self.params:
            s += " [" + ", ".join(f"{k}={v}" for k, v in json.loads(self.params).items()) + "]"
        return s + (" (estimate)" if self.estimated else "")


@dataclass(frozen=True)
class Lookup:
    """What a table holds for one (target, backend, block): usable entries, rejected ones with reasons, and
    the usable ones whose timing was measured with another version of the backend's library."""

    usable: tuple[tuple[int, int, Schedule], ...]
    rejected: tuple[tuple[DispatchEntry, str], ...]
    path: str
    retime: tuple[tuple[DispatchEntry, str], ...] = ()
    estimated: tuple[DispatchEntry, ...] = ()  # the usable entries whose times are cost-model estimates

    @property
    def measured(self) -> tuple[tuple[int, int, Schedule], ...]:
        """The usable entries that were measured (the estimates left out)."""
        est = {e.bucket for e in self.estimated}
        return tuple(u for u in self.usable if (u[0], u[1]) not in est)

    def warning(self) -> str | None:
        said = []
        for entries, what in ((self.rejected, "not used"), (self.retime, "used, to be re-timed")):
            if entries:
                parts = [f"[{e.bucket_lo},{e.bucket_hi}] {why}" for e, why in entries]
                noun = "entry" if len(parts) == 1 else "entries"
                said.append(f"{len(parts)} {noun} {what}: " + "; ".join(parts))
        if self.estimated:
            spans = ", ".join(f"[{e.bucket_lo},{e.bucket_hi}]" for e in self.estimated)
            noun = "entry" if len(self.estimated) == 1 else "entries"
            said.append(f"{len(self.estimated)} {noun} used as cost-model estimates, not measured (no measured "
                        f"entry covers them): {spans}")
        return f"dispatch table {self.path}: " + "; ".join(said) if said else None
