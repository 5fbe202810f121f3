"""readfloor: what kernels that only stream the bytes take at the sizes of small-T blocks (GPU).

The realistic floor of a launch at a given byte count, ramp and tail included: for each case (a preset's selected
experts' weight bytes at T tokens, from `moetune.passes.stats.uniform_distinct` and the block's bytes per expert),
one streaming read (`bench.kernels.read_kernel`, the read ceiling's kernel) of all of them, and two reading the
gate/up and the down shares one after the other, each at several grid shapes (the best kept); and 1, 2 and 3 empty
kernels (the fixed cost of a replay).
Timed by the package's timer (`moetune.search.timing.CudaGraphTimer`: a CUDA graph, a 256 MB read before every
replay, CUDA events); distinct windows of one buffer per kernel.

    python -m bench readfloor --cells qwen3-30b-a3b-fp8:1,qwen3-30b-a3b:1,qwen3.5-397b-a17b-fp8:1 --out DIR

Writes DIR/<device>-read-floor.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.cells import device_stem
from moetune.ir.presets import PRESETS, preset
from moetune.passes.stats import uniform_distinct
from moetune.search.timing import Case, CudaGraphTimer

CELLS = "qwen3-30b-a3b-fp8:1,qwen3-30b-a3b:1,qwen3.5-397b-a17b-fp8:1,qwen3.5-397b-a17b:1"
GRIDS = ((4, 4096, 8), (8, 4096, 8), (2, 8192, 8), (16, 2048, 4), (8, 8192, 8))  # (programs per SM, BLOCK, warps)


def _empty_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def empty(dst):
        tl.store(dst + tl.program_id(0), 1.0)

    return empty


def cell_bytes(name: str, T: int) -> tuple[int, int]:
    """(gate/up bytes, down bytes) of the experts `name` selects at T tokens on uniform routing."""
    block = preset(name)
    per = block.weight_bytes_per_expert * uniform_distinct(block.E, block.k, T)
    return int(per * 2 / 3), int(per / 3)


def add_arguments(ap) -> None:
    ap.add_argument("--cells", default=CELLS, help=f"preset:T,... (presets: {', '.join(PRESETS)})")
    ap.add_argument("--out", default="bench/results")


def run(args) -> int:
    if not torch.cuda.is_available():
        print("bench readfloor: no CUDA device here (it times GPU reads)", file=sys.stderr)
        return 2
    from bench.kernels import read_kernel as read

    empty = _empty_kernel()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cells = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cells.split(",")]
    most = max(sum(cell_bytes(n, T)) for n, T in cells)
    pool = torch.randint(0, 100, (most + (2 << 20),), dtype=torch.uint8, device=dev)
    dst = torch.empty(sms * 16, dtype=torch.float32, device=dev)
    timer = CudaGraphTimer(reps=200)
    case = [Case(dst, dst, dst, None)]

    def timed(fn) -> float:
        return timer(lambda *_: fn(), case).median_s * 1e6

    def reads(sizes, per_sm, blk, warps):
        def fn():
            off = 0
            for size in sizes:
                read[(sms * per_sm,)](pool[off:off + size], dst, size, BLOCK=blk, num_warps=warps)
                off += size + (1 << 20)
            return dst
        return fn

    recs = []
    for name, T in cells:
        gu, dn = cell_bytes(name, T)
        for label, sizes in (("one kernel", [gu + dn]), ("two kernels", [gu, dn])):
            times = {g: timed(reads(sizes, *g)) for g in GRIDS}
            (per_sm, blk, warps), us = min(times.items(), key=lambda kv: kv[1])
            recs.append(dict(cell=f"{name}:{T}", kernels=label, bytes=sum(sizes), us=us,
                             TBps=sum(sizes) / us / 1e6, grid=sms * per_sm, BLOCK=blk, warps=warps,
                             every_grid={f"{sms * g[0]}x{g[1]}/{g[2]}w": t for g, t in times.items()}))
            print(f"{name}:{T:<4d} {label:12s} {sum(sizes) / 2**20:8.1f} MiB {us:8.2f} µs "
                  f"{recs[-1]['TBps']:.2f} TB/s", flush=True)
    for n in (1, 2, 3):
        def fn(n=n):
            for _ in range(n):
                empty[(sms * 4,)](dst, num_warps=4)
            return dst
        recs.append(dict(cell=None, kernels=f"{n} empty", us=timed(fn)))
        print(f"{n} empty kernel(s): {recs[-1]['us']:.2f} µs", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{device_stem()}-read-floor.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev),
                                                                 timer=timer.name, records=recs), indent=1))
    return 0
