"""Capture of the tiny transformers MoE models: what is found, what is refused, and why."""

import dataclasses

import pytest
import torch

from moetune import testing as tm
from moetune.codegen.tensors import ExpertTensors
from moetune.codegen.torch.reference import experts_reference
from moetune.ir import Activation, CaptureError, Router, SharedExperts, WeightLayout
from moetune.ir.capture import ROUTERS, capture, check_router, qualname, router_tensors, router_weights_and_ids
from moetune.ir.routing import route, router_logits, selection_scores

DTYPES = ["float32", "bfloat16"]
SOFT = Router("softmax_topk", compute_dtype="model")
GATED48 = SharedExperts(48, gated=True)

# family → (MoE layers, E, k, router spec, shared experts, routing weights in fp32?, activation, layout)
EXPECTED = {
    "mixtral": (2, 8, 2, dataclasses.replace(SOFT, renormalize=True, weights_dtype="float32"), None, True),
    "qwen2_moe": (2, 8, 2, SOFT, GATED48, False),
    "qwen3_moe": (2, 16, 4, dataclasses.replace(SOFT, renormalize=True), None, False),
    "qwen3_next": (2, 16, 4, dataclasses.replace(SOFT, renormalize=True), GATED48, False),
    "qwen3_5_moe": (2, 16, 4, dataclasses.replace(SOFT, renormalize=True), GATED48, False),
    "deepseek_v3": (1, 16, 4, Router("sigmoid_grouped_topk", renormalize=True, score_bias=True, n_group=4,
                                     topk_group=2, scaling=2.5, compute_dtype="float32",
                                     weights_dtype="float32"), SharedExperts(tm.F, gated=False), True),
    "olmoe": (2, 8, 2, SOFT, None, False),
    "gpt_oss": (2, 8, 2, Router("topk_softmax", logit_bias=True, compute_dtype="model"), None, False),
    "granitemoe": (2, 8, 2, Router("topk_softmax", compute_dtype="model"), None, False),
    "granitemoeshared": (2, 8, 2, Router("topk_softmax", compute_dtype="model"),
                         SharedExperts(48, gated=False, inside_block=False), False),
}
CLAMPED = Activation("clamped_swiglu", alpha=1.702, limit=7.0)
GPT_OSS_LAYOUT = WeightLayout(transposed=True, interleaved=True, has_bias=True)


@pytest.mark.parametrize("dtype", [*DTYPES, "float16"])
@pytest.mark.parametrize("family", list(EXPECTED))
def test_capture_family(tiny, family, dtype):
    n_layers, E, k, router, shared, rw_fp32 = EXPECTED[family]
    model = tiny(family, dtype)
    found = capture(model)
    assert len(found) == n_layers
    for c in found:
        assert c.ok, c.reason
        assert c.reason is None and c.path == c.block.name
        assert dict(model.named_modules())[c.path].experts is c.experts
        b = c.block
        assert (b.E, b.k, b.D, b.F) == (E, k, tm.D, tm.F)
        assert b.router == router
        assert b.shared == shared
        assert b.weight_dtype == dtype
        assert b.routing_weight_dtype == ("float32" if rw_fp32 else dtype)
        assert b.weight_application == "output"
        assert b.activation == (CLAMPED if family == "gpt_oss" else Activation("swiglu"))
        assert b.layout == (GPT_OSS_LAYOUT if family == "gpt_oss" else WeightLayout())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family, words", [("llama4", "Llama4"), ("dbrx", "DBRX")])
