"""The decode suite's generate mode on the CPU: a tiny real model through transformers' `generate` with a static
cache, each variant timed, profiled and its greedy tokens checked against the baseline's; the token check itself
on identical and perturbed models; the depth that fits a memory budget; the README's table from the JSON."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench import decode, models, profiling
from moetune.testing import build


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    decode.add_arguments(ap)
    return ap.parse_args(list(argv))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode")
    args = parse("--family", "qwen3_moe", "--prompt", "8", "--new", "4", "--batch", "1,2", "--compile", "none",
                 "--warmup", "1", "--profile-steps", "2", "--out", str(out))
    res = decode.generation(args)
    return res, out / "decode.json"


def test_generate_mode_writes_every_variant_and_batch(results):
    res, path = results
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))
    assert res["mode"] == "generate" and res["layers"] == res["layers_of"] == 2 and res["moe_layers"] == 2
    assert res["compile"] == "none" and res["device"] == "cpu" and res["moetune_plans"] == 2
    rows = [r for r in res["rows"] if "error" not in r]
    assert len(rows) == len(res["rows"])
    # on the CPU generate keeps grouped_mm at decode: "grouped_mm" is the default's own, measured once
    # and the same model with its experts returning zeros: each variant's MoE time is its step less that one
    assert sorted({r["variant"] for r in rows}) == ["moetune", "no-experts", "transformers:grouped_mm"]
    bare = {r["batch"]: r for r in rows if r["variant"] == "no-experts"}
    for r in rows:
        assert r["batch"] in (1, 2) and r["decode_steps"] == 3  # new − 1 intervals between 4 tokens' logits
        assert r["step_ms_min"] <= r["ms_per_step"] <= r["step_ms_max"] and r["prefill_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["ms_per_step"] * 1e3)
        if r["variant"] == "no-experts":
            assert "moe_us_per_step" not in r and "moe_us_ablation" not in r
            continue
        assert r["moe_us_per_step"] > 0 and 0 < r["moe_share_kernels"] < 1
        assert r["profiled_scopes"] == 2 * 2  # every experts call of the 2 profiled steps, 2 MoE layers each
        assert r["moe_us_ablation"] == pytest.approx((r["ms_per_step"] - bare[r["batch"]]["ms_per_step"]) * 1e3)
        assert r["moe_share"] == pytest.approx(r["moe_us_ablation"] / (r["ms_per_step"] * 1e3))
    for r in rows:
        if r["variant"] == "moetune":
            hf = next(h for h in rows if h["batch"] == r["batch"] and h.get("best_transformers"))
            assert r["baseline"] == hf["variant"]
            assert r["speedup"] == pytest.approx(hf["ms_per_step"] / r["ms_per_step"])
    assert [(c["batch"], c["tokens"]) for c in res["comparison"]] == [(1, 4), (2, 8)]
    assert all(c["ref"] == "transformers:grouped_mm" and "identical" in c for c in res["comparison"])


def test_the_readme_table_has_a_row_per_batch(results):
    res, path = results
    lines = decode.readme_table([path]).splitlines()
    assert lines[0].startswith("| model |") and len(lines) == 2 + len(res["batches"])
    mine = {r["batch"]: r for r in res["rows"] if r["variant"] == "moetune"}
    for line, b in zip(lines[2:], res["batches"], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:3] == ["qwen3_moe", "2 of 2", "bf16"] and cells[3] == res["device"].removeprefix("NVIDIA ")
        assert cells[4] == str(b)
        assert cells[5].endswith("(grouped_mm)") and cells[7] == f"{mine[b]['speedup']:.2f}×"


def run(model, ids, keep_logits=True):
    return models.generate_once(model, ids, models.generation_config(5, "none", False, keep_logits=keep_logits))


def test_the_token_check_finds_identical_runs_and_a_perturbed_model():
    model = build("qwen3_moe", dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (3, 8), generator=torch.Generator().manual_seed(0))
    ref = run(model, ids)
    same = decode.first_divergence(ref, run(model, ids))
    assert same == dict(tokens=15, identical=True)
    # the reference's first token of sequence 0 is t; token u's head row becomes 3× t's, so u wins there
    la = ref["logits"][0, 0]  # [V]
    t = int(ref["sequences"][0, 0])
    u = (t + 1) % model.config.vocab_size
    assert int(la.argmax()) == t and la[t] > 0
    with torch.no_grad():
        model.lm_head.weight[u] = 3 * model.lm_head.weight[t]
    other = run(model, ids)
    d = decode.first_divergence(ref, other)
    assert not d["identical"] and (d["step"], d["row"], d["ref_token"], d["token"]) == (0, 0, t, u)
    assert d["max_abs_dlogit"] == pytest.approx(float(other["logits"][0, 0, u] - la[u]))
    assert d["max_abs_dlogit"] == pytest.approx(3 * float(la[t]) - float(la[u]), rel=0.05)
    top = la.topk(2).values
    assert d["ref_top2_margin"] == pytest.approx(float(top[0] - top[1]))
    assert 1 <= d["sequences_differing"] <= 3


def test_the_first_divergence_is_the_earliest_step_over_all_sequences():
    a = torch.arange(12).view(3, 4)
    b = a.clone()
    b[0, 3] = -1
    b[2, 1] = -1  # sequence 2 leaves first, at step 1
    b[2, 2] = -2
    d = decode.first_divergence(dict(sequences=a), dict(sequences=b))
    assert (d["step"], d["row"], d["sequences_differing"], d["tokens"]) == (1, 2, 2, 12)
    assert "max_abs_dlogit" not in d  # no logits kept: the gap is not claimed


def test_fit_layers_keeps_to_the_budget():
    full = models.fit_layers("qwen3-30b-a3b", None, 120, 64, 256)
    assert full["layers"] == full["of"] == 48 and full["bytes"] <= full["budget"]
    part = models.fit_layers("qwen3-30b-a3b", None, 30, 64, 256)
    base, layers = models.model_bytes("qwen3-30b-a3b", None)
    assert 0 < part["layers"] < 48 and part["bytes"] <= part["budget"] == 30 * 2**30
    assert part["bytes"] + layers[part["layers"]] > part["budget"]  # one layer more would not fit


def test_isolated_variants_run_in_processes_of_their_own_and_merge(tmp_path):
    argv = ["decode", "--family", "qwen3_moe", "--prompt", "8", "--new", "4", "--batch", "1", "--compile", "none",
            "--warmup", "0", "--profile-steps", "1", "--variants", "moetune,no-experts,transformers"]
    args = parse(*argv[1:], "--out", str(tmp_path))
    res = decode.isolated(args, argv)
    assert res["isolated"] and json.loads((tmp_path / "decode.json").read_text()) == json.loads(json.dumps(res))
    assert [r["variant"] for r in res["rows"]] == ["moetune", "no-experts", "transformers:grouped_mm"]
    assert all("error" not in r for r in res["rows"]) and res["moetune_plans"] == 2
    mine = res["rows"][0]
    assert mine["baseline"] == "transformers:grouped_mm" and mine["speedup"] > 0 and "moe_us_ablation" in mine
    # the token check runs on the children's kept runs: the two processes' greedy tokens compared
    assert [(c["batch"], c["tokens"], c["ref"]) for c in res["comparison"]] == [(1, 4, "transformers:grouped_mm")]
    assert not (tmp_path / "runs.pt").exists()


def test_an_unknown_variant_is_a_usage_error(capsys):
    assert decode.run(parse("--family", "qwen3_moe", "--variants", "moetune,vllm")) == 2
    assert "vllm not among transformers, moetune, no-experts" in capsys.readouterr().err


def test_the_timeline_counts_overlap_once_and_names_each_gap():
    # two steps: a → b overlapping (PDL), then c after a 3 µs gap, then a 10 µs gap to the next step's a
    work = [("a", 0, 10), ("b", 8, 14), ("c", 17, 20), ("a", 30, 40), ("b", 38, 44), ("c", 47, 50)]
    line = profiling.timeline(work, steps=2, top=5)
    assert line["busy_us"] == pytest.approx((14 + 3) * 2 / 2)
    assert line["kernels_us"] == pytest.approx((10 + 6 + 3) * 2 / 2)
    assert line["idle_us"] == pytest.approx((3 + 3 + 10) / 2)
    gaps = {(g["after"], g["before"]): g for g in line["gaps"]}
    assert gaps[("b", "c")]["count"] == 1 and gaps[("b", "c")]["us"] == pytest.approx(3)
    assert gaps[("c", "a")]["count"] == 0.5 and gaps[("c", "a")]["us"] == pytest.approx(5)
    assert line["gaps"][0]["after"] == "c"  # largest first
    contained = profiling.timeline([("x", 0, 10), ("y", 2, 5), ("z", 12, 13)], steps=1, top=5)
    assert contained["busy_us"] == 11 and contained["gaps"] == [
        {"after": "x", "before": "z", "count": 1, "us": 2}]  # the gap runs from the enclosing kernel's end
