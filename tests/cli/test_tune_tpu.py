"""`moetune tune` for a TPU target on a machine without one: timing is refused (exit 2, one line naming
--verify-only); `--verify-only` runs the Pallas TPU kernels themselves (TPU interpret mode, then lowered for
the TPU) on a tiny block and writes cost-model estimates as estimate rows only, which `moetune show` labels,
which the runtime serves as estimates and gives up for a measured entry, and which a second run does not
lower the coverage of."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import warnings

import pytest
import torch

from moetune.cli import main
from moetune.codegen.pallas_tpu._common import INTERPRET_ENV, on_tpu
from moetune.ir.config import block_from_config

pytestmark = pytest.mark.skipif(on_tpu(), reason="these check the behaviour on a machine without a TPU")

TARGET = "tpu-v5e"
CONFIG = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256,
          "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
          "torch_dtype": "bfloat16", "hidden_act": "silu"}  # MoEBlock(E=8, k=2, D=256, F=256), bf16


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def block_of(config):
    return block_from_config(json.loads(config.read_text()), name=str(config))


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue()


# --------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e", "tpu-v7", "ironwood"])
def test_timing_a_tpu_target_without_a_tpu_is_refused_naming_verify_only(target, config, tmp_path, capsys):
    cache = tmp_path / "t.sqlite"
    assert main(["tune", "--config", str(config), "--target", target, "--cache", str(cache)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"moetune tune: --target {target}: ") and "none is visible here" in err
    assert "--verify-only" in err and "estimates, not timings" in err
    assert not cache.exists()


@pytest.mark.parametrize("extra, says", [
    (["--target", "cpu"], "--verify-only: for a TPU target"),
    ([], "--verify-only: for a TPU target"),
    (["--target", TARGET, "--budget", "5s"], "--budget does not apply to --verify-only"),
    (["--target", TARGET, "--resume"], "--resume does not apply to --verify-only"),
    (["--target", TARGET, "--backend", "torch"], "--backend 'torch'"),
    (["--target", "tpu-v9"], "--target 'tpu-v9': unknown"),
])
def test_verify_only_flags_that_do_not_fit_are_refused(extra, says, config, tmp_path, capsys):
    assert main(["tune", "--config", str(config), "--verify-only", "--cache", str(tmp_path / "t.sqlite"),
                 *extra]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and says in err, err


# ----------------------------------------------------------------------------------- --verify-only


@pytest.fixture(scope="module")
def estimated(config, tmp_path_factory):
    """Two runs into one table: every bucket of T ∈ [1, 7] over a 1-point sub-grid, then the bucket of
    T = 5 again over a 2-point one; the table's rows after each."""
    from moetune.runtime.table import DispatchTable

    path = tmp_path_factory.mktemp("tpu") / f"{TARGET}.sqlite"
    base = ["tune", "--config", str(config), "--target", TARGET, "--verify-only", "--tokens", "1-7",
            "--cache", str(path)]
    first = run([*base, "--space-cap", "1"])
    with DispatchTable(path, create=False) as t:
        rows1 = t.entries()
    second = run([*base, "--space-cap", "2", "--at-tokens", "5"])
    with DispatchTable(path, create=False) as t:
        rows2 = t.entries()
    return path, first, rows1, second, rows2


def test_verify_only_says_its_times_are_estimates_and_counts_each_buckets_candidates(estimated):
    _, (rc, out), rows, _, _ = estimated
    assert rc == 0, out
    assert "COST-MODEL ESTIMATES, not measurements" in out and "in TPU interpret mode" in out
    assert f"ESTIMATES for {TARGET} (cost model, not measured; nothing was timed)" in out
    assert "the block itself (E=8)" in out
    progress = [ln for ln in out.splitlines() if "] bucket [" in ln]
    assert len(progress) == len(rows) >= 1
    for ln in progress:
        assert " candidates: " in ln and " verified, " in ln and " lowered, " in ln and " refused" in ln
        assert "best estimate " in ln and "% of floor" in ln
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.strip().startswith("bucket"))
    assert all(w in lines[head] for w in ("estimate µs", "floor µs", "% floor", "verified", "lowered", "refused"))
    table = [ln for ln in lines[head + 2:] if ln.strip().startswith("[")]
    assert len(table) == len(rows) and all("%" in ln for ln in table)
    assert f"{len(rows)} of {len(rows)} bucket estimates written" in out and "as ESTIMATE rows" in out


