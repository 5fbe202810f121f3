"""What a vendor GEMM reaches on the same work with perfectly balanced experts (H200 reference).

For each cell, cuBLAS `torch.bmm` runs the two projections of T·k rows split evenly over the active
experts (E_act = min(E, T·k) experts, ⌈T·k / E_act⌉ rows each): gate/up [E_act, m, D] · [E_act, D, 2F]
(the weights read in place, transposed view), SwiGLU, down [E_act, m, F] · [E_act, F, D]. No routing, no
gather, no combine and no padding to a tile: a lower bound on what the grouped GEMM of a real (uneven)
routing costs with that library. Timed as bench/kernels.py times (CUDA graph, 256 MB L2 flush before
every replay, median of 100); the two GEMMs are also timed alone.

    python3 bench/dense_ref.py --cells mixtral-8x7b:512,mixtral-8x7b:1024 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernels as B  # noqa: E402


def graph_us(fn, flush, reps: int = B.REPS) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(B.WARM):
        g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        flush.sum()
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def cell(shape: str, T: int, flush) -> dict:
    E, k, D, F = B.SHAPES[shape]
    dev = flush.device
    P = T * k
    ea = min(E, P)
    m = math.ceil(P / ea)
    w = B.expert_weights(E, D, F, dev, seed=1)
    gu, dn = w.gate_up[:ea].transpose(1, 2), w.down[:ea].transpose(1, 2)  # [ea, D, 2F], [ea, F, D] views
    x = torch.randn(ea, m, D, device=dev, dtype=torch.bfloat16)
    h = torch.randn(ea, m, F, device=dev, dtype=torch.bfloat16)

    def gate_up():
        return torch.bmm(x, gu)

    def down():
        return torch.bmm(h, dn)

    def both():
        a = torch.bmm(x, gu)
        hh = torch.nn.functional.silu(a[..., :F]) * a[..., F:]
        return torch.bmm(hh, dn)

    flops = 2.0 * ea * m * D * F * 3
    rec = dict(shape=shape, tokens=T, experts=ea, rows_per_expert=m, impl="cublas_bmm_balanced",
               gate_up_us=graph_us(gate_up, flush), down_us=graph_us(down, flush), time_us=graph_us(both, flush))
    rec["tflops"] = flops / rec["time_us"] / 1e6
    rec["gemm_tflops"] = flops / (rec["gate_up_us"] + rec["down_us"]) / 1e6
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="mixtral-8x7b:512,mixtral-8x7b:1024,qwen3-30b-a3b:1024,"
                    "qwen3.5-397b-a17b:1024,deepseek-v3:1024")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.randn(128 * 1024 * 1024, dtype=torch.bfloat16, device=dev)
    recs = []
    for c in args.cells.split(","):
        shape, T = c.split(":")
        recs.append(cell(shape, int(T), flush))
        r = recs[-1]
        print(f"{shape:18s} T={r['tokens']:5d} {r['experts']:4d}×{r['rows_per_expert']:4d} rows  "
              f"gate/up {r['gate_up_us']:8.1f}  down {r['down_us']:8.1f}  all {r['time_us']:8.1f} µs  "
              f"({r['tflops']:.0f} TFLOP/s; GEMMs alone {r['gemm_tflops']:.0f})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(dev).replace(" ", "-").lower()
    (out / f"{name}-dense-ref.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev),
                                                                records=recs), indent=1))


if __name__ == "__main__":
    main()
