"""dense: what a vendor GEMM reaches on the same work with perfectly balanced experts (a bound, GPU).

For each cell (a preset of `moetune.ir.presets` at T tokens), cuBLAS `torch.bmm` runs the two projections of
T·k rows split evenly over the active experts (E_act = min(E, T·k) experts, ⌈T·k / E_act⌉ rows each):
gate/up [E_act, m, D] · [E_act, D, 2F] (the weights read in place, a transposed view), SwiGLU, down
[E_act, m, F] · [E_act, F, D]. No routing, no gather, no combine and no padding to a tile: a lower bound on
what the grouped GEMM of a real (uneven) routing costs with that library. Timed by the package's timer
(`moetune.search.timing.CudaGraphTimer`: CUDA graph, 256 MB read before every replay, ≥ 100 replays); the two
GEMMs are also timed alone. The floor is `moetune.targets.floor` on the h200 target with E_act
distinct experts.

    python -m bench dense --cells mixtral-8x7b:512,mixtral-8x7b:1024 --out DIR

Writes DIR/<device>-dense-ref.json.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from bench.cells import TARGET, device_stem
from moetune.ir import MoEBlock, RoutingStats
from moetune.ir.presets import PRESETS, preset
from moetune.passes.roofline import floor
from moetune.search.timing import Case, CudaGraphTimer

CELLS = "mixtral-8x7b:512,mixtral-8x7b:1024,qwen3-30b-a3b:1024,qwen3.5-397b-a17b:1024,deepseek-v3:1024"


def cell(shape: str, T: int, timer: CudaGraphTimer, dev: torch.device) -> dict:
    from moetune.search.objective import expert_tensors

    block = preset(shape)
    E, k, D, F = block.E, block.k, block.D, block.F
    P = T * k
    ea = min(E, P)
    m = math.ceil(P / ea)
    w = expert_tensors(MoEBlock(E=ea, k=k, D=D, F=F), dev, seed=1)  # the active experts' weights only
    gu, dn = w.gate_up.transpose(1, 2), w.down.transpose(1, 2)  # [ea, D, 2F], [ea, F, D] views
    x = torch.randn(ea, m, D, device=dev, dtype=torch.bfloat16)
    h = torch.randn(ea, m, F, device=dev, dtype=torch.bfloat16)
    case = [Case(x, torch.empty(0, device=dev), torch.empty(0, device=dev), w)]

    def gate_up(*_):
        return torch.bmm(x, gu)

    def down(*_):
        return torch.bmm(h, dn)

    def both(*_):
        a = torch.bmm(x, gu)
        return torch.bmm(torch.nn.functional.silu(a[..., :F]) * a[..., F:], dn)

    def us(fn) -> float:
        return timer(fn, case).median_s * 1e6

    flops = 2.0 * ea * m * D * F * 3
    stats = RoutingStats(tokens=T, distinct_experts=ea, rows_per_active=P / ea, max_rows=m, source="balanced")
    rec = dict(shape=shape, tokens=T, experts=ea, rows_per_expert=m, impl="cublas_bmm_balanced",
               floor_us=floor(block, TARGET, T, stats).time_s * 1e6,
               gate_up_us=us(gate_up), down_us=us(down), time_us=us(both))
    rec["tflops"] = flops / rec["time_us"] / 1e6
    rec["gemm_tflops"] = flops / (rec["gate_up_us"] + rec["down_us"]) / 1e6
    return rec


def add_arguments(ap) -> None:
    ap.add_argument("--cells", default=CELLS, help=f"preset:T,... (presets: {', '.join(PRESETS)})")
    ap.add_argument("--out", default="bench/results")


def run(args) -> int:
    if not torch.cuda.is_available():
        print("bench dense: no CUDA device here (it times cuBLAS)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    timer = CudaGraphTimer()
    recs = []
    for c in args.cells.split(","):
        shape, T = c.split(":")
        r = cell(shape, int(T), timer, dev)
        recs.append(r)
        print(f"{shape:18s} T={r['tokens']:5d} {r['experts']:4d}×{r['rows_per_expert']:4d} rows  "
              f"gate/up {r['gate_up_us']:8.1f}  down {r['down_us']:8.1f}  all {r['time_us']:8.1f} µs  "
              f"({r['tflops']:.0f} TFLOP/s; GEMMs alone {r['gemm_tflops']:.0f}; floor {r['floor_us']:.1f} µs)",
              flush=True)
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{device_stem()}-dense-ref.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev),
                                                                records=recs), indent=1))
    return 0
