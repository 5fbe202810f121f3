"""What every backend's tile rule shares (`moetune.codegen.triton.tiles`, `moetune.codegen.pallas_gpu.tiles`): the
rung of a ladder of cuts in rows per active expert, and a rule's fields made into a kind's parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..ir import MoEBlock
from ..passes.policy import rows_per_active


def rung(cuts: tuple[float, ...], block: MoEBlock, T: int) -> int:
    """How many of `cuts` (the rows per active expert at which each next rung starts) `block` reaches at T tokens."""
    if not cuts:
        return 0
    rows = rows_per_active(block, T)
    return sum(rows >= c for c in cuts)


def make(params_type: type, fields: Mapping[str, Any]):
    """`params_type(**fields)`, a field it does not have named in the error."""
    names = set(params_type.__dataclass_fields__)
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"{params_type.__name__} has no field {', '.join(unknown)} (its fields: "
                         f"{', '.join(sorted(names))})")
    return params_type(**fields)
