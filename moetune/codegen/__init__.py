"""Code generation: a Schedule plus concrete parameters becomes a callable experts kernel.

Every backend (torch/, triton/, pallas/) offers the same contract:

    build(block: MoEBlock, schedule: Schedule) -> ExpertsFn      # or raises UnsupportedSchedule(reason)
    ExpertsFn(x [T, D], ids [T, k] int, weights [T, k], w: ExpertTensors) -> out [T, D] (x.dtype)

Kernels read the model's own parameter tensors in place (`ExpertTensors`): no copy, no repacking.
"""

from .common import ExpertsFn, ExpertTensors

__all__ = ["ExpertTensors", "ExpertsFn"]