def test_unhooked_families_left_as_is(family, words, dtype):
    model = tm.build(family, dtype=getattr(torch, dtype))
    ids = torch.randint(0, tm.VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        found = capture(model)
        after = model(input_ids=ids).logits
    assert found and all(not c.ok for c in found)
    for c in found:
        assert words in c.reason and "no experts hook" in c.reason and c.path in c.reason
    assert torch.equal(before, after)


def _fresh(family="qwen3_moe"):
    model = tm.build(family)
    return model, model.model.layers[0].mlp


def _gelu_gate(self, gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(g) * u


def _set_param(name, shape):
    return lambda blk: setattr(blk.experts, name, torch.nn.Parameter(torch.zeros(shape)))


def _swap_router(blk):
    blk.gate.__class__ = type("OddRouter", (type(blk.gate),), {})


def _override_gate(blk):
    blk.experts.__class__ = type("OddExperts", (type(blk.experts),), {"_apply_gate": _gelu_gate})


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda blk: setattr(blk.experts, "_is_expert_parallel", True), ["expert-parallel"]),
        (lambda blk: setattr(blk.experts, "has_post_expert_norm", True), ["has_post_expert_norm"]),
        (lambda blk: setattr(blk.experts, "has_gate", False), ["has_gate=False"]),
        (_swap_router, ["unknown router class", "OddRouter"]),
        (_override_gate, ["OddExperts", "_apply_gate"]),
        (lambda blk: setattr(blk.experts.config, "hidden_act", "gelu"), ["hidden_act='gelu'"]),
        (_set_param("gate_up_proj", (16, 82, 64)), ["experts.gate_up_proj", "[16, 82, 64]", "[16, 80, 64]"]),
        (_set_param("down_proj", (16, 65, 40)), ["experts.down_proj", "[16, 65, 40]", "[16, 64, 40]"]),
        (_set_param("gate_up_proj", (16, 80)), ["gate_up_proj", "3 dims"]),
        (lambda blk: blk.experts.to(torch.float64), ["float64"]),
        (lambda blk: delattr(blk, "gate"), ["no router"]),
    ],
)
def test_refused_with_reason(change, words):
    model, blk = _fresh()
    change(blk)
    found = capture(model)
    assert not found[0].ok and found[0].block is None
    for w in words:
        assert w in found[0].reason, found[0].reason
    assert found[0].reason.startswith("model.layers.0.mlp")


