"""The torch backend: CPU schedule variants behind the `Backend` contract (registered as "torch").

    kind          params             implementation (one file each)
    grouped_gemm  GroupedGemmParams  sorted_gemm.py (host loop of torch.mm) | grouped_mm.py (grouped GEMM)
    stream_gemv   GatheredParams     gathered.py (chunks of gathered bmm, one row per pair)
    hybrid        HybridParams       hybrid.py (GEMM for experts with ≥ R rows, gathered GEMV for the rest)

Every variant reads the model's own tensors through views, handles every activation and layout of
the IR (swiglu, clamped_swiglu; standard, transposed, interleaved, biases; weight on the output or
the input), drops ids outside [0, E) and returns x.dtype with the k-sum in float32. `Schedule.fusion`
is not a knob here: the torch variants are unfused by construction.
"""

from __future__ import annotations

from ...ir import MoEBlock, Schedule, UnsupportedSchedule
from ..common import ExpertsFn, ParamSpace
from . import gathered, grouped_mm, hybrid, sorted_gemm
from ._common import COMBINES, GroupedGemmParams, expected_distinct, gather_refusal, grouped_mm_refusal
from .gathered import GatheredParams
from .hybrid import HybridParams

PARAMS_TYPES = {"grouped_gemm": GroupedGemmParams, "stream_gemv": GatheredParams, "hybrid": HybridParams}


class TorchBackend:
    name = "torch"

    def available(self) -> str | None:
        return None  # torch runs wherever moetune is imported

    def kinds(self, block: MoEBlock) -> dict[str, str | None]:
        gemv = gather_refusal(block, 1)
        return {"grouped_gemm": None, "stream_gemv": gemv, "hybrid": gemv}

    def space(self, block: MoEBlock, kind: str) -> ParamSpace:
        if kind == "grouped_gemm":
            impls = ("sorted_gemm",) if grouped_mm_refusal(block) else ("sorted_gemm", "grouped_mm")
            return ParamSpace(GroupedGemmParams, (("impl", impls), ("combine", COMBINES)))
        chunks = self._chunks(block, kind)
        if kind == "stream_gemv":
            return ParamSpace(GatheredParams, (("chunk", chunks),))
        heavy = ("sorted_gemm",) if grouped_mm_refusal(block) else ("sorted_gemm", "grouped_mm")
        return ParamSpace(HybridParams, (("heavy", heavy), ("chunk", chunks)))

    def _chunks(self, block: MoEBlock, kind: str) -> tuple[int, ...]:
        if kind not in PARAMS_TYPES:
            raise UnsupportedSchedule(
                f"torch backend: unknown schedule kind {kind!r}; known {', '.join(PARAMS_TYPES)}"
            )
        why = self.kinds(block)[kind]
        if why:
            raise UnsupportedSchedule(f"torch {kind} refused: {why}")
        base = gathered.SPACE.choices[0][1]
        return tuple(c for c in base if gather_refusal(block, c) is None) or (1,)

    def default(self, block: MoEBlock, kind: str, tokens: int) -> Schedule:
        """Heuristic parameters for `kind` at `tokens` (the kind itself is the runtime's choice)."""
        if kind == "grouped_gemm":  # grouped_mm: no host loop; as fast as the loop or slightly faster on CPU
            impl = "sorted_gemm" if grouped_mm_refusal(block) else "grouped_mm"
            return Schedule("grouped_gemm", backend="torch", params=GroupedGemmParams(impl, "index_add"))
        chunks = self._chunks(block, kind)
        pairs_ = max(1, tokens * block.k)
        chunk = next((c for c in chunks if c >= pairs_), chunks[-1])  # one bmm when it fits
        if kind == "stream_gemv":
            return Schedule("stream_gemv", backend="torch", params=GatheredParams(chunk))
        rows = tokens * block.k / max(expected_distinct(block.E, block.k, tokens), 1.0)
        R = max(2, round(2 * rows))
        return Schedule("hybrid", row_threshold=R, backend="torch", params=HybridParams("sorted_gemm", chunk))

    def _params(self, block: MoEBlock, schedule: Schedule):
        if schedule.backend not in (None, "torch"):
            raise UnsupportedSchedule(
                f"torch backend given a {schedule.backend} schedule: {schedule.describe()}"
            )
        want = PARAMS_TYPES.get(schedule.kind)
        if want is None:
            raise UnsupportedSchedule(f"torch backend: unknown schedule kind {schedule.kind!r}")
        params = schedule.params
        if params is None:
            params = self.default(block, schedule.kind, block.T_max).params
        if not isinstance(params, want):
            raise UnsupportedSchedule(
                f"torch {schedule.kind} needs {want.__name__}, got {type(params).__name__}"
            )
        return params

    def build(self, block: MoEBlock, schedule: Schedule) -> ExpertsFn:
        params = self._params(block, schedule)
        if schedule.kind == "grouped_gemm":
            mod = sorted_gemm if params.impl == "sorted_gemm" else grouped_mm
            return mod.build(block, params)
        if schedule.kind == "stream_gemv":
            return gathered.build(block, params)
        return hybrid.build(block, params, schedule.row_threshold)

    def cost(self, block: MoEBlock, schedule: Schedule, tokens: int) -> tuple[float, float]:
        params = self._params(block, schedule)
        if schedule.kind == "grouped_gemm":
            mod = sorted_gemm if params.impl == "sorted_gemm" else grouped_mm
            return mod.cost(block, params, tokens)
        if schedule.kind == "stream_gemv":
            return gathered.cost(block, params, tokens)
        return hybrid.cost(block, params, tokens, schedule.row_threshold)


BACKEND = TorchBackend()
