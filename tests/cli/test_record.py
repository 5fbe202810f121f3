"""`moetune record`: a tiny model and a saved model folder (with and without a tokenizer) traced to a file;
every bad file or value is one line on stderr and exit 2, before the model is loaded."""

import numpy as np
import pytest

from moetune import testing as tm
from moetune.cli import main
from moetune.ir.trace import Trace


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny mixtral saved to disk with a word-level tokenizer that has no pad and no eos token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("model")
    tm.build("mixtral").save_pretrained(d)
    words = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(tm.VOCAB - 1)}, "[UNK]": tm.VOCAB - 1},
                                       unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    assert tok.pad_token is None and tok.eos_token is None
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def padded_dir(model_dir, tmp_path_factory):
    """The same model and words with a pad token: prompts of different lengths are batched."""
    import shutil

    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("padded")
    shutil.copytree(model_dir, d, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(d)
    tok.pad_token = "[UNK]"
    tok.save_pretrained(d)
    return d


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err


def test_record_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "cli.npz"
    assert main(["record", "--tiny", "qwen3_moe", "--steps", "2", "-o", str(out)]) == 0
    assert "2 MoE layers, E=16 k=4, 3 steps" in capsys.readouterr().out
    assert Trace.load(out).steps == 3
    assert main(["record", "--tiny", "llama4", "-o", str(tmp_path / "x.npz")]) == 2
    assert "no hooked MoE experts module" in one_line(capsys.readouterr().err)
    assert main(["record", "--tiny", "nope", "-o", str(tmp_path / "x.npz")]) == 2
    assert one_line(capsys.readouterr().err).startswith("moetune record: --tiny 'nope': unknown tiny family")


def test_record_a_model_folder(model_dir, tmp_path, capsys):
    out = tmp_path / "m.npz"
    assert main(["record", "--model-dir", str(model_dir), "--steps", "1", "-o", str(out)]) == 0
    tr = Trace.load(out)
    assert (tr.E, tr.k, len(tr.layers)) == (8, 2, 2) and tr.step_tokens.tolist() == [64, 4]
    capsys.readouterr()
    assert main(["record", "--tiny", "mixtral", "--model-dir", str(model_dir), "-o", str(out)]) == 2
    assert one_line(capsys.readouterr().err).startswith("moetune: record: argument --model-dir: not allowed")


def test_one_prompt_needs_no_padding(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2 w3 w4 w5\n\n")
    out = tmp_path / "p.npz"
    assert main(["record", "--model-dir", str(model_dir), "--prompts", str(prompts), "--steps", "2",
                 "-o", str(out)]) == 0
    assert Trace.load(out).step_tokens.tolist() == [5, 1, 1]


def test_padded_prompts_record_their_real_tokens(padded_dir, tmp_path, capsys):
    """Three prompts left-padded to 7 words record what each records alone; the second one's greedy
    continuation is mixtral's eos token (2), so it ends after its prompt."""
    prompts = ["w5 w6 w7 w8 w9", "w10 w11", "w12 w13 w14 w15 w16 w17 w18"]
    alone = []
    for i, p in enumerate(prompts):
        (tmp_path / f"{i}.txt").write_text(p + "\n")
        assert main(["record", "--model-dir", str(padded_dir), "--prompts", str(tmp_path / f"{i}.txt"),
                     "--steps", "2", "-o", str(tmp_path / f"{i}.npz")]) == 0
        alone.append(Trace.load(tmp_path / f"{i}.npz"))
    assert [a.step_tokens.tolist() for a in alone] == [[5, 1, 1], [2], [7, 1, 1]]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "p.npz"
    capsys.readouterr()
    assert main(["record", "--model-dir", str(padded_dir), "--prompts", str(tmp_path / "p.txt"), "--steps", "2",
                 "-o", str(out)]) == 0
    assert capsys.readouterr().out.endswith(", 3 steps, 18 tokens\n")
    tr = Trace.load(out)
    assert tr.step_tokens.tolist() == [14, 2, 2] and tr.meta["prompt_len"] == 7
    prefill = [a.ids[:, :a.step_tokens[0]] for a in alone]  # [L, n, k] each
    decode = [a.ids[:, a.step_tokens[0] + s, None] for s in range(2) for a in (alone[0], alone[2])]  # [L, 1, k]
    np.testing.assert_array_equal(tr.ids, np.concatenate(prefill + decode, 1))


def test_prompts_with_a_tokenizer_without_pad_or_eos_token(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2 w3\nw4\n")
    assert main(["record", "--model-dir", str(model_dir), "--prompts", str(prompts),
                 "-o", str(tmp_path / "p.npz")]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"moetune record: --model-dir '{model_dir}': its tokenizer has neither a pad token "
                          "nor an eos token")
    assert not (tmp_path / "p.npz").exists()


def test_a_missing_prompts_file(model_dir, tmp_path, capsys):
    missing = tmp_path / "none.txt"
    assert main(["record", "--model-dir", str(model_dir), "--prompts", str(missing), "-o",
                 str(tmp_path / "t.npz")]) == 2
    assert one_line(capsys.readouterr().err) == (f"moetune record: --prompts '{missing}': no such file; "
                                                 "expected a text file with one prompt per line\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert main(["record", "--model-dir", str(model_dir), "--prompts", str(empty), "-o",
                 str(tmp_path / "t.npz")]) == 2
    assert "no non-empty line" in one_line(capsys.readouterr().err)
    assert main(["record", "--tiny", "mixtral", "--prompts", str(empty), "-o", str(tmp_path / "t.npz")]) == 2
    assert "needs a tokenizer" in one_line(capsys.readouterr().err)


def test_a_missing_model_folder(tmp_path, capsys):
    assert main(["record", "--model-dir", str(tmp_path / "none"), "-o", str(tmp_path / "t.npz")]) == 2
    assert one_line(capsys.readouterr().err) == (f"moetune record: --model-dir '{tmp_path / 'none'}': does not "
                                                 "exist; expected a model folder holding config.json\n")


@pytest.mark.parametrize("output,why", [("/proc/moetune-none/t.npz", "cannot be written"), ("{tmp}", "is a folder")])
def test_an_unwritable_output(output, why, tmp_path, capsys):
    output = output.format(tmp=tmp_path / "d.npz")
    (tmp_path / "d.npz").mkdir()
    assert main(["record", "--tiny", "qwen3_moe", "-o", output]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"moetune record: -o '{output}': {why}")


def test_a_read_only_output_file(tmp_path, capsys):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes read-only files")
    out = tmp_path / "t.npz"
    out.write_bytes(b"")
    out.chmod(0o444)
    assert main(["record", "--tiny", "qwen3_moe", "-o", str(out)]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"moetune record: -o '{out}': cannot be written")


@pytest.mark.parametrize("steps", ["-3", "-1"])
def test_negative_steps_are_refused(steps, tmp_path, capsys):
    assert main(["record", "--tiny", "qwen3_moe", "--steps", steps, "-o", str(tmp_path / "t.npz")]) == 2
    assert one_line(capsys.readouterr().err) == f"moetune record: --steps '{steps}': expected a whole number ≥ 0\n"
    assert not (tmp_path / "t.npz").exists()


def test_zero_steps_record_the_prompt_only(tmp_path):
    assert main(["record", "--tiny", "qwen3_moe", "--steps", "0", "-o", str(tmp_path / "t.npz")]) == 0
    assert Trace.load(tmp_path / "t.npz").step_phase.tolist() == [0]


def test_a_malformed_command_line_is_one_line(tmp_path, capsys):
    assert main(["record", "--tiny", "qwen3_moe", "--steps", "many", "-o", str(tmp_path / "t.npz")]) == 2
    assert one_line(capsys.readouterr().err) == "moetune: record: argument --steps: invalid int value: 'many'\n"
    assert main(["record", "--tiny", "qwen3_moe"]) == 2
    assert one_line(capsys.readouterr().err).startswith("moetune: record: the following arguments are required")
