"""Routing traces: file format round trip, clear errors for bad files, recording a real tiny model (padded
batches record the real tokens only)."""

import io
import zipfile

import numpy as np
import pytest

from moetune.ir.trace import Trace, TraceError, record, routing_trace, synthetic_trace
from moetune.passes.stats import from_trace


def test_round_trip(tmp_path):
    tr = synthetic_trace(16, 4, tokens=100, layers=3, zipf=1.0, step=32)
    path = tr.save(tmp_path / "t")
    assert path.suffix == ".npz"
    back = Trace.load(path)
    assert (back.E, back.k, back.layers) == (16, 4, tr.layers)
    assert back.step_tokens.tolist() == [32, 32, 32, 4]
    np.testing.assert_array_equal(back.ids, tr.ids)
    assert back.meta["zipf"] == 1.0 and back.name == str(path)


def _zip_bytes(tr, tmp_path):
    p = tr.save(tmp_path / "good.npz")
    return p, p.read_bytes()


def _foreign_npz(path):
    np.savez(path, x=np.arange(3))


def _other_version(path, tmp_path):
    tr = synthetic_trace(8, 2, tokens=10)
    good = tr.save(tmp_path / "v.npz")
    with np.load(good) as z:
        arrays = {n: z[n] for n in z.files}
    arrays["version"] = np.array(99)
    np.savez(path, **arrays)


def _bad_ids(path, tmp_path):
    tr = synthetic_trace(8, 2, tokens=10)
    good = tr.save(tmp_path / "v.npz")
    with np.load(good) as z:
        arrays = {n: z[n] for n in z.files}
    arrays["ids"] = arrays["ids"] + 8  # ids ≥ E
    np.savez(path, **arrays)


def _missing_array(path, tmp_path):
    tr = synthetic_trace(8, 2, tokens=10)
    good = tr.save(tmp_path / "v.npz")
    with np.load(good) as z:
        arrays = {n: z[n] for n in z.files if n != "step_tokens"}
    np.savez(path, **arrays)


BAD_FILES = [
    # (name, writer, words the error must contain)
    ("truncated", lambda p, t: p.write_bytes(_zip_bytes(synthetic_trace(8, 2, tokens=50), t)[1][:300]),
     "truncated or foreign"),
    ("text", lambda p, t: p.write_text("hello, not a trace\n"), "truncated or foreign"),
    ("empty", lambda p, t: p.write_bytes(b""), "truncated or foreign"),
    ("foreign_npz", lambda p, t: _foreign_npz(p), "not a moetune trace"),
    ("other_version", _other_version, "version 99"),
    ("bad_ids", _bad_ids, "outside [0, E = 8)"),
    ("missing_array", _missing_array, "missing arrays ['step_tokens']"),
]


@pytest.mark.parametrize("name,write,words", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_file_errors_name_the_file(tmp_path, name, write, words):
    path = tmp_path / f"{name}.npz"
    write(path, tmp_path)
    with pytest.raises(TraceError) as e:
        Trace.load(path)
    assert str(path) in str(e.value) and words in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="nowhere.npz: not found"):
        Trace.load(tmp_path / "nowhere.npz")


def test_zip_with_pickled_object_is_refused(tmp_path):
    path = tmp_path / "pickle.npz"
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("format.npy", buf.getvalue())
    with pytest.raises(TraceError, match=str(path)):
        Trace.load(path)


def test_duplicate_expert_in_a_token_is_refused():
    with pytest.raises(TraceError, match="same expert twice"):
        Trace(E=8, k=2, layers=("l",), step_tokens=np.array([1]), step_phase=np.array([1], np.int8),
              ids=np.array([[[3, 3]]]))


def test_record_tiny_qwen3_moe_feeds_the_stats_model(tmp_path):
    testing = pytest.importorskip("moetune.testing")
    model = testing.build("qwen3_moe")
    import torch

    ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    seen = []  # what the routers themselves returned, observed independently of the experts hook
    gates = [model.model.layers[i].mlp.gate for i in range(2)]
    hooks = [g.register_forward_hook(lambda m, a, out: seen.append(out[2].clone())) for g in gates]
    tr = record(model, ids, steps=3)
    for h in hooks:
        h.remove()
    assert tr.layers == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert (tr.E, tr.k) == (16, 4)
    assert tr.step_tokens.tolist() == [15, 3, 3, 3] and tr.step_phase.tolist() == [0, 1, 1, 1]
    routed = [np.concatenate([seen[2 * s + layer].numpy() for s in range(4)]) for layer in range(2)]
    np.testing.assert_array_equal(tr.ids, np.stack(routed))
    # a tokenizer-style dict with a left-padded attention mask: the two padding rows are not recorded
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    tr2 = record(model, {"input_ids": ids, "attention_mask": mask}, steps=1)
    assert tr2.step_tokens.tolist() == [13, 3] and tr2.ids.shape == (2, 16, 4)
    assert tr2.meta["prompt_tokens"] == 13 and tr2.meta["prompt_len"] == 5
    back = Trace.load(tr.save(tmp_path / "q.npz"))
    st = from_trace(back).stats(3)
    assert 3 <= st.distinct_experts <= 12 and st.source.startswith("trace:")
    assert from_trace(back, phase="decode").distinct(3) > 0



# ---------------------------------------------------------------- padded batches

LENGTHS = (5, 2, 7)  # prompts of different lengths, batched with padding to 7


def _prompts():
    import torch

    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


def _padded(seqs, side: str, pad: int = 0):
    """(ids [B, S], mask [B, S]) of `seqs` padded on `side` with token `pad`."""
    import torch

    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        at = slice(S - len(s), S) if side == "left" else slice(0, len(s))
        ids[b, at], mask[b, at] = s, 1
    return ids, mask


