"""Test set-up: no hub access, Triton kernels run interpreted on CPU (both set before any import of
transformers or of a kernel module)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not os.environ.get("MOETUNE_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


# ---- the property matrix's example counts (tests/codegen/test_property_matrix.py) ----------------------------
# Each cell's counters live on the config; an xdist worker hands its counts to the controller with its output,
# and the session's end prints them as a table and writes them to .pytest-property-counts.json.

import json  # noqa: E402

import pytest  # noqa: E402

PROPERTY_COUNTS = pytest.StashKey[dict]()
PROPERTY_COUNTS_FILE = ".pytest-property-counts.json"


def _property_counts(config) -> dict:
    return config.stash.setdefault(PROPERTY_COUNTS, {})


@pytest.fixture(scope="session")
def property_counts(pytestconfig) -> dict:
    """cell → {counter: n}, the property matrix's reporting."""
    return _property_counts(pytestconfig)


def _merge(into: dict, counts: dict) -> None:
    for cell, counters in counts.items():
        mine = into.setdefault(cell, {})
        for name, n in counters.items():
            mine[name] = mine.get(name, 0) + n


def pytest_sessionfinish(session):
    counts = _property_counts(session.config)
    if counts and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["moetune_property_counts"] = json.dumps(counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    counts = getattr(node, "workeroutput", {}).get("moetune_property_counts")
    if counts:
        _merge(_property_counts(node.config), json.loads(counts))


def pytest_terminal_summary(terminalreporter, config):
    counts = _property_counts(config)
    if not counts or hasattr(config, "workeroutput"):
        return
    cols = ("examples", "refused", "non_finite", "non_contiguous", "empty")
    width = max(len(c) for c in counts)
    terminalreporter.section("property matrix: examples per cell")
    terminalreporter.write_line(f"{'cell':<{width}}  " + "  ".join(f"{c:>14}" for c in cols))
    for cell in sorted(counts):
        terminalreporter.write_line(f"{cell:<{width}}  " + "  ".join(f"{counts[cell].get(c, 0):>14}" for c in cols))
    total = {c: sum(v.get(c, 0) for v in counts.values()) for c in cols}
    terminalreporter.write_line(f"{'total':<{width}}  " + "  ".join(f"{total[c]:>14}" for c in cols))
    path = config.rootpath / PROPERTY_COUNTS_FILE
    path.write_text(json.dumps({"cells": counts, "total": total}, indent=1, sort_keys=True) + "\n")
    terminalreporter.write_line(f"written to {path}")
