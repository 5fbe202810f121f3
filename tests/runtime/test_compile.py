"""moetune.compile / uncompile on every tiny transformers family, export, compile, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch

import moetune
from moetune.codegen.tensors import ExpertTensors
from moetune.codegen.torch import experts_reference, tolerances
from moetune.ir import MoetuneError
from moetune.runtime import PLANS, plans
from moetune.testing import FAMILIES, UNHOOKED, VOCAB, build

HOOKED = [f for f in FAMILIES if f not in UNHOOKED]


def input_ids(S: int, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def routed_logits(model, ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and, per experts call, the sorted top-k ids [T, k] it was given."""
    seen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: seen.append(args[1].sort(-1).values))
        for m in model.modules()
        if hasattr(m, "has_gate") and hasattr(m, "is_transposed")
    ]
    try:
        return logits(model, ids), seen
    finally:
        for h in hooks:
            h.remove()


def same_routing_positions(ids, routes_a, routes_b) -> torch.Tensor:
    """[B, S] bool: positions before the first top-k difference of their sequence in any layer.

    In bf16 a near-tie in a router's top-k can flip on a last-bit difference of its input; causal
    attention then carries the flip to the later positions of that sequence only."""
    B, S = ids.shape
    first = torch.full((B,), S)
    for a, b in zip(routes_a, routes_b, strict=True):
        diff = (a != b).any(-1).view(B, S)  # [B, S]
        pos = torch.where(diff, torch.arange(S).expand(B, S), torch.full((B, S), S))
        first = torch.minimum(first, pos.min(-1).values)
    return torch.arange(S).expand(B, S) < first.unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", HOOKED)
def test_compiled_logits_match_and_uncompile_restores(family, dtype):
    """Batch 2 × S = 1, 7, 40 tokens: T = 2, 14, 80 (one-row, mixed and many-rows buckets; the
    kinds the default picks there on CPU, every kind through a table: test_compile_table.py).

    fp32: every logit within 1e-5 of the largest. bf16: every position whose routing matched in
    every layer within the dtype tolerance; at most half of the positions lost to top-k flips."""
    model = build(family, dtype=dtype)
    inputs = [input_ids(S) for S in (1, 7, 40)]
    refs = [routed_logits(model, ids) for ids in inputs]
    before = model.get_experts_implementation()
    assert moetune.compile(model) is model
    ps = plans(model)
    assert ps and all(p.id in PLANS for p in ps)
    assert model.get_experts_implementation()[""] == "moetune"
    for ids, (ref, ref_routes) in zip(inputs, refs, strict=True):
        out, routes = routed_logits(model, ids)
        if dtype == torch.float32:
            assert rel_err(out, ref) <= 1e-5, (family, ids.shape, rel_err(out, ref))
            continue
        keep = same_routing_positions(ids, ref_routes, routes)  # [B, S]
        assert keep.float().mean() >= 0.5, (family, ids.shape, keep)
        err = (out - ref).abs().amax(-1)[keep].max() / ref.abs().max()
        assert err <= tolerances(dtype)[0], (family, ids.shape, err)
    moetune.uncompile(model)
    assert model.get_experts_implementation() == before
    assert not plans(model) and all(p.id not in PLANS for p in ps)
    assert torch.equal(logits(model, inputs[1]), refs[1][0])


@pytest.mark.parametrize("family", sorted(UNHOOKED))
def test_unhooked_families_run_unchanged(family):
    model = build(family)
    ids = input_ids(5)
    ref = logits(model, ids)
    before = model.get_experts_implementation()
    moetune.compile(model)
    assert not plans(model)
    assert model.get_experts_implementation() == before
    reasons = [c.reason for c in model._moetune_state.captured]
    assert reasons and all(reasons), reasons
    assert torch.equal(logits(model, ids), ref)
    moetune.uncompile(model)
    assert torch.equal(logits(model, ids), ref)


def test_the_custom_op_is_what_runs():
    """With the plans gone from the registry, a compiled model's forward fails in moetune::experts."""
    model = moetune.compile(build("qwen3_moe"))
    saved = {p.id: PLANS.pop(p.id) for p in plans(model)}
    try:
        with pytest.raises(MoetuneError, match="not registered"):
            logits(model, input_ids(3))
    finally:
        PLANS.update(saved)
    moetune.uncompile(model)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_untraced_inference_skips_the_op_dispatch(mode):
    """Eager inference runs the op's body without the op (no moetune::experts event in a profile),
    bit-identical to the op; with gradients on, the op runs (its autograd says why backward fails)."""
    model, ex, x, ids, w = _compiled_call(5)
    ctx = torch.enable_grad() if mode == "grad" else getattr(torch, mode)()
    with ctx:
        via_op = torch.ops.moetune.experts(x, ids, w, ex.gate_up_proj, ex.down_proj, None, None,
                                           ex._moetune_plan.id)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = ex(x, ids, w)
    ran_op = any("moetune::experts" in e.name for e in prof.events())
    assert ran_op == (mode == "grad")
    torch.testing.assert_close(got, via_op, rtol=0, atol=0)
    moetune.uncompile(model)


