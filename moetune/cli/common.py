"""What several subcommands share: the block's source, token ranges, durations, files to read and write.

Every check raises `ConfigError` naming the flag, the value given and what was expected; `main`
prints it as one line and exits 2.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

from ..ir import ConfigError, MoEBlock

SOURCES = ("preset", "config", "model_dir", "tiny")


def flag(dest: str) -> str:
    """argparse's dest → the flag a user typed ("model_dir" → "--model-dir")."""
    return "--" + dest.replace("_", "-")


def add_source(p: argparse.ArgumentParser, *, tiny: bool = False) -> None:
    """One of --preset, --config, --model-dir (and --tiny where `tiny`), required."""
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--preset", help="a shipped preset (see `moetune presets`)")
    g.add_argument("--config", help="a HuggingFace config.json")
    g.add_argument("--model-dir", help="a HuggingFace model folder (its config.json is read)")
    if tiny:
        g.add_argument("--tiny", help="the block of a tiny offline model family (demos, tests)")


def parse_tokens(text: str, name: str = "--tokens") -> tuple[int, int]:
    """'1-1024' or '8' → (lo, hi) with 1 ≤ lo ≤ hi."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not m:
        raise ConfigError(f"{name} {text!r}: expected a token range LO-HI such as 1-1024, or one count")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if not 1 <= lo <= hi:
        raise ConfigError(f"{name} {text!r}: expected 1 ≤ LO ≤ HI")
    return lo, hi


def parse_counts(text: str, name: str, within: tuple[int, int]) -> list[int]:
    """'256,512' → the sorted distinct token counts, each inside `within` (the --tokens range)."""
    lo, hi = within
    try:
        counts = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ConfigError(f"{name} {text!r}: expected token counts separated by commas, such as 256,512") from None
    if not counts:
        raise ConfigError(f"{name} {text!r}: expected at least one token count, such as 256,512")
    outside = [t for t in counts if not lo <= t <= hi]
    if outside:
        raise ConfigError(f"{name} {text!r}: expected every count inside --tokens {lo}-{hi} "
                          f"(outside: {', '.join(map(str, outside))})")
    return counts


_UNITS = {None: 1, "s": 1, "m": 60, "min": 60, "h": 3600}


def parse_duration(text: str, name: str = "--budget") -> float:
    """'90s', '10m', '1.5h', '120' (seconds) → seconds, > 0."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h)?\s*", text)
    seconds = float(m.group(1)) * _UNITS[m.group(2)] if m else 0.0
    if seconds <= 0:
        raise ConfigError(f"{name} {text!r}: expected a positive duration such as 90s, 10m")
    return seconds


def whole(value: int | None, name: str, least: int) -> int | None:
    """`value` itself when it is None or ≥ `least`."""
    if value is not None and value < least:
        raise ConfigError(f"{name} '{value}': expected a whole number ≥ {least}")
    return value


def existing_file(path: str, name: str, what: str) -> Path:
    """`path` as a Path when it names a readable file; `what` says what the flag expects."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{name} {path!r}: no such file; expected {what}")
    if not p.is_file():
        raise ConfigError(f"{name} {path!r}: not a file; expected {what}")
    if not os.access(p, os.R_OK):
        raise ConfigError(f"{name} {path!r}: not readable; expected {what}")
    return p


def writable_file(path: str, name: str) -> Path:
    """`path` as a Path once a file there can be written: its folder exists (created if missing) and takes
    new files, and the file itself, if present, opens for writing. Nothing is left behind but the folder."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{name} {path!r}: is a folder; expected a file to write")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p.parent):
            pass
        if p.exists():
            with open(p, "r+b"):
                pass
    except OSError as e:
        raise ConfigError(f"{name} {path!r}: cannot be written ({e.strerror or e}); "
                          "expected a file in a writable folder") from None
    return p


def model_folder(path: str) -> Path:
    """The config.json of the model folder `path` (--model-dir)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"--model-dir {path!r}: does not exist; expected a model folder holding config.json")
    return existing_file(str(folder / "config.json"), "--model-dir", "a model folder holding config.json")


def source_config(args: argparse.Namespace) -> tuple[dict, str]:
    """(config dict, its name) for --preset, --config or --model-dir."""
    from ..ir.config import load_config
    from ..ir.presets import PRESETS, preset

    if getattr(args, "preset", None):
        preset(args.preset)  # an unknown name raises, listing the presets
        return PRESETS[args.preset], args.preset
    if getattr(args, "model_dir", None):
        config = model_folder(args.model_dir)
        return load_config(config), str(config)
    existing_file(args.config, "--config", "a HuggingFace config.json")
    return load_config(args.config), str(args.config)


def source_block(args: argparse.Namespace, T_max: int | None = None) -> MoEBlock:
    """The MoEBlock named by --preset, --config, --model-dir or --tiny (no weights are read but tiny's)."""
    dtype = getattr(args, "dtype", None)
    if getattr(args, "tiny", None):
        return tiny_block(args.tiny, dtype)
    from ..ir.config import block_from_config

    cfg, name = source_config(args)
    return block_from_config(cfg, name=name, dtype=dtype, **({} if T_max is None else {"T_max": T_max}))


def tiny_model(family: str, dtype: str | None = None, name: str = "--tiny"):
    """A tiny random transformers model of `family` (moetune.testing), built offline; `name` is the flag."""
    import torch

    from ..testing import FAMILIES, build

    if family not in FAMILIES:
        raise ConfigError(f"{name} {family!r}: unknown tiny family; expected one of {', '.join(FAMILIES)}")
    return build(family, dtype=getattr(torch, dtype) if dtype else torch.float32)


def tiny_block(family: str, dtype: str | None = None) -> MoEBlock:
    """The (first) MoE block of the tiny model of `family`, as capture sees it."""
    from .. import capture
    from ..ir import CaptureError

    for c in capture(tiny_model(family, dtype)):
        if c.block is not None:
            return c.block.replace(name=f"tiny-{family}")
    raise CaptureError(f"tiny {family}: no MoE block captured")