def _batched(alone: list[Trace]) -> tuple[list[int], np.ndarray]:
    """The step token counts and ids [L, N, k] a batch of these sequences records: per step, the rows
    of every sequence still running at that step, in batch order."""
    def rows(tr: Trace, s: int) -> np.ndarray:
        at = int(tr.step_tokens[:s].sum())
        return tr.ids[:, at:at + int(tr.step_tokens[s])]

    steps = max(tr.steps for tr in alone)
    per_step = [[rows(tr, s) for tr in alone if tr.steps > s] for s in range(steps)]
    return [sum(r.shape[1] for r in rs) for rs in per_step], np.concatenate([r for rs in per_step for r in rs], 1)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny(request):
    testing = pytest.importorskip("moetune.testing")
    model = testing.build(request.param)
    model.generation_config.eos_token_id = model.config.eos_token_id = None  # no sequence finishes
    return model


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("pad", [0, 127])
def test_a_padded_batch_records_each_sequence_as_alone(tiny, side, pad):
    seqs = _prompts()
    alone = [record(tiny, s[None], steps=3) for s in seqs]
    assert [tr.step_tokens.tolist() for tr in alone] == [[n, 1, 1, 1] for n in LENGTHS]
    ids, mask = _padded(seqs, side, pad)
    tr = record(tiny, ids, steps=3, attention_mask=mask)
    want_tokens, want_ids = _batched(alone)
    assert tr.step_tokens.tolist() == want_tokens == [sum(LENGTHS), 3, 3, 3]
    assert tr.step_phase.tolist() == [0, 1, 1, 1]
    np.testing.assert_array_equal(tr.ids, want_ids)
    assert tr.meta["prompt_tokens"] == sum(LENGTHS) and tr.meta["decode_steps"] == 3


def test_a_finished_sequence_records_no_further_rows(tiny):
    seqs = _prompts()
    first = [int(tiny(input_ids=s[None]).logits[0, -1].argmax()) for s in seqs]  # greedy token after each prompt
    tiny.generation_config.eos_token_id = first[1]  # the second sequence ends at once
    try:
        alone = [record(tiny, s[None], steps=3) for s in seqs]
        assert alone[1].steps == 1 and alone[1].meta["decode_steps"] == 0  # nothing to decode
        for side in ("left", "right"):
            ids, mask = _padded(seqs, side)
            tr = record(tiny, ids, steps=3, attention_mask=mask)
            want_tokens, want_ids = _batched(alone)
            assert tr.step_tokens.tolist() == want_tokens and want_tokens[1] == 2
            np.testing.assert_array_equal(tr.ids, want_ids)
        # every sequence finished: decoding stops after the prompt
        tiny.generation_config.eos_token_id = sorted(set(first))
        ids, mask = _padded(seqs, "left")
        tr = record(tiny, ids, steps=3, attention_mask=mask)
        assert tr.step_tokens.tolist() == [sum(LENGTHS)] and tr.meta["decode_steps"] == 0
    finally:
        tiny.generation_config.eos_token_id = None


@pytest.mark.parametrize("mask,words", [
    ([[1, 1, 1]], "attention mask of shape (1, 3) for input ids of shape (2, 4)"),
    ([[1, 1, 1, 1], [0, 0, 0, 0]], "attention mask rows [1] have no real token"),
    ([[1, 1, 1, 1], [0, 2, 1, 1]], "values other than 0 (padding) and 1 (real token)"),
])
def test_a_bad_attention_mask_is_refused(tiny, mask, words):
    import torch

    with pytest.raises(TraceError) as e:
        record(tiny, torch.zeros(2, 4, dtype=torch.long), steps=1, attention_mask=torch.tensor(mask))
    assert words in str(e.value)


@pytest.mark.parametrize("E,k", [(16, 4), (8, 1), (128, 8)])
def test_the_hot_routing_puts_one_expert_in_half_the_tokens(E, k):
    t = routing_trace("hot", E, k, seed=3)
    ids = t.ids[0]
    assert ids.shape == (4096, k) and ids.min() >= 0 and ids.max() < E
    assert all(len(set(row)) == k for row in ids.tolist())  # a token's experts distinct
    counts = np.bincount(ids.ravel(), minlength=E)
    hot = int(counts.argmax())
    assert abs(counts[hot] / 4096 - 0.5) < 0.03
    others = np.delete(counts, hot)
    assert others.max() < counts[hot]
    assert others.max() < 1.5 * others.min()  # the rest uniform over the others


def test_routing_specs():
    assert routing_trace("uniform", 16, 4) is None
    z = routing_trace("zipf:1.5", 16, 4)
    counts = np.sort(np.bincount(z.ids[0].ravel(), minlength=16))[::-1]
    assert counts[0] > 2 * counts[8]  # skewed
    assert z.meta["zipf"] == 1.5
    for bad in ("zipf:0", "zipf:x", "zipf", "hot:2", "uniform:1", "", "bursty"):
        with pytest.raises(TraceError, match="expected uniform, zipf:S"):
            routing_trace(bad, 16, 4)


def test_a_trace_routing_reads_the_file_and_checks_its_shape(tmp_path):
    path = tmp_path / "t.npz"
    synthetic_trace(16, 4, tokens=256).save(path)
    assert routing_trace(f"trace:{path}", 16, 4).ids.shape == (1, 256, 4)
    with pytest.raises(TraceError, match="the trace has E=16, k=4; the block has E=8, k=2"):
        routing_trace(f"trace:{path}", 8, 2)
