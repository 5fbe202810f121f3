"""Code generation: a Schedule plus concrete parameters becomes a callable experts kernel.

Every backend (torch/, triton/) implements one per-kind contract (`contract.KernelKind`: parameter
type, space, default parameters, build, cost, the sources that version the kind) and offers the
`backend.Backend` interface built from it:

    build(block: MoEBlock, schedule: Schedule) -> ExpertsFn      # or raises UnsupportedSchedule(reason)
    ExpertsFn(x [T, D], ids [T, k] int, weights [T, k], w: ExpertTensors) -> out [T, D] (x.dtype)

Kernels read the model's own parameter tensors in place (`ExpertTensors`): no copy, no repacking.
"""

from .tensors import ExpertsFn, ExpertTensors

__all__ = ["ExpertTensors", "ExpertsFn"]