def test_verify_only_writes_estimate_rows_only(estimated, config):
    _, (_, out), rows, _, _ = estimated
    block = block_of(config)
    assert rows and all(e.estimated for e in rows)
    for e in rows:
        assert (e.target, e.backend, e.signature) == (TARGET, "pallas_tpu", block.signature_hash())
        assert e.timer.startswith("cost model") and TARGET in e.timer
        assert e.floor_us > 0 and e.time_us >= e.floor_us  # the model is the floor's roofline plus overheads
        assert e.pct_of_floor == pytest.approx(100 * e.floor_us / e.time_us)
        assert e.trials >= 1 and e.baseline_time_us is None and e.spread_us is None
        line = next(ln for ln in out.splitlines() if f"] bucket [{e.bucket_lo},{e.bucket_hi}]" in ln)
        assert re.search(r"T=\d+: (\d+) candidates: ", line)[1] == str(e.trials)


def test_a_second_run_does_not_lower_coverage_and_keeps_only_estimates(estimated):
    _, _, rows1, (rc, out), rows2 = estimated
    assert rc == 0, out
    assert len([ln for ln in out.splitlines() if "] bucket [" in ln]) == 1  # only the bucket of T = 5

    def covered(rows):
        return {t for e in rows for t in range(e.bucket_lo, e.bucket_hi + 1)}

    assert covered(rows2) >= covered(rows1) and all(e.estimated for e in rows2)
    before = {e.bucket: e.time_us for e in rows1}
    for e in rows2:  # an estimate gives way only to a faster one
        if e.bucket in before:
            assert e.time_us <= before[e.bucket]


def test_show_labels_every_estimate_row(estimated, capsys):
    path, _, _, _, rows = estimated
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{len(rows)} of these entries hold cost-model ESTIMATES (not measured)" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("[")]
    assert len(lines) == len(rows) and all(ln.rstrip().endswith("estimate") for ln in lines)
    assert main(["show", "--json", str(path)]) == 0
    assert all(r["estimated"] == 1 for r in json.loads(capsys.readouterr().out))


def test_the_runtime_serves_estimates_as_estimates_and_prefers_a_measured_entry(estimated, config, tmp_path,
                                                                               monkeypatch):
    """The dispatcher runs the estimated winners (real Pallas kernels, interpret mode) with the reference's
    results, its routes and its warning saying they are estimates; a measured entry written over one bucket,
    even a slower one, replaces that estimate."""
    from moetune.codegen.backend import for_target
    from moetune.codegen.torch import experts_reference, worst_error
    from moetune.runtime.dispatch import Dispatcher
    from moetune.runtime.entry import DispatchEntry
    from moetune.runtime.table import CacheWarning, DispatchTable, load_entries
    from moetune.runtime.versions import Versions
    from moetune.search.objective import expert_tensors, make_cases

    monkeypatch.setenv(INTERPRET_ENV, "1")
    src, _, rows, _, _ = estimated
    path = tmp_path / "copy.sqlite"
    shutil.copy(src, path)
    block = block_of(config)
    be = for_target("pallas_tpu", TARGET)
    est: list = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        entries = load_entries(path, block, TARGET, "pallas_tpu", estimated=est)
    assert sorted(est) == sorted(e.bucket for e in rows) == [(lo, hi) for lo, hi, _ in entries]
    assert any(issubclass(w.category, CacheWarning) and "cost-model estimates, not measured" in str(w.message)
               for w in said)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default buckets around the entries
        d = Dispatcher.from_entries(block, be, entries, target=TARGET, estimated=est)
    assert {r.source for r in d.routes if (r.lo, r.hi) in est} == {"table (estimate)"}
    w = expert_tensors(block, seed=3)
    case = make_cases(block, w, 5, 1, torch.Generator().manual_seed(5))[0]
    out = d(case.x, case.ids, case.weights, case.w)
    assert worst_error(out, experts_reference(block, case.x, case.ids, case.weights, case.w)) <= 1

    old = next(e for e in rows if e.bucket_lo <= 5 <= e.bucket_hi)
    measured = DispatchEntry.of(target=TARGET, block=block, bucket=old.bucket, schedule=old.schedule(block),
                                time_us=old.time_us * 100, versions=Versions.current("pallas_tpu", "cpu"),
                                timer="tpu")
    with DispatchTable(path) as t:
        assert t.put(measured)
        found = t.lookup(block, TARGET, "pallas_tpu")
    assert old.bucket not in {e.bucket for e in found.estimated}
    assert (old.bucket_lo, old.bucket_hi) in {(lo, hi) for lo, hi, _ in found.measured}
