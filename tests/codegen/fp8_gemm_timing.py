"""Time the FP8 grouped GEMM (moetune/codegen/triton/grouped_gemm_fp8.py) on a GPU against its FP8 floor (not a
test; run on the H200):

    python tests/codegen/fp8_gemm_timing.py --out DIR [--budget 190] [--shapes qwen3-30b-a3b,...] [--tokens 64,...]
                                           [--points default,w8a8_m16_n128_k128,...]

Per cell (the FP8 presets' shapes, 128×128 blocks with fp32 scales, × T) the default and a handful of points of
the space, both act_quant settings: each checked against the float32 reference (moetune.search.objective) on two
of the cell's routings first (a candidate outside its tolerance is reported and not timed), then timed with the
package's CUDA-graph timer (L2 defeated by a reading flush, the mean over the routings of each routing's median
replay). Prints per candidate: time, host-launched time, FP8 floor (moetune.passes.targets.floor), % of floor,
the worst error in units of its tolerance and ‖out − ref‖/‖ref‖; the measured ceilings first (HBM read, FP8
matmul). Writes DIR/fp8-gemm-timing.json. Stops starting new cells once `--budget` seconds have passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moetune.codegen.torch.tolerance import worst_error  # noqa: E402
from moetune.codegen.triton import BACKEND  # noqa: E402
from moetune.ir import MoEBlock, Schedule, UnsupportedSchedule, WeightFormat  # noqa: E402
from moetune.passes.targets import floor  # noqa: E402
from moetune.search.objective import expert_tensors, make_cases, reference  # noqa: E402
from moetune.search.timing import CudaGraphTimer  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3.5-397b-a17b": (512, 10, 4096, 1024),
          "deepseek-v3": (256, 8, 7168, 2048), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = (64, 128, 256, 512, 1024)
POINTS = {  # a handful of points of the space beside the default (names say what differs)
    "w8a8_m16_n128_k128": dict(block_m=16, block_n=128, block_k=128, num_stages=4, down_block_n=128,
                               down_block_k=128, down_stages=4, act_quant="fp8_1x128"),
    "w8a8_m64_n128_k128_w8": dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3,
                                  down_block_n=128, down_block_k=128, down_warps=8, down_stages=3,
                                  act_quant="fp8_1x128"),
    "w8a8_tma_m64_n128_k128_w8_s4": dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=4,
                                         down_block_n=128, down_block_k=128, down_warps=8, down_stages=4,
                                         act_quant="fp8_1x128", tma=True),
    "w8a8_onload_m128_n64_k128_w8": dict(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3,
                                         down_block_n=128, down_block_k=128, down_warps=8, down_stages=3,
                                         act_quant="fp8_1x128", quant_on_load=True),
    "w8a16_tma_m128_n128_k64_w8_s4": dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                                          down_block_n=128, down_block_k=64, down_warps=8, down_stages=4,
                                          tma=True),
}


def ceilings(dev: torch.device) -> dict:
    """Measured HBM streaming read (1 GiB, torch sum) and dense FP8 matmul (8192³, torch._scaled_mm) rates."""
    def t_ms(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / reps

    res = {}
    buf = torch.ones(1 << 28, dtype=torch.float32, device=dev)  # 1 GiB
    res["hbm_read_TBps"] = buf.numel() * 4 / t_ms(buf.sum) / 1e9
    del buf
    n = 8192
    try:
        a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        ms = t_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        res["fp8_matmul_TFLOPs"] = 2 * n**3 / ms / 1e9
    except (RuntimeError, AttributeError) as e:  # a torch without the FP8 matmul
        res["fp8_matmul_TFLOPs"] = f"unavailable: {type(e).__name__}: {e}"
    torch.cuda.empty_cache()
    return res


def n_routings(block: MoEBlock, T: int) -> int:
    """32 routings, fewer where each graph's workspace (h, y) is large, to bound memory and capture time."""
    work = T * block.k * (block.F + 4 * block.D)
    return 32 if work < 2**25 else 16 if work < 2**27 else 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--budget", type=float, default=190.0, help="seconds; no new cell starts after them")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--points", default=",".join(["default", *POINTS]), help="which of default and POINTS")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    ceil = ceilings(dev)
    name = torch.cuda.get_device_name(dev)
    print(f"device {name}; ceilings {json.dumps(ceil)}; floors at 4.8 TB/s and 1979 TFLOP/s (FP8)", flush=True)
    timer = CudaGraphTimer(reps=args.reps)
    records = []
    skipped = []
    for shape in args.shapes.split(","):
        E, k, D, F = SHAPES[shape]
        block = MoEBlock(E=E, k=k, D=D, F=F, name=shape).with_weight_format(WeightFormat.fp8_block())
        w = expert_tensors(block, dev, seed=0)
        space = BACKEND.space(block, "grouped_gemm")
        for T in map(int, args.tokens.split(",")):
            if time.perf_counter() - t0 > args.budget:
                skipped.append(f"{shape}/T{T}")
                continue
            fl = floor(block, "h200", T)
            cases = make_cases(block, w, T, n_routings(block, T), torch.Generator().manual_seed(T))
            refs = [reference(block, c) for c in cases[:2]]
            chosen = args.points.split(",")
            points = [("default", BACKEND.default(block, "grouped_gemm", T).params)] if "default" in chosen else []
            points += [(tag, space.make(**g)) for tag, g in POINTS.items() if tag in chosen]
            for tag, p in points:
                rec = dict(shape=shape, T=T, point=tag, params=repr(p), act_quant=p.act_quant,
                           floor_us=fl.time_s * 1e6, bound=fl.bound, routings=len(cases), device=name)
                a8 = p.act_quant != "none"
                try:
                    fn = BACKEND.build(block, Schedule("grouped_gemm", backend="triton", params=p))
                    outs = [fn(c.x, c.ids, c.weights, c.w) for c in cases[:2]]
                except UnsupportedSchedule as e:
                    rec.update(status="refused", reason=str(e))
                    records.append(rec)
                    print(f"{shape:18s} T={T:5d} {tag:32s} refused: {e}", flush=True)
                    continue
                err = max(worst_error(o, r, a8=a8) for o, r in zip(outs, refs, strict=True))
                rel = max(((o.float() - r).norm() / r.norm()).item() for o, r in zip(outs, refs, strict=True))
                rec.update(worst_error=err, rel_err=rel)
                if not err <= 1:
                    rec.update(status="wrong")
                    records.append(rec)
                    print(f"{shape:18s} T={T:5d} {tag:32s} WRONG: worst error {err:.3g}× tolerance, rel {rel:.3g}",
                          flush=True)
                    continue
                tm = timer(fn, cases)
                pct = 100 * fl.time_s / tm.median_s
                rec.update(status="ok", time_us=tm.median_s * 1e6, spread_us=tm.spread_s * 1e6,
                           host_us=(tm.host_median_s or 0) * 1e6, pct_floor=pct, method=tm.method)
                records.append(rec)
                print(f"{shape:18s} T={T:5d} {tag:32s} {tm.median_s * 1e6:9.1f} µs (host {rec['host_us']:8.1f}) "
                      f"floor {fl.time_s * 1e6:8.1f} µs {fl.bound:7s} {pct:5.1f} % | worst {err:.2f}× tol, "
                      f"rel {rel:.2e}", flush=True)
                del fn, outs
            del cases, refs
            torch.cuda.empty_cache()
        del w
        torch.cuda.empty_cache()
    best = {}
    for r in records:
        if r["status"] == "ok":
            key = (r["shape"], r["T"])
            if key not in best or r["time_us"] < best[key]["time_us"]:
                best[key] = r
    print("\nbest per cell:")
    for (shape, T), r in best.items():
        print(f"{shape:18s} T={T:5d} {r['point']:32s} {r['time_us']:9.1f} µs  {r['pct_floor']:5.1f} % of FP8 floor "
              f"(act_quant {r['act_quant']})")
    if skipped:
        print(f"not timed (budget {args.budget:g} s): {', '.join(skipped)}")
    out = args.out / "fp8-gemm-timing.json"
    out.write_text(json.dumps(dict(device=name, ceilings=ceil, records=records, skipped=skipped,
                                   seconds=time.perf_counter() - t0), indent=1))
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
