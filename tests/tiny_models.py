"""Tests build their tiny offline transformers models through moetune.tiny."""

from moetune.tiny import FAMILIES, UNHOOKED, VOCAB, D, F, build, describe, moe_blocks, run_forward  # noqa: F401
