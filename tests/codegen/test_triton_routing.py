"""Triton routing preparation: counts and the expert-sorted order, single- and multi-program paths."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("moetune.codegen.triton")
from triton_cases import DEV  # noqa: E402

from moetune.codegen.triton import routing  # noqa: E402
from moetune.codegen.triton.launch import programmatic  # noqa: E402


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


@pytest.mark.parametrize("P", [10, 2000])
def test_a_chain_holds_the_routings_scratch(P):
    """With `hold` (a chain of programmatic launches, _common's module doc) every buffer the routing's kernels
    read besides ids itself stays referenced by the caller: the flat ids and, with more than one program, the
    per-program histograms; the result is the same as without."""
    E = 128
    ids = torch.randint(0, E, (P // 2, 2), generator=torch.Generator().manual_seed(P)).to(DEV)
    hold: list = []
    counts, order = routing.route(ids, E, pdl=programmatic(True), hold=hold)  # (interpreted: plain launches)
    _, _, _, g = routing.route_plan(P, E)
    assert [t.numel() for t in hold] == ([g * 128] if g > 1 else []) + [P]
    want_counts, want_order = routing.route(ids, E)
    assert torch.equal(counts, want_counts) and torch.equal(order, want_order)
