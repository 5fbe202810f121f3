"""The former name of `moetune.testing`, kept only while demo.py, passes/trace.py and search/cli.py
still import it; it goes when they import `moetune.testing`."""

from .testing import FAMILIES, UNHOOKED, VOCAB, D, F, build, describe, moe_blocks, run_forward  # noqa: F401
