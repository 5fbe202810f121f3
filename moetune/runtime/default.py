"""The default schedules: what a compiled model runs where its dispatch table has no usable entry.

They are the pass pipeline's own output for the block, on the target of the device, with the backend
that will run them (`moetune.passes.schedule_block(block, target, backend=…)`): the bucketing pass's
token buckets and, per bucket, the default-schedule pass's Schedule with that backend's parameters
(the rules of `moetune.passes.policy`). So `moetune explain --passes` prints exactly what runs.
"""

from __future__ import annotations

from ..ir import MoEBlock, Schedule, ScheduledBlock
from ..passes.pipeline import schedule_block
from ..passes.policy import representative_tokens
from ..targets import ALIASES, DEFAULT_GPU, TARGETS


def pass_target(target: str) -> str:
    """The target description the passes use for a dispatch-table target name: itself when described,
    else the CPU's for "cpu" and DEFAULT_GPU's for a GPU not described (the rules read only the kind of
    target and its GEMV row limit; floors are not used at run time)."""
    if target in TARGETS or target in ALIASES:
        return target
    return "cpu" if target == "cpu" else DEFAULT_GPU


def backend_for(target: str):
    """The backend a compiled model runs on `target` by default: triton on a GPU, torch on a CPU; None
    for a target no backend here runs (the passes then stay backend-neutral)."""
    from ..codegen.backend import get
    from ..targets import get_target

    kind = get_target(pass_target(target)).kind
    return get("triton") if kind == "gpu" else get("torch") if kind == "cpu" else None


def machine_backend() -> str:
    """The backend this machine tunes and runs with by default: triton where a CUDA GPU is visible, else torch."""
    import torch

    return "triton" if torch.cuda.is_available() else "torch"


def backend_device(backend: str) -> str:
    """The device a backend's kernels are timed on: the CPU for torch, the CUDA GPU for the others."""
    return "cpu" if backend == "torch" else "cuda"


_PLANS: dict[tuple, tuple[object, ScheduledBlock]] = {}


def default_plan(block: MoEBlock, backend, target: str) -> ScheduledBlock:
    """The final IR of the pass pipeline for `block` on `target` with `backend`'s defaults (kept per block,
    backend object and target: compiling many layers of one model runs the pipeline once)."""
    key = (block, id(backend), target)
    hit = _PLANS.get(key)
    if hit is None or hit[0] is not backend:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        hit = _PLANS[key] = (backend, schedule_block(block, pass_target(target), backend=backend))
    return hit[1]


def default_buckets(block: MoEBlock, backend, target: str) -> list[tuple[int, int]]:
    """The default buckets' (lo, hi), covering [1, block.T_max]."""
    return [(b.lo, b.hi) for b in default_plan(block, backend, target).buckets]


def default_at(block: MoEBlock, backend, target: str, tokens: int) -> Schedule:
    """The default Schedule of the bucket holding `tokens` (the last bucket's above T_max)."""
    plan = default_plan(block, backend, target)
    return plan.bucket_for(max(1, min(tokens, block.T_max))).schedule


def default_for(block: MoEBlock, backend, target: str, lo: int, hi: int) -> Schedule:
    """The default Schedule for a range [lo, hi]: that of the default bucket holding its representative T."""
    return default_at(block, backend, target, representative_tokens(lo, hi))
