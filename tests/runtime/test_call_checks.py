"""What a compiled model refuses with a clear error instead of computing something else: a model moved to another
dtype or device after compile, activations in another dtype, tensors on several devices, float ids; ids outside
[0, E) select no expert, and raise under `debug=True`."""

from __future__ import annotations

import pytest
import torch

import moetune
from moetune.ir import MoetuneError
from moetune.testing import VOCAB, build, moe_blocks


def _compiled(**kw):
    model = build("qwen3_moe", dtype=torch.float32)
    moetune.compile(model, **kw)
    _, block = next(moe_blocks(model))
    return model, block.experts


def _call(experts, T=3, x_dtype=torch.float32, ids=None):
    D, k = experts.gate_up_proj.shape[-1], 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=gen).to(x_dtype)
    ids = torch.randint(0, experts.gate_up_proj.shape[0], (T, k), generator=gen) if ids is None else ids
    return experts(x, ids, torch.full((T, k), 1 / k))


def test_a_model_moved_to_another_dtype_after_compile_is_told_to_compile_again():
    model, _ = _compiled()
    model.to(torch.bfloat16)
    with pytest.raises(MoetuneError, match=r"compiled for float32 experts on cpu, called with bfloat16 .* moved after "
                                           r"moetune.compile; call moetune.compile\(model\) again"):
        model(input_ids=torch.randint(0, VOCAB, (1, 3)), use_cache=False)
    moetune.compile(model)  # compiled again: it runs
    model(input_ids=torch.randint(0, VOCAB, (1, 3)), use_cache=False)


def test_hidden_states_in_another_dtype_and_float_ids_are_refused():
    _, experts = _compiled()
    with pytest.raises(MoetuneError, match="hidden states in bfloat16, the block computes in float32"):
        _call(experts, x_dtype=torch.bfloat16)
    with pytest.raises(MoetuneError, match="top_k_index is torch.float32, expected an integer dtype"):
        _call(experts, ids=torch.zeros(3, 4))


def test_tensors_on_another_device_are_refused():
    _, experts = _compiled()
    D = experts.gate_up_proj.shape[-1]
    meta = torch.device("meta")
    with pytest.raises(MoetuneError, match="top_k_weights on meta, the experts' weights on cpu"):
        experts(torch.randn(2, D), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, device=meta))


def test_ids_outside_the_experts_select_none_and_raise_under_debug():
    _, experts = _compiled()
    E = experts.gate_up_proj.shape[0]
    bad = torch.tensor([[0, 1, 2, E], [-1, 0, 1, 2], [0, 1, 2, 3]])
    out = _call(experts, ids=bad)
    assert torch.isfinite(out).all()
    ref = _call(experts, ids=torch.tensor([[0, 1, 2, 3]] * 3))
    torch.testing.assert_close(out[2], ref[2])  # the clean token unchanged, the others lose the stray pairs
    assert not torch.allclose(out[0], ref[0])
    _, strict = _compiled(debug=True)
    with pytest.raises(MoetuneError, match=rf"2 of 12 expert ids outside \[0, {E}\)"):
        _call(strict, ids=bad)
    _call(strict, ids=torch.tensor([[0, 1, 2, 3]] * 3))