# Planted mis-captures: a router table entry changed; the router check must refuse the block.
# Each plant maps (router module, the original table entry) to a wrong Router spec.
PLANTS = [
    ("qwen3_moe", lambda m, orig: dataclasses.replace(orig(m), renormalize=False), "weights differ"),
    ("qwen2_moe", lambda m, orig: dataclasses.replace(orig(m), renormalize=True), "weights differ"),
    ("deepseek_v3", lambda m, orig: dataclasses.replace(orig(m), n_group=1, topk_group=1), "picks"),
    ("deepseek_v3", lambda m, orig: dataclasses.replace(orig(m), scaling=1.0), "weights differ"),
    ("deepseek_v3", lambda m, orig: Router("softmax_topk", renormalize=True, weights_dtype="float32"),
     "picks"),
    ("granitemoe", lambda m, orig: Router("softmax_topk", compute_dtype="model"), "weights differ"),
    ("mixtral", lambda m, orig: Router("softmax_topk", renormalize=True, compute_dtype="model"),
     "routing_weight_dtype"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family, plant, words", PLANTS)
def test_planted_miscapture_is_caught(monkeypatch, tiny, family, plant, words, dtype):
    if words == "routing_weight_dtype" and dtype == "float32":
        pytest.skip("float32 model: 'model' and float32 routing weights are the same dtype")
    model = tiny(family, dtype)
    router_cls = qualname(capture(model, check=False)[0].router)
    original = ROUTERS[router_cls]
    monkeypatch.setitem(ROUTERS, router_cls, lambda m: plant(m, original))
    unchecked = capture(model, check=False)
    assert unchecked and all(c.ok for c in unchecked)  # the mis-capture looks fine without the check
    found = capture(model)
    assert all(not c.ok for c in found)
    for c in found:
        assert "router" in c.reason and words in c.reason, c.reason


def test_planted_logit_bias_drop_caught_in_fp32(monkeypatch):
    model = tm.build("gpt_oss")
    router_cls = qualname(model.model.layers[0].mlp.router)
    monkeypatch.setitem(ROUTERS, router_cls, lambda m: Router("topk_softmax", compute_dtype="model"))
    found = capture(model)
    assert all(not c.ok and "router check failed" in c.reason for c in found)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(EXPECTED))
def test_reference_router_on_real_hidden_states(tiny, family, dtype):
    """Route the hidden states the model's own forward hands its routers; compare with the router."""
    model = tiny(family, dtype)
    found = capture(model)
    seen = {}
    hooks = [c.router.register_forward_hook(lambda mod, a, out, p=c.path: seen.__setitem__(p, (a[0], out)))
             for c in found]
    ids = torch.randint(0, tm.VOCAB, (3, 11), generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    for c in found:
        x, out = seen[c.path]
        their_w, their_ids = router_weights_and_ids(out)  # [T, k], [T, k]
        x = x.reshape(-1, c.block.D)  # [T, D]
        spec = c.block.router
        weight, bias, score_bias = router_tensors(c.router, spec)
        logits = router_logits(spec, x, weight, bias)  # [T, E]
        my_ids, my_w = route(spec, logits, score_bias, c.block.k)  # [T, k]
        scores = selection_scores(spec, logits, score_bias)  # [T, E]
        mine, theirs = my_ids.sort(-1), their_ids.sort(-1)
        same = (mine.values == theirs.values).all(-1)  # [T]
        # a differing pick is only allowed where the selection scores tie exactly
        tied = (scores.gather(1, mine.values).sort(-1).values
                == scores.gather(1, theirs.values).sort(-1).values)  # [T, k]
        assert bool(tied.all(-1)[~same].all()), f"{c.path}: index sets differ without a tie"
        assert same.float().mean() > 0.9
        tol = dict(rtol=1e-5, atol=1e-7) if dtype == "float32" else dict(rtol=8e-3, atol=1e-6)
        torch.testing.assert_close(my_w.gather(1, mine.indices)[same],
                                   their_w.float().gather(1, theirs.indices)[same], **tol)
        assert str(their_w.dtype).endswith(c.block.routing_weight_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(EXPECTED))
def test_captured_ir_reproduces_the_experts_module(tiny, family, dtype):
    """The captured layout and activation, fed to the float32 reference, match the module's own eager loop."""
    model = tiny(family, dtype)
    for c in capture(model):
        T, k = 9, c.block.k
        g = torch.Generator().manual_seed(5)
        x = torch.randn(T, c.block.D, generator=g).to(getattr(torch, dtype))  # [T, D]
        ids = torch.stack([torch.randperm(c.block.E, generator=g)[:k] for _ in range(T)])  # [T, k]
        w = torch.rand(T, k, generator=g).to(getattr(torch, c.block.routing_weight_dtype))  # [T, k]
        with torch.no_grad():
            eager = type(c.experts).forward.__wrapped__(c.experts, x, ids, w)  # [T, D]
            ref = experts_reference(c.block, x, ids, w, ExpertTensors.of(c.experts))  # [T, D] fp32
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(eager.float(), ref, **tol)


def test_check_router_detects_changed_weights_after_capture():
    model, blk = _fresh("olmoe")
    c = capture(model)[0]
    with torch.no_grad():
        blk.gate.weight.mul_(-1)  # the module now routes differently from what a stale spec would say
    check_router(c.block, c.router, c.experts)  # the spec reads the weights live: still consistent
    wrong = dataclasses.replace(c.block, router=dataclasses.replace(c.block.router, renormalize=True))
    with pytest.raises(CaptureError, match="router check failed"):
        check_router(wrong, c.router, c.experts)


def test_capture_of_model_without_moe_is_empty():
    assert capture(torch.nn.Sequential(torch.nn.Linear(4, 4))) == []


def test_capture_changes_nothing(tiny):
    model = tiny("deepseek_v3", "float32")
    ids = torch.randint(0, tm.VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(input_ids=ids).logits
        rng = torch.get_rng_state()
        assert capture(model)[0].ok
        assert torch.equal(rng, torch.get_rng_state())  # the check draws from its own generator
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_capture_on_meta_device_skips_the_check():
    with torch.device("meta"):
        model = tm.build("qwen3_moe")
    found = capture(model)
    assert [c.ok for c in found] == [True, True] and found[0].block.E == 16


def test_capture_vlm_language_model():
    import transformers

    text_cfg = tm.config("qwen3_5_moe")
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=tm.D,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text_cfg.to_dict(), vision_config=vision)
    model = transformers.Qwen3_5MoeForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    found = capture(model)
    assert [c.path for c in found] == [f"model.language_model.layers.{i}.mlp" for i in (0, 1)]
    assert all(c.ok and c.block.E == 16 and c.block.weight_dtype == "bfloat16" for c in found)
    from moetune.ir.config import block_from_config

    assert block_from_config(model.config.to_dict(), name=found[0].path, dtype="bfloat16") == found[0].block


def test_router_that_fails_is_reported():
    model, blk = _fresh()

    def broken(self, x):
        raise RuntimeError("boom")

    blk.gate.forward = broken.__get__(blk.gate)  # same class, so the table entry still applies
    found = capture(model)
    assert not found[0].ok and "router check could not run" in found[0].reason and "boom" in found[0].reason
    assert capture(model, check=False)[0].ok


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_shared_expert_of_size_zero_is_none():
    model = tm.build("qwen2_moe", shared_expert_intermediate_size=0)
    found = capture(model)
    assert all(c.ok and c.block.shared is None for c in found)
