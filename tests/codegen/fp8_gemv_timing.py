"""Time the FP8 stream_gemv on a GPU: its default and a few points of its space per cell, against the FP8 floor.

    python tests/codegen/fp8_gemv_timing.py --out DIR [--shapes a,b] [--tokens 1,2,4] [--reps 100] [--budget 170]

Cells: the FP8 (128 x 128 blocks, float32 scales) versions of four presets x T = 1, 2, 4, 8, 16, 32, 64.
Each candidate is checked against the float32 reference on the dequantised weights first (a wrong one is
reported and not timed), then timed with the package's timer (moetune.search.timing.CudaGraphTimer: CUDA
graphs, L2 defeated by a reading flush, the mean over 32 routings of each one's median) on the package's
inputs (moetune.search.objective.expert_tensors / make_cases). The floor is moetune.passes.targets.floor on
the FP8 block (datasheet figures); the measured HBM read rate is printed beside it. Prints one line per
candidate and writes DIR/fp8_gemv_timing.json after every cell (cells not started within --budget seconds
are listed as not run). Not a test: it needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moetune.codegen.torch.reference import experts_reference
from moetune.codegen.torch.tolerance import worst_error
from moetune.codegen.triton import BACKEND
from moetune.ir import Schedule, WeightFormat
from moetune.ir.presets import preset
from moetune.passes.policy import rows_per_active
from moetune.passes.targets import floor
from moetune.search.objective import expert_tensors, make_cases
from moetune.search.timing import CudaGraphTimer

SHAPES = ("qwen3-30b-a3b", "qwen3.5-397b-a17b", "deepseek-v3", "mixtral-8x7b")
TOKENS = (1, 2, 4, 8, 16, 32, 64)
N_ROUT = 32
# a few points beside the default; routed (no fused routing), so each compiles once per shape
ONE_ROW = {
    "fma_bn32_bk512_w8": dict(block_n=32, block_k=512, num_warps=8, fused_route=False),
    "fma_bn8_bk256_s5": dict(block_n=8, block_k=256, num_stages=5, fused_route=False),
    "dot16_f16_token": dict(rows=16, block_n=64, block_k=128, f16_dot=True, fused_route=False),
}
MANY_ROWS = {
    "dot16_bn128_w8": dict(rows=16, block_n=128, block_k=128, num_warps=8, down_block_n=128, down_block_k=128,
                           down_warps=8, down_mode="expert", fused_route=False),
    "dot16_f16": dict(rows=16, block_n=64, block_k=128, down_block_n=64, down_block_k=128, down_mode="expert",
                      fused_route=False, f16_dot=True),
    "fma_bn32_bk512_w8": ONE_ROW["fma_bn32_bk512_w8"],
}


def hbm_read_tbps(dev) -> float:
    """Measured streaming read rate: a sum over 4 GiB (printed beside the datasheet floor)."""
    a = torch.ones(2**30, dtype=torch.float32, device=dev)
    a.sum()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        a.sum()
    e.record()
    torch.cuda.synchronize()
    return 5 * a.numel() * 4 / (s.elapsed_time(e) * 1e-3) / 1e12


def cell(block, T: int, w, timer, device: str) -> list[dict]:
    """One (shape, T) cell: the default and the points beside it, each checked, then timed; one row each."""
    name = block.name
    space = BACKEND.space(block, "stream_gemv")
    fl = floor(block, "h200", T)
    cases = make_cases(block, w, T, N_ROUT, torch.Generator().manual_seed(T))
    ref = experts_reference(block, cases[0].x, cases[0].ids, cases[0].weights, w)
    default = BACKEND.default(block, "stream_gemv", T)
    cands = [("default", default)]
    for tag, kw in (ONE_ROW if rows_per_active(block, T) <= 1.5 else MANY_ROWS).items():
        s = Schedule("stream_gemv", backend="triton", params=space.make(**kw))
        if s.params != default.params:
            cands.append((tag, s))
    rows = []
    for tag, s in cands:
        row = dict(shape=name, T=T, candidate=tag, params=repr(s.params), floor_us=fl.time_s * 1e6,
                   floor_bound=fl.bound, device=device)
        try:
            fn = BACKEND.build(block, s)
            err = worst_error(fn(cases[0].x, cases[0].ids, cases[0].weights, w), ref)
            row["err"] = err
            if err <= 1:
                t = timer(fn, cases, s)
                row.update(graph_us=t.median_s * 1e6, spread_us=t.spread_s * 1e6,
                           host_us=(t.host_median_s or float("nan")) * 1e6, pct_floor=100 * fl.time_s / t.median_s)
            else:
                row["status"] = "wrong"
        except Exception as e:  # report and go on: one bad candidate must not stop the sweep
            row.update(status="failed", error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        if "graph_us" in row:
            print(f"{name:<18} {T:>3} {tag:<20} {row['graph_us']:>9.1f} {row['host_us']:>9.1f} "
                  f"{row['floor_us']:>9.1f} {row['pct_floor']:>7.1f}% {row['err']:>6.2f}", flush=True)
        else:
            print(f"{name:<18} {T:>3} {tag:<20} {row.get('status')}: {row.get('error', row.get('err'))}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; cells not started by then are skipped")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    t_start = time.perf_counter()
    device = torch.cuda.get_device_name(dev)
    read = hbm_read_tbps(dev)
    timer = CudaGraphTimer(reps=args.reps)
    print(f"device {device}; HBM read measured {read:.2f} TB/s; floor at datasheet rates; timer {timer.name}")
    print(f"{'shape':<18} {'T':>3} {'candidate':<20} {'graph us':>9} {'host us':>9} {'floor us':>9} "
          f"{'% floor':>8} {'err':>6}")
    rows: list[dict] = []
    path = args.out / "fp8_gemv_timing.json"
    skipped = []
    for name in args.shapes.split(","):
        block = preset(name).with_weight_format(WeightFormat.fp8_block())
        w = None
        for T in map(int, args.tokens.split(",")):
            if time.perf_counter() - t_start > args.budget:
                skipped.append(f"{name} T={T}")
                continue
            w = w if w is not None else expert_tensors(block, dev, seed=0)
            rows += cell(block, T, w, timer, device)
            write(path, rows, device, read, timer, skipped, t_start)  # what is done survives a cut-off run
        del w
        torch.cuda.empty_cache()
    out = write(path, rows, device, read, timer, skipped, t_start)
    if skipped:
        print(f"over the --budget of {args.budget:.0f} s, not run: {', '.join(skipped)}")
    print(f"default % of floor: {json.dumps(out['default_pct_floor'])}")
    print(f"best % of floor: {json.dumps(out['best_pct_floor'])}")
    print(f"wrote {path} ({out['seconds']:.0f} s)")


def write(path: Path, rows: list[dict], device: str, read: float, timer, skipped: list[str], t_start: float) -> dict:
    summary: dict = {}
    best: dict = {}
    for r in rows:
        if "pct_floor" not in r:
            continue
        if r["candidate"] == "default":
            summary.setdefault(r["shape"], {})[r["T"]] = round(r["pct_floor"], 1)
        key = f"{r['shape']} T={r['T']}"
        best[key] = max(best.get(key, 0.0), round(r["pct_floor"], 1))
    out = dict(device=device, hbm_read_measured_TBps=read, timer=timer.name, routings=N_ROUT,
               floor="moetune.passes.targets.floor(fp8 block, 'h200', T)", default_pct_floor=summary,
               best_pct_floor=best, not_run=skipped, rows=rows, seconds=time.perf_counter() - t_start)
    path.write_text(json.dumps(out, indent=1))
    return out

if __name__ == "__main__":
    main()
