"""A small backend with known faults, for tests of the search and the table (nothing here is a mock of
a real backend: its kernels compute the real answer through the float32 reference, then break it on
purpose at the points named in `faults`).

    faults: {(kind, tile, stages): "wrong" | "nan" | "crash" | "oom" | "host_oom" | "refuse_build" | "hang" |
             "hang_build" | "die"}  (hang: the kernel never returns; die: the kernel ends the process)
    build_s: each build sleeps this long (a candidate in flight long enough to be interrupted)
    hold: (path, seconds): a build of a point other than the defaults creates the file `path` and sleeps that
             long (a sampled trial held in flight, for its worker to be killed there)
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moetune.codegen.backend import register
from moetune.codegen.space import ParamSpace
from moetune.codegen.torch import experts_reference
from moetune.ir import Bucket, CandidateSpace, MoEBlock, Roofline, Schedule, UnsupportedSchedule
from moetune.passes.policy import representative_tokens


@dataclass(frozen=True)
class ToyParams:
    tile: int = 16
    stages: int = 1

    def __post_init__(self) -> None:
        if self.tile == 64 and self.stages == 3:
            raise UnsupportedSchedule("ToyParams(tile=64, stages=3): needs 200 KiB shared memory, "
                                      "limit 100 KiB; lower stages")


HANG_S = 3600.0  # a hung call: longer than any test waits

SPACE = ParamSpace(ToyParams, (("tile", (16, 32, 64)), ("stages", (1, 2, 3))))


@dataclass
class ToyBackend:
    name: str
    faults: dict = field(default_factory=dict)
    refuse_kinds: dict = field(default_factory=dict)
    built: list = field(default_factory=list)
    build_s: float = 0.0
    hold: tuple[str, float] | None = None

    def available(self) -> str | None:
        return None

    def kinds(self, block: MoEBlock) -> dict[str, str | None]:
        return {k: self.refuse_kinds.get(k) for k in ("grouped_gemm", "stream_gemv", "hybrid")}

    def space(self, block: MoEBlock, kind: str) -> ParamSpace:
        return SPACE

    def default(self, block: MoEBlock, kind: str, tokens: int) -> Schedule:
        rt = 2 if kind == "hybrid" else None
        return Schedule(kind, row_threshold=rt, backend=self.name, params=ToyParams())

    def build(self, block: MoEBlock, schedule: Schedule):
        p = schedule.params
        fault = self.faults.get((schedule.kind, p.tile, p.stages))
        self.built.append(schedule)
        time.sleep(self.build_s)
        if self.hold is not None and p != ToyParams():
            Path(self.hold[0]).touch()
            time.sleep(self.hold[1])
        if fault == "hang_build":
            threading.Event().wait(HANG_S)
        if fault == "refuse_build":
            raise UnsupportedSchedule(f"toy {schedule.kind}: tile {p.tile} does not divide D = {block.D}")

        def fn(x, ids, weights, w):
            if fault == "crash":
                raise RuntimeError("toy kernel: illegal memory access")
            if fault == "oom":
                raise torch.OutOfMemoryError("toy kernel: out of memory")
            if fault == "host_oom":
                raise MemoryError("toy kernel: cannot allocate its workspace")
            if fault == "hang":
                threading.Event().wait(HANG_S)
            if fault == "die":
                os._exit(70)
            out = experts_reference(block, x, ids, weights, w).to(x.dtype)  # [T, D]
            if fault == "wrong":
                out = out * 1.05
            elif fault == "nan":
                out[0, 0] = float("nan")
            return out

        return fn

    def cost(self, block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
        return (1.0, 1.0)

    def sources(self, kind: str) -> tuple[Path, ...]:
        return (Path(__file__),)


def toy(name: str, **kw) -> ToyBackend:
    return register(ToyBackend(name, **kw))


BLOCK = MoEBlock(E=8, k=2, D=32, F=16, weight_dtype="float32", routing_weight_dtype="float32", T_max=64,
                 name="toy")


def bucket(lo: int = 1, hi: int = 8, floor_s: float = 1e-6, rts: tuple[int, ...] = (2, 4, 16)) -> Bucket:
    """A bucket as the passes make one: candidates of the three kinds and a floor of `floor_s` seconds."""
    T = representative_tokens(lo, hi)
    roof = Roofline("toy-target", T, bytes=floor_s * 1e12, flops=1.0, bandwidth=1e12, peak_flops=1e15)
    return Bucket(lo, hi, floor=roof, candidates=(
        CandidateSpace("grouped_gemm", rule="toy"), CandidateSpace("stream_gemv", rule="toy"),
        CandidateSpace("hybrid", row_thresholds=rts, rule="toy")))


BEST = ("stream_gemv", 32, 2)


def cost(s: Schedule) -> float:
    """Fake time in seconds: a unique best at BEST, and the (kind, 64, 1) points faster still."""
    if s is None or s.params is None:
        return 50e-6
    base = {"grouped_gemm": 20e-6, "stream_gemv": 10e-6, "hybrid": 15e-6}[s.kind]
    t = base + abs(s.params.tile - 32) * 0.1e-6 + abs(s.params.stages - 2) * 1e-6
    if s.row_threshold is not None:
        t += s.row_threshold * 0.1e-6
    if (s.params.tile, s.params.stages) == (64, 1):
        t = 1e-6  # the fastest points of the space: tests put a fault on them
    return t