def test_vmap_takes_the_op():
    """Under vmap (a functorch transform: its batched tensors look like plain ones) the hook calls the
    op, whose batching fallback runs the plan once per sample."""
    model, ex, _, ids, w = _compiled_call(3)
    xs = torch.randn(2, 3, ex._moetune_plan.block.D)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.vmap(lambda x: ex(x, ids, w))(xs)
        want = torch.stack([ex(x, ids, w) for x in xs])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    moetune.uncompile(model)


def test_a_probe_this_torch_lacks_keeps_the_op():
    """The private torch probes are looked up once; one this torch does not have says "maybe traced"."""
    from moetune.runtime import compiled

    assert compiled._torch_c("_no_such_probe")() is True
    assert compiled._torch_c("_len_torch_dispatch_stack") is torch._C._len_torch_dispatch_stack


def test_fake_tensors_take_the_op():
    """Under FakeTensorMode (what export and compile trace with) the hook runs the op's fake kernel:
    with the plans gone from the registry the real body would raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = moetune.compile(build("qwen3_moe"))
    ex = _experts(model)
    block = ex._moetune_plan.block
    saved = {p.id: PLANS.pop(p.id) for p in plans(model)}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            x = mode.from_tensor(torch.randn(4, block.D))
            ids = mode.from_tensor(torch.zeros(4, block.k, dtype=torch.long))
            out = ex(x, ids, mode.from_tensor(torch.rand(4, block.k)))
        assert out.shape == (4, block.D)
    finally:
        PLANS.update(saved)
    moetune.uncompile(model)


def test_compile_twice_replaces_plans():
    model = build("mixtral")
    moetune.compile(model)
    first = [p.id for p in plans(model)]
    moetune.compile(model)
    assert not set(first) & {p.id for p in plans(model)}
    assert not set(first) & set(PLANS)
    moetune.uncompile(model)
    assert model.get_experts_implementation()[""] == "grouped_mm"


# ------------------------------------------------------------------- bad input at the experts --


def _experts(model):
    return next(m for m in model.modules() if getattr(m, "_moetune_plan", None) is not None)


def _compiled_call(T: int):
    """A compiled qwen3_moe, its first hooked experts module and a call's x [T, D], ids [T, k], weights."""
    model = moetune.compile(build("qwen3_moe"))
    ex = _experts(model)
    block = ex._moetune_plan.block
    ids = torch.stack([torch.randperm(block.E)[: block.k] for _ in range(T)])
    return model, ex, torch.randn(T, block.D), ids, torch.rand(T, block.k)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_zero_tokens_and_noncontiguous_hidden_states(family):
    model = moetune.compile(build(family))
    ex = _experts(model)
    block = ex._moetune_plan.block
    D, k = block.D, block.k
    with torch.inference_mode():
        out = ex(torch.zeros(0, D), torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k))
        assert out.shape == (0, D) and out.dtype == torch.float32
        x = torch.randn(D, 11).t()  # [11, D], not contiguous
        assert not x.is_contiguous()
        ids = torch.stack([torch.randperm(block.E)[:k] for _ in range(11)])
        w = torch.rand(11, k)
        got = ex(x, ids, w)
        torch.testing.assert_close(got, ex(x.contiguous(), ids, w), rtol=0, atol=0)
        torch.testing.assert_close(
            got, experts_reference(block, x, ids, w, ExpertTensors.of(ex)), rtol=1e-5, atol=1e-5
        )


