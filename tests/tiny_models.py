"""Tests build their tiny offline transformers models through moetune.tiny."""

from moetune.tiny import D, F, FAMILIES, UNHOOKED, VOCAB, build, describe, moe_blocks, run_forward  # noqa: F401
