"""`moetune explain`: the MoE block IR of a preset, a config.json or a model folder (no weights are read),
optionally with the IR after every pass of the pipeline."""

from __future__ import annotations

import argparse

from ..targets import DEFAULT_GPU, TARGETS
from .common import add_source, existing_file, parse_tokens, source_block, source_config


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("explain", help="print the MoE block IR of a preset, config or model folder")
    add_source(p)
    p.add_argument("--passes", action="store_true", help="also print the IR after every pass")
    p.add_argument("--target", default=DEFAULT_GPU, help=f"hardware target for the passes' floors (default "
                   f"{DEFAULT_GPU}; known: {', '.join(TARGETS)})")
    p.add_argument("--trace", help="a routing trace from `moetune record` for the statistics")
    p.add_argument("--tokens", default="1-4096", help="token range LO-HI")
    p.add_argument("--backend", default=None,
                   help="the backend whose defaults the last pass shows (default: the target's, as a compiled "
                        "model there runs: triton on a GPU, torch on the CPU)")
    return p


def _ranges(idx: list[int]) -> str:
    """[3, 4, 5, 9] → "3-5, 9"."""
    out, start = [], None
    for i, v in enumerate(idx):
        start = v if start is None else start
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v > start else f"{v}")
            start = None
    return ", ".join(out)


def run(args: argparse.Namespace) -> int:
    from ..ir.config import moe_layers, quantization

    tokens = parse_tokens(args.tokens)
    if args.trace:
        existing_file(args.trace, "--trace", "a routing trace from `moetune record`")
    block = source_block(args, T_max=tokens[1])
    print(block)
    cfg, name = source_config(args)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    layers = moe_layers(cfg, name)
    if layers is not None:
        print(f"  MoE layers: {len(layers)} of {text['num_hidden_layers']} ({_ranges(layers) or 'none'})")
    quant = quantization(cfg)
    if block.weight_format.quantized:
        fmt = block.weight_format
        print(f"  note: FP8 checkpoint (quant_method 'fp8'): experts in float8_e4m3fn with one {fmt.scale_dtype} "
              f"scale per {fmt.block[0]}x{fmt.block[1]} block, activations in {fmt.compute_dtype}, as "
              "transformers loads them into FP8Experts on a GPU; moetune's kernels read them in place. Loaded "
              "where there is no GPU, transformers dequantizes the checkpoint to bf16, and the block is then "
              "the bf16 one")
    elif quant is not None:
        print(f"  note: the checkpoint is quantized (quant_method {quant.get('quant_method')!r}); capture "
              f"leaves such experts as they are, so this {block.weight_dtype} block describes the "
              "model loaded dequantized")
    if not args.passes:
        return 0
    from ..codegen.backend import get
    from ..codegen.torch.tolerance import accuracy
    from ..ir.explain import format_ir
    from ..passes.pipeline import run_pipeline
    from ..runtime.default import backend_for

    be = get(args.backend) if args.backend else backend_for(args.target)
    refusals = be.kinds(block)
    if all(refusals.values()):  # e.g. FP8 weights on a backend without FP8 kernels
        print(f"  note: backend {be.name} runs none of its kernels on this block, so a model compiled with it "
              f"leaves the block as it is; the passes below show backend-neutral defaults ("
              + "; ".join(f"{k}: {v}" for k, v in refusals.items()) + ")")
        be = None
    # an FP8 block's schedules are weight-only or w8a8: say what each is checked to
    note = (lambda s: accuracy(s.params)) if block.weight_format.quantized else None
    for pass_name, ir in run_pipeline(block, target=args.target, trace=args.trace, tokens=tokens, backend=be):
        print(f"\n== after {pass_name}\n{format_ir(ir, note)}")
    return 0
