"""`moetune record`: each MoE layer's routing on the given inputs, saved as a trace for `explain` and `tune`.

    moetune record --model-dir DIR [--prompts FILE] [--steps N] -o trace.npz
    moetune record --tiny FAMILY [--steps N] -o trace.npz

Without --prompts the inputs are random token ids. Prompts of different lengths are padded on the left;
the trace holds their real tokens only (the attention mask's ones), and a prompt whose greedy continuation
reaches the model's end-of-sequence token stops there. Every file and value is checked before the model
is loaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..ir import ConfigError
from .common import existing_file, model_folder, tiny_model, whole, writable_file


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("record", help="record each MoE layer's routing on the given inputs")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model-dir", help="a HuggingFace model folder")
    g.add_argument("--tiny", help="a tiny offline model family (tests, demos)")
    p.add_argument("--prompts", help="a text file, one prompt per line (needs a tokenizer in --model-dir)")
    p.add_argument("--steps", type=int, default=8, help="decode steps to record after the prompt (≥ 0)")
    p.add_argument("-o", "--output", required=True, help="trace file to write (.npz)")
    return p


def _output(path: str) -> Path:
    """The file `Trace.save` writes for `path`, once it can be written."""
    p = Path(path)
    if p.suffix != ".npz":
        p = p.with_name(p.name + ".npz")
    writable_file(str(p), "-o")
    return p


def _prompts(path: str) -> list[str]:
    f = existing_file(path, "--prompts", "a text file with one prompt per line")
    try:
        lines = f.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts {path!r}: cannot be read as text ({e}); "
                          "expected a text file with one prompt per line") from None
    prompts = [ln.strip() for ln in lines if ln.strip()]
    if not prompts:
        raise ConfigError(f"--prompts {path!r}: no non-empty line; expected one prompt per line")
    return prompts


def _tokenizer(model_dir: str, n_prompts: int):
    """The folder's tokenizer, padding on the left with its pad token (else its eos token)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"--model-dir {model_dir!r}: no usable tokenizer for --prompts "
                          f"({type(e).__name__}: {e}); expected tokenizer files beside config.json") from None
    if tok.pad_token is None and n_prompts > 1:
        if tok.eos_token is None:
            raise ConfigError(f"--model-dir {model_dir!r}: its tokenizer has neither a pad token nor an eos "
                              f"token, so {n_prompts} prompts of different lengths cannot be batched; "
                              "expected a tokenizer with a pad or eos token, or a --prompts file of one line")
        tok.pad_token = tok.eos_token
    return tok


def run(args: argparse.Namespace) -> int:
    import torch

    from ..ir.trace import record

    whole(args.steps, "--steps", 0)
    if args.tiny and args.prompts:
        raise ConfigError(f"--prompts {args.prompts!r}: needs a tokenizer, which a --tiny model has none of; "
                          "expected --model-dir with a tokenizer")
    output = _output(args.output)
    mask = None
    g = torch.Generator().manual_seed(0)
    if args.tiny:
        model = tiny_model(args.tiny)
        inputs = torch.randint(0, model.config.vocab_size, (4, 8), generator=g)  # [B, S]
        label = f"tiny:{args.tiny}"
    else:
        model_folder(args.model_dir)
        enc = None
        if args.prompts:
            prompts = _prompts(args.prompts)
            tok = _tokenizer(args.model_dir, len(prompts))
            enc = tok(prompts, return_tensors="pt", padding=len(prompts) > 1)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
        label = str(args.model_dir)
        if enc is not None:
            inputs, mask = enc["input_ids"], enc.get("attention_mask")  # [B, S]
        else:
            inputs = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)  # [B, S]
    trace = record(model, inputs, steps=args.steps, attention_mask=mask, name=label)
    trace.meta["source"] = label
    try:
        path = trace.save(output)
    except OSError as e:
        raise ConfigError(f"-o {args.output!r}: cannot be written ({e.strerror or e}); "
                          "expected a file in a writable folder") from None
    print(f"wrote {path}: {len(trace.layers)} MoE layers, E={trace.E} k={trace.k}, "
          f"{trace.steps} steps, {trace.tokens} tokens")
    return 0
