"""`from_pretrained(dir, experts_implementation="moetune")` runs moetune: the first experts call compiles
the model (with the table named by MOETUNE_CACHE, or the default schedules), or says once why a block
runs transformers' own experts."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from test_compile_table import ENTRIES, write_table

import moetune
from moetune.codegen.torch import tolerances
from moetune.ir import MoetuneError
from moetune.runtime import PLANS, DispatchWarning, describe, plans
from moetune.testing import VOCAB, build


def input_ids(S: int, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


def saved(tmp_path, family: str, dtype=torch.float32, **overrides) -> tuple[torch.nn.Module, str]:
    """A tiny model (transformers' default experts) and the directory it was saved to."""
    model = build(family, dtype=dtype, **overrides)
    path = tmp_path / family
    model.save_pretrained(path)
    return model, str(path)


def load(path: str, dtype=torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="moetune", dtype=dtype
    ).eval()


@pytest.fixture(autouse=True)
def _no_table(monkeypatch):
    monkeypatch.delenv("MOETUNE_CACHE", raising=False)


@pytest.mark.parametrize(
    "family,dtype",
    [("qwen3_moe", torch.float32), ("gpt_oss", torch.float32), ("deepseek_v3", torch.float32),
     ("qwen3_moe", torch.bfloat16)],
    ids=["qwen3_moe-fp32", "gpt_oss-fp32", "deepseek_v3-fp32", "qwen3_moe-bf16"],
)
def test_the_first_forward_compiles_and_matches_the_original(tmp_path, family, dtype):
    original, path = saved(tmp_path, family, dtype)
    model = load(path, dtype)
    assert model.get_experts_implementation()[""] == "moetune" and not plans(model)
    assert "compiled by its first forward" in describe(model) and "plan" not in describe(model)
    ids = input_ids(1 if dtype == torch.bfloat16 else 7)  # one token per sequence: no top-k near-tie drift
    ref = logits(original, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every block captured: nothing to say
        out = logits(model, ids)
    ps = plans(model)
    assert ps and all(p.id in PLANS for p in ps)
    text = describe(model)
    assert "compiled by its first forward" in text and "table (none: defaults)" in text
    assert all(f"{p.path}  [{p.block.signature_hash()}]  plan {p.id}" in text for p in ps)
    rtol, _ = tolerances(dtype)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= rtol
    saved_plans = {p.id: PLANS.pop(p.id) for p in ps}  # moetune's op is what runs from now on
    try:
        with pytest.raises(MoetuneError, match="not registered"):
            logits(model, ids)
    finally:
        PLANS.update(saved_plans)
    moetune.uncompile(model)  # back to transformers' own experts, which stay on
    assert model.get_experts_implementation()[""] == "grouped_mm" and not plans(model)
    assert torch.equal(logits(model, ids), ref)


def test_moetune_cache_names_the_table(tmp_path, monkeypatch):
    original, path = saved(tmp_path, "qwen3_moe")
    table = tmp_path / "cpu.sqlite"
    write_table(table, original)
    monkeypatch.setenv("MOETUNE_CACHE", str(table))
    model = load(path)
    inputs = [input_ids(S, seed=S) for S in (1, 7, 40)]  # T = 2, 14, 80: one entry each
    refs = [logits(original, ids) for ids in inputs]
    with pytest.warns(DispatchWarning) as rec:
        outs = [logits(model, ids) for ids in inputs]
    assert len(rec) == 1 and "[101," in str(rec[0].message)  # the first call only; beyond the table: default
    assert f"table {table}" in describe(model)
    d = plans(model)[0].dispatcher
    for ids, ref, out, (_, sch) in zip(inputs, refs, outs, ENTRIES, strict=True):
        route = d.route(ids.numel())
        assert route.source == "table" and route.schedule == sch
        assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_a_corrupt_moetune_cache_is_an_error_naming_it(tmp_path, monkeypatch):
    from moetune.ir import CacheError

    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"not a database" * 100)
    monkeypatch.setenv("MOETUNE_CACHE", str(bad))
    model = build("mixtral", experts_implementation="moetune")
    with pytest.raises(CacheError, match="bad.sqlite"):
        logits(model, input_ids(3))
    assert not plans(model)


def test_a_block_capture_refuses_warns_once_and_runs_transformers(tmp_path):
    original, path = saved(tmp_path, "qwen3_moe", hidden_act="gelu")
    model = load(path)
    ids = input_ids(5)
    with pytest.warns(UserWarning, match=r"2 MoE block\(s\) of Qwen3MoeForCausalLM run transformers' "
                      r"grouped_mm.*hidden_act='gelu'") as rec:
        out = logits(model, ids)
    assert len([r for r in rec if "grouped_mm" in str(r.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        again = logits(model, input_ids(3))
    assert not plans(model) and "left as is" in describe(model)
    assert torch.equal(out, logits(original, ids))
    assert torch.equal(again, logits(original, input_ids(3)))


def test_experts_called_outside_a_model_warn_once_and_run_transformers():
    model = build("qwen3_moe", experts_implementation="moetune")
    experts = model.model.layers[0].mlp.experts
    want = build("qwen3_moe").model.layers[0].mlp.experts
    x, ids, w = torch.randn(4, 64), torch.stack([torch.randperm(16)[:4] for _ in range(4)]), torch.rand(4, 4)
    with torch.inference_mode():
        with pytest.warns(UserWarning, match="called outside a transformers model's forward"):
            got = experts(x, ids, w)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            experts(x, ids, w)
        assert torch.equal(got, want(x, ids, w))
    assert not plans(model)


def test_a_model_traced_before_its_first_forward_runs_transformers():
    """Under a tracer there is no call stack to find the model on: the trace keeps transformers'
    experts, and the first eager call afterwards compiles."""
    model = build("mixtral", experts_implementation="moetune")
    ids = input_ids(4, B=1)
    ep = torch.export.export(model, (), {"input_ids": ids, "use_cache": False})
    assert not plans(model)
    assert not [n for n in ep.graph.nodes if "moetune" in str(n.target)]
    logits(model, ids)
    assert plans(model)


def test_the_first_forward_returns_its_own_router_logits_only():
    """Compiling inside the first forward runs the routers on the check's inputs; the forward's
    output_router_logits holds its own router calls, the same as transformers' experts give."""
    original = build("qwen3_moe")
    model = build("qwen3_moe", experts_implementation="moetune")
    ids = input_ids(5)
    with torch.inference_mode():
        want = original(input_ids=ids, output_router_logits=True).router_logits
        got = model(input_ids=ids, output_router_logits=True).router_logits
    assert plans(model) and len(got) == len(want) == 2
    assert torch.equal(got[0], want[0])  # before any experts ran
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_a_fresh_process_imports_moetune_first_and_runs_it(tmp_path):
    """The user's path from a fresh interpreter: `import moetune` (transformers not loaded yet), then
    from_pretrained with "moetune" and a forward: the model ran moetune's plans."""
    import os
    import subprocess
    import sys

    _, path = saved(tmp_path, "mixtral")
    code = (
        "import sys, torch, moetune\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers import AutoModelForCausalLM\n"
        "from moetune.runtime import describe, plans\n"
        f"model = AutoModelForCausalLM.from_pretrained({path!r}, experts_implementation='moetune')\n"
        "with torch.inference_mode():\n"
        "    model(input_ids=torch.tensor([[1, 2, 3]]))\n"
        "assert len(plans(model)) == 2, describe(model)\n"
        "print(describe(model).splitlines()[0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MOETUNE_CACHE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    want = "MixtralForCausalLM: backend torch, table (none: defaults), compiled by its first forward"
    assert out.stdout.strip() == want
