"""Triton routing preparation: counts and the expert-sorted order, single- and multi-program paths."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("moetune.codegen.triton")
from triton_cases import DEV  # noqa: E402

from moetune.codegen.triton import routing  # noqa: E402


@pytest.mark.parametrize("E,P", [(8, 10), (16, 600), (12, 0 + 300), (512, 2000), (128, 8192)])
def test_routing_counts_and_order(E, P):
    """Device routing = torch's stable sort by expert."""
    gen = torch.Generator().manual_seed(P)
    ids = torch.randint(-1, E + 1, (P, 1), generator=gen).to(DEV)  # sentinels -1 and E included
    counts, order = routing.route(ids, E)
    flat = ids.view(-1).cpu()
    valid = (flat >= 0) & (flat < E)
    want_counts = torch.bincount(flat[valid], minlength=E)
    assert torch.equal(counts.cpu().long(), want_counts)
    keys = torch.where(valid, flat, E)
    want = torch.sort(keys, stable=True).indices[: int(valid.sum())]
    assert torch.equal(order[: int(valid.sum())].cpu().long(), want)
