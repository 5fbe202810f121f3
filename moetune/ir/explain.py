"""`moetune.explain(model)`: what capture found, block by block, and the text of a pass's IR.

For a model: each MoE block's path, its IR, or the reason it was left as it is. `format_ir` is how
`moetune explain --passes` prints the IR after every pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .schedule import Schedule, ScheduledBlock

if TYPE_CHECKING:  # torch is imported only when a model is explained, not for presets or configs
    import torch

    from .capture import Captured


def format_captured(found: list[Captured]) -> str:
    """The text `explain` prints: a summary line, then each block's IR or reason."""
    n_ok = sum(c.ok for c in found)
    lines = [f"{len(found)} MoE block(s) found, {n_ok} captured, {len(found) - n_ok} left as is"]
    for c in found:
        if c.ok:
            lines.append(f"\n{c.path}: {c.block_class} captured")
            lines.append(str(c.block))
        else:
            lines.append(f"\n{c.path}: {c.block_class} NOT captured")
            lines.append(f"  reason: {c.reason}")
    return "\n".join(lines)


def explain(model: torch.nn.Module, *, print_: bool = True, check: bool = True) -> list[Captured]:
    """Capture `model` (changing nothing) and print each block found; returns the `Captured` list."""
    from .capture import capture

    found = capture(model, check=check)
    if print_:
        print(format_captured(found) if found else "no MoE block found (no module has an `experts` child)")
        note = dequantized_note(model, found)
        if note:
            print(f"\nnote: {note}")
    return found


def dequantized_note(model: torch.nn.Module, found: list[Captured]) -> str | None:
    """Why a model loaded from an FP8 checkpoint has unquantised blocks: transformers dequantised it on load
    (it does where there is no GPU, and drops the config's quantization_config). Read from the checkpoint
    folder's config.json; None when the model has no such folder or its blocks are FP8."""
    from pathlib import Path

    from .config import load_config, quantization

    cfg = getattr(model, "config", None)
    where = getattr(cfg, "_name_or_path", None) or getattr(cfg, "name_or_path", None)
    if not where or getattr(cfg, "quantization_config", None) is not None:
        return None
    if not (Path(where) / "config.json").is_file():
        return None
    try:
        quant = quantization(load_config(where))
    except Exception:  # an unreadable folder says nothing about the model in memory
        return None
    if quant is None or quant.get("quant_method") != "fp8":
        return None
    plain = [c.block for c in found if c.ok and not c.block.weight_format.quantized]
    if not plain:
        return None
    return (f"the checkpoint {where} is FP8 (quantization_config quant_method 'fp8'), but transformers "
            f"dequantized it to {plain[0].weight_dtype} on load "
            "(it does so where there is no GPU), so its experts are captured unquantised; loaded on a GPU they are "
            "FP8Experts and capture reads them as fp8_block")


def format_ir(ir: object, schedule_note: Callable[[Schedule], str | None] | None = None) -> str:
    """Readable text of an IR a pass returns: a MoEBlock as itself, a ScheduledBlock bucket by bucket.
    `schedule_note`: a line said of each bucket's schedule (what a layer above the IR knows of it, e.g. the
    accuracy its kernel is checked to), printed under it when not None."""
    if not isinstance(ir, ScheduledBlock) or type(ir).__str__ is not object.__str__:
        return str(ir)
    b = ir.block
    lines = [f"ScheduledBlock {b.name or '(unnamed)'}  [{b.signature_hash()}]: {len(ir.buckets)} bucket(s) "
             f"over T∈[1,{b.T_max}]"]
    for bk in ir.buckets:
        head = f"  {bk.label:<12}"
        if bk.stats is not None:
            s = bk.stats
            head += (f" at T={s.tokens}: {s.distinct_experts:.1f} experts active, {s.rows_per_active:.2f} "
                     f"rows each, max {s.max_rows:.1f} ({s.source})")
        if bk.floor is not None:
            head += f"; floor {bk.floor.time_s * 1e6:.1f} µs {bk.floor.bound}-bound on {bk.floor.target}"
        lines.append(head)
        if bk.candidates:
            kinds = [c.kind + (f"(R∈{list(c.row_thresholds)})" if c.row_thresholds else "")
                     for c in bk.candidates]
            lines.append("      candidates: " + ", ".join(kinds))
        for r in bk.refusals:
            lines.append(f"      refused {r.kind}: {r.reason}")
        if bk.schedule is not None:
            lines.append(f"      schedule: {bk.schedule.describe()}")
            note = schedule_note(bk.schedule) if schedule_note else None
            if note:
                lines.append(f"      accuracy: {note}")
    return "\n".join(lines)

