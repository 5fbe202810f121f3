"""router: a block's router at decode sizes, the model's own module against moetune's fused router (GPU).

For each preset whose router kind the fused kernel computes (`moetune.codegen.triton.router.refusal`) and each T:
the preset's real transformers router module (built from its config, random weights, bf16) run as transformers
runs it under torch.compile (inductor, the module's forward compiled), and moetune's fused router attached to the
same module (`moetune.runtime.router.attach`: checked against the module's own forward first). Timed by the
package's timer (`moetune.search.timing.CudaGraphTimer`: a CUDA graph, a 256 MB read before every replay, CUDA
events), three inputs in rotation; the routers' weights are read from memory, as in a decode step.

    python -m bench router --presets qwen3-30b-a3b,qwen3.5-397b-a17b,mixtral-8x7b --tokens 1,4,16 --out DIR

Writes DIR/<device>-router.json; prints a table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.cells import device_stem
from bench.models import preset_config
from moetune.codegen.tensors import ExpertTensors
from moetune.ir.presets import PRESETS, preset
from moetune.search.timing import Case, CudaGraphTimer

PRESETS_DEFAULT = "qwen3-30b-a3b,qwen3.5-397b-a17b,mixtral-8x7b,olmoe-1b-7b"


def router_module(name: str, device: str) -> torch.nn.Module:
    """Preset `name`'s real router module (its first MoE block's `gate` or `router`), random bf16 weights."""
    import transformers

    from moetune.testing import moe_blocks

    config = preset_config(name, 1, 128)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    _, block = next(moe_blocks(model))
    meta = block.gate if hasattr(block, "gate") else block.router
    torch.manual_seed(0)
    with torch.device(device):
        mod = type(meta)(config)
    for p in mod.parameters():
        with torch.no_grad():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return mod.to(torch.bfloat16).eval()


def add_arguments(ap) -> None:
    ap.add_argument("--presets", default=PRESETS_DEFAULT, help=f"comma-separated, of {', '.join(PRESETS)}")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="bench/results")


def run(args) -> int:
    if not torch.cuda.is_available():
        print("bench router: no CUDA device here (it times GPU kernels in CUDA graphs)", file=sys.stderr)
        return 2
    from moetune.codegen.triton.router import refusal
    from moetune.runtime import router as fused

    timer = CudaGraphTimer(reps=args.reps)
    dev = torch.device("cuda")
    recs = []
    for name in [p.strip() for p in args.presets.split(",") if p.strip()]:
        block = preset(name)
        why = refusal(block.router)
        if why:
            print(f"{name}: {why}; skipped", flush=True)
            continue
        mod = router_module(name, "cuda")
        own = torch.compile(mod.forward)
        dummy = ExpertTensors(mod.weight, mod.weight)
        for T in [int(t) for t in args.tokens.split(",")]:
            cases = [Case(torch.randn(T, block.D, device=dev, dtype=torch.bfloat16), None, None, dummy)
                     for _ in range(3)]
            row = dict(preset=name, T=T, E=block.E, k=block.k, D=block.D, router=str(block.router))
            row["own_us"] = timer(lambda x, *_, f=own: f(x)[1], cases).median_s * 1e6
            why = fused.attach(mod, block.replace(routing_weight_dtype=str(
                mod(cases[0].x)[1].dtype).removeprefix("torch.")))
            if why:
                row["fused_error"] = why
            else:
                row["fused_us"] = timer(lambda x, *_, m=mod: m(x)[1], cases).median_s * 1e6
                fused.detach(mod)
            recs.append(row)
            got = f"{row['fused_us']:8.2f}" if "fused_us" in row else f"not attached: {why}"
            print(f"{name:20s} T={T:<3d} model's own (compiled) {row['own_us']:8.2f} µs  fused {got}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{device_stem()}-router.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev),
                                                             timer=timer.name, records=recs), indent=1))
    print("| preset | T | model's router, compiled µs | moetune fused µs | × |\n|---|---|---|---|---|")
    for r in recs:
        if "fused_us" in r:
            print(f"| {r['preset']} | {r['T']} | {r['own_us']:.2f} | {r['fused_us']:.2f} | "
                  f"{r['own_us'] / r['fused_us']:.2f}× |")
    return 0
