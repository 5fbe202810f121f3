"""What the Pallas kernel files share: the JAX-side expert tensors, the torch bridge and the interpret switch.

    JaxExperts          the expert tensors as JAX arrays, in the layouts of moetune.codegen.tensors.ExpertTensors
                        (standard: gate_up [E, 2F, D], down [E, D, F]; block scales [E, 2F/r, D/c], [E, D/r, F/c])
    JaxExpertsFn        fn(x [T, D], ids [T, k] int32, weights [T, k], w: JaxExperts) -> [T, D] in x.dtype;
                        jittable; T is static (the array's shape), so a bucket is picked at trace time
    bridged(block, fn)  the torch-facing ExpertsFn of a JaxExpertsFn: tensors cross by DLPack (no copy where
                        both sides share a device), so the search verifies and times the kernel moetune.jax runs
    interpret()         what a pallas_call's `interpret=` gets: False on a TPU; TPU interpret mode elsewhere when
                        MOETUNE_PALLAS_INTERPRET is set ("races" also detects DMA races); False on any machine
                        inside `for_tpu()` (kernels built and traced there lower for TPU: lowering.py)

Ids outside [0, E) (expert-parallel sentinels) contribute nothing, as in the torch reference.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from ...ir import MoEBlock
from ..tensors import ExpertsFn, ExpertTensors

INTERPRET_ENV = "MOETUNE_PALLAS_INTERPRET"
_FOR_TPU = contextvars.ContextVar("moetune_pallas_for_tpu", default=False)


class JaxExperts(NamedTuple):
    gate_up: object
    down: object
    gate_up_bias: object = None
    down_bias: object = None
    gate_up_scale: object = None
    down_scale: object = None


JaxExpertsFn = Callable[[object, object, object, JaxExperts], object]


def on_tpu() -> bool:
    import jax

    return any(d.platform == "tpu" for d in jax.devices())


def interpret_requested() -> str | None:
    v = os.environ.get(INTERPRET_ENV, "")
    return None if v in ("", "0") else v


@contextlib.contextmanager
def for_tpu() -> Iterator[None]:
    """Within it, `interpret()` is False whatever the machine: what is built and traced there is a Mosaic TPU
    kernel, to be lowered for TPU (`jit(f).trace(...).lower(lowering_platforms=("tpu",))`), not run here."""
    token = _FOR_TPU.set(True)
    try:
        yield
    finally:
        _FOR_TPU.reset(token)


def interpret():
    """`interpret=` for pallas_call: False on a TPU (and inside `for_tpu()`), else TPU interpret mode
    (UnsupportedSchedule-free: the backend's available() has already refused a machine with neither)."""
    if _FOR_TPU.get() or (on_tpu() and interpret_requested() is None):
        return False
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(detect_races=interpret_requested() == "races")


def to_jax(t: torch.Tensor | None):
    """A JAX array viewing `t` (DLPack; float8 included), or None."""
    if t is None:
        return None
    import jax.numpy as jnp

    return jnp.from_dlpack(t.detach().contiguous())


def to_torch(a, device: torch.device) -> torch.Tensor:
    return torch.from_dlpack(a).to(device)


def jax_experts(w: ExpertTensors) -> JaxExperts:
    return JaxExperts(*(to_jax(getattr(w, f)) for f in
                        ("gate_up", "down", "gate_up_bias", "down_bias", "gate_up_scale", "down_scale")))


def bridged(block: MoEBlock, fn: JaxExpertsFn) -> ExpertsFn:
    """The torch-facing ExpertsFn of `fn`, jitted once per input shape."""
    import jax

    jitted = jax.jit(fn)

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        if x.shape[0] == 0:  # no token: nothing to launch (a kernel's grid or gather of zero rows need not lower)
            return x.new_zeros(0, block.D)
        out = jitted(to_jax(x), to_jax(ids.to(torch.int32)), to_jax(weights), jax_experts(w))
        return to_torch(out, x.device)

    return run
