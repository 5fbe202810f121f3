"""Compiling copies no expert weight: the kernels are handed the experts modules' own parameters."""

import dataclasses

import pytest
import torch

import moetune
from moetune.runtime import compiled
from moetune.testing import VOCAB, build


class _Recorder:
    """Wraps a plan's dispatcher; records the storage of every weight tensor it is handed."""

    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    def __call__(self, x, ids, weights, w):
        for t in (w.gate_up, w.down, w.gate_up_bias, w.down_bias):
            if t is not None:
                self.seen.add(t.untyped_storage().data_ptr())
        return self.inner(x, ids, weights, w)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_kernels_read_the_models_own_parameters(family):
    model = build(family)
    before = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    n_tensors = len(list(model.parameters())) + len(list(model.buffers()))
    moetune.compile(model)
    state = model._moetune_state
    assert state.plan_ids
    assert {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()} == before
    assert len(list(model.parameters())) + len(list(model.buffers())) == n_tensors  # nothing registered
    for pid in state.plan_ids:  # a plan holds numbers and built kernels, never a tensor
        plan = compiled.PLANS[pid]
        assert not any(isinstance(getattr(plan, f.name), torch.Tensor) for f in dataclasses.fields(plan))
    seen: set[int] = set()
    saved = {pid: compiled.PLANS[pid] for pid in state.plan_ids}
    try:
        for pid, plan in saved.items():
            compiled.PLANS[pid] = dataclasses.replace(plan, dispatcher=_Recorder(plan.dispatcher, seen))
        with torch.inference_mode():
            model(input_ids=torch.randint(0, VOCAB, (2, 5)))
    finally:
        compiled.PLANS.update(saved)
        moetune.uncompile(model)
    experts = {before[n] for n in before if ".experts." in n}
    assert seen and seen <= experts, "a kernel was handed a tensor that is not an experts parameter"
