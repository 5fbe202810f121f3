"""Routing traces: file format round trip, clear errors for bad files, recording a real tiny model."""

import io
import zipfile

import numpy as np
import pytest

from moetune.passes.stats import from_trace
from moetune.passes.trace import Trace, TraceError, record, synthetic_trace


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
    # a tokenizer-style dict with a left-padded attention mask records the same way
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    tr2 = record(model, {"input_ids": ids, "attention_mask": mask}, steps=1)
    assert tr2.step_tokens.tolist() == [15, 3] and tr2.ids.shape == (2, 18, 4)
    back = Trace.load(tr.save(tmp_path / "q.npz"))
    st = from_trace(back).stats(3)
    assert 3 <= st.distinct_experts <= 12 and st.source.startswith("trace:")
    assert from_trace(back, phase="decode").distinct(3) > 0