def test_sentinel_ids_contribute_nothing():
    """Expert-parallel style ids ≥ E (and negative ones) are dropped, as in transformers' grouped_mm."""
    model, ex, x, ids, w = _compiled_call(6)
    block = ex._moetune_plan.block
    bad = ids.clone()
    bad[:, 0] = block.E + 3
    bad[2, 1] = -1
    keep = w.clone()
    keep[:, 0] = 0
    keep[2, 1] = 0
    with torch.inference_mode():
        torch.testing.assert_close(ex(x, bad, w), ex(x, ids, keep), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- export / compile --


def test_whole_model_export_needs_use_cache_false():
    """The README's export: `use_cache=False` (transformers' DynamicCache in the output is no pytree
    node, so the export fails without it) and a dynamic sequence length from 2 (size 1 specialises);
    the program has one opaque moetune::experts node per MoE layer and matches the original model at
    another length."""
    original = build("qwen3_moe")
    model = moetune.compile(build("qwen3_moe"))
    ids = input_ids(9, B=1)
    with pytest.raises(Exception, match="DynamicCache"):
        torch.export.export(model, (), {"input_ids": ids})
    S = torch.export.Dim("S", min=2, max=64)
    ep = torch.export.export(
        model, (), {"input_ids": ids, "use_cache": False}, dynamic_shapes={"input_ids": {1: S}, "use_cache": None}
    )
    ops = [n for n in ep.graph.nodes if n.op == "call_function" and "moetune.experts" in str(n.target)]
    assert len(ops) == 2
    other = input_ids(5, B=1, seed=7)
    with torch.inference_mode():
        got = ep.module()(input_ids=other, use_cache=False).logits.float()
    assert rel_err(got, logits(original, other)) <= 1e-5


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph_matches_the_original_model(backend):
    """torch.compile(fullgraph, dynamic) of a compiled one-layer Mixtral against the same weights run
    by transformers' experts, at two sequence lengths (one graph); with the plan gone from the registry
    the compiled forward fails in moetune::experts, so the op is what ran. Inductor builds C++ kernels
    for the rest of the model: tens of seconds on a small CPU."""
    original = build("mixtral", num_hidden_layers=1)
    model = moetune.compile(build("mixtral", num_hidden_layers=1))
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    for S in (6, 3):
        ids = input_ids(S)
        with torch.inference_mode():
            got = compiled(input_ids=ids, use_cache=False).logits.float()
        assert rel_err(got, logits(original, ids)) <= 1e-5, (backend, S)
    saved = {p.id: PLANS.pop(p.id) for p in plans(model)}
    try:
        with pytest.raises(MoetuneError, match="not registered"), torch.inference_mode():
            compiled(input_ids=input_ids(4), use_cache=False)
    finally:
        PLANS.update(saved)
    moetune.uncompile(model)


def test_import_moetune_is_light_and_registers_when_transformers_loads():
    """`import moetune` pulls in neither torch nor transformers, yet the name is registered before any
    model can be built: at once if transformers' MoE integration is loaded, else when it loads."""
    import subprocess
    import sys

    code = (
        "import sys, moetune\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS\n"
        "assert 'moetune' in ALL_EXPERTS_FUNCTIONS\n"
        "import importlib; importlib.reload(sys.modules['moetune'])\n"
        "assert 'moetune' in ALL_EXPERTS_FUNCTIONS\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_forward_with_grad_works_and_backward_says_why_not():
    model = moetune.compile(build("qwen3_moe"))
    out = model(input_ids=input_ids(4)).logits  # grad mode, cache on: the forward runs
    with pytest.raises(MoetuneError, match="for inference.*uncompile"):
        out.sum().backward()
    moetune.uncompile(model)


def test_vlm_language_model_compiles_and_restores():
    """Qwen3.5-MoE as a VLM: the experts sit under model.language_model and the implementation is
    set per sub-config; uncompile restores every sub-config."""
    import transformers

    from moetune import testing as tm

    text_cfg = tm.config("qwen3_5_moe")
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=tm.D,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
    )
    cfg = transformers.Qwen3_5MoeConfig(text_config=text_cfg.to_dict(), vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForConditionalGeneration._from_config(cfg, dtype=torch.float32).eval()
    ids = input_ids(6)
    ref = logits(model, ids)
    before = model.get_experts_implementation()
    moetune.compile(model)
    ps = plans(model)
    assert [p.path for p in ps] == [f"model.language_model.layers.{i}.mlp" for i in (0, 1)]
    assert model.get_experts_implementation()["text_config"] == "moetune"
    assert rel_err(logits(model, ids), ref) <= 1e-5
    saved = {p.id: PLANS.pop(p.id) for p in ps}  # the op is what runs
    with pytest.raises(MoetuneError, match="not registered"):
        logits(model, ids)
    PLANS.update(saved)
    moetune.uncompile(model)
    assert model.get_experts_implementation() == before
    assert torch.equal(logits(model, ids), ref)


def test_generate_decodes_the_same_tokens():
    """Prefill T = 15, then decode steps of T = 3 (one row per request) with the KV cache."""
    model = build("qwen3_moe")
    ids = input_ids(5, B=3)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, **kw)
    moetune.compile(model)
    assert torch.equal(model.generate(input_ids=ids, **kw), ref)
    moetune.uncompile(model)


def test_describe_lists_buckets_and_left_blocks():
    from moetune.runtime import describe

    model = build("qwen3_moe")
    assert "not compiled" in describe(model)
    moetune.compile(model)
    text = describe(model)
    assert "model.layers.0.mlp" in text and "model.layers.1.mlp" in text and "T∈[1,1]" in text
    assert "torch:grouped_gemm" in text and "table (none: defaults)" in text
    moetune.uncompile(model)
    llama = moetune.compile(build("llama4"))
    assert "left as is" in describe(llama)
