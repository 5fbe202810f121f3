"""`moetune.explain(model)` and `moetune explain`: what capture found, block by block.

For a model: each MoE block's path, its IR, or the reason it was left as it is. For the CLI:
the block of a preset, a config.json or a model folder (no weights are read), optionally with
the IR after every pass of the pipeline.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from .block import MoEBlock
from .config import block_from_config, load_config, moe_layers
from .errors import CaptureError
from .presets import PRESETS, preset
from .schedule import ScheduledBlock

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
    return found


def format_ir(ir: object) -> str:
    """Readable text of an IR a pass returns: a MoEBlock as itself, a ScheduledBlock bucket by bucket."""
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
    return "\n".join(lines)


def _tokens(spec: str) -> tuple[int, int]:
    try:
        lo, _, hi = spec.partition("-")
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise CaptureError(f"--tokens {spec!r}: expected LO-HI, e.g. 1-4096") from None
    if not 1 <= lo_i <= hi_i:
        raise CaptureError(f"--tokens {spec!r}: need 1 ≤ LO ≤ HI")
    return lo_i, hi_i


def config_from_args(args: argparse.Namespace) -> tuple[dict, str]:
    """(config dict, its name) for --preset, --config or --model-dir."""
    if getattr(args, "preset", None):
        preset(args.preset)  # an unknown name raises, listing the presets
        return PRESETS[args.preset], args.preset
    path = args.config or args.model_dir
    name = str(Path(path) / "config.json") if getattr(args, "model_dir", None) else str(path)
    return load_config(path), name


def block_from_args(args: argparse.Namespace) -> MoEBlock:
    """The MoEBlock named by --preset, --config or --model-dir (no weights are read)."""
    T_max = _tokens(getattr(args, "tokens", None) or "1-4096")[1]
    cfg, name = config_from_args(args)
    return block_from_config(cfg, name=name, dtype=getattr(args, "dtype", None), T_max=T_max)


def _ranges(idx: list[int]) -> str:
    """[3, 4, 5, 9] → "3-5, 9"."""
    out, start = [], None
    for i, v in enumerate(idx):
        start = v if start is None else start
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v > start else f"{v}")
            start = None
    return ", ".join(out)


def run(args: argparse.Namespace) -> int:
    block = block_from_args(args)
    print(block)
    cfg, name = config_from_args(args)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    layers = moe_layers(cfg, name)
    if layers is not None:
        print(f"  MoE layers: {len(layers)} of {text['num_hidden_layers']} ({_ranges(layers) or 'none'})")
    quant = text.get("quantization_config") or cfg.get("quantization_config")
    if isinstance(quant, dict):
        print(f"  note: the checkpoint is quantized (quant_method {quant.get('quant_method')!r}); capture "
              f"leaves quantized experts as they are, so this {block.weight_dtype} block describes the "
              "model loaded dequantized")
    if not getattr(args, "passes", False):
        return 0
    if importlib.util.find_spec("moetune.passes.pipeline") is None:
        print("\n--passes: the pass pipeline (moetune.passes.pipeline) is not part of this build yet; "
              "only the captured IR is shown")
        return 0
    from ..passes.pipeline import run_pipeline

    steps = run_pipeline(block, target=args.target, trace=args.trace, tokens=_tokens(args.tokens))
    for pass_name, ir in steps:
        print(f"\n== after {pass_name}\n{format_ir(ir)}")
    return 0
