"""bench/proto_route_combine.py's checks run on the CPU (interpreted kernels, small shapes), so the H200
call that times the prototypes does not spend device time on a broken script; a wrong variant fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import proto_route_combine as proto  # noqa: E402


@pytest.mark.parametrize("cell", list(proto.CPU_CELLS), ids=list(proto.CPU_CELLS))
def test_prototypes_match_torch(cell):
    gen = torch.Generator().manual_seed(1)
    for v in ("package", "t"):
        assert proto.check_combine(v, proto.CPU_CELLS[cell], "cpu", gen) < 1e-2, v
    for v in ("package", "one"):
        assert proto.check_route(v, proto.CPU_CELLS[cell], "cpu", gen), v


def test_a_wrong_combine_fails_its_check(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    real = proto.combine_variant
    monkeypatch.setattr(proto, "combine_variant", lambda *a, **kw: real(*a, **kw).mul_(0.9))
    assert proto.check_combine("t", proto.CPU_CELLS["small:k8"], "cpu", gen) > 1e-2
