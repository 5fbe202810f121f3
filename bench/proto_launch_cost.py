"""What a launch of 128 programs costs by itself, with a little or with nearly all of the SM's shared memory
(one H200 call, the bench's method: CUDA graph, 256 MB L2 flush before each replay, median of 100).

Why: bench/proto_small_t.py's one-launch kernel (~225 KB of shared memory per program) takes 4-5 µs longer in
a graph replay than its own first-to-last program time stamps (bench/results/NOTES.md, Session 10 item 7). An
empty kernel that only allocates and touches S bytes of shared memory, once and twice in a row, separates the
launch's own cost from the kernel's.

    python3 bench/proto_launch_cost.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def touch_kernel(out_ptr, ROWS: gl.constexpr, num_warps: gl.constexpr):
    """Allocates ROWS × 256 bf16 of shared memory, writes and reads one row of it, stores one value."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    buf = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 1, 256], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    row = buf.index(ROWS - 1)
    row.store(gl.full([1, 256], 1.0, gl.bfloat16, L))
    v = gl.sum(gl.sum(row.load(L).to(gl.float32), axis=1), axis=0)
    gl.store(out_ptr + gl.program_id(0), v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    dev = "cuda"
    flush = torch.randn(128 * 1024 * 1024, dtype=torch.bfloat16, device=dev)
    out = torch.empty(128, dtype=torch.float32, device=dev)
    rows = []
    for kb in (16, 112, 224):
        for launches in (1, 2):
            def fn(kb=kb, launches=launches):
                for _ in range(launches):
                    touch_kernel[(128,)](out, ROWS=kb * 2, num_warps=4)  # 512 B a row

            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            ts = []
            for _ in range(100):
                flush.sum()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            rec = dict(shared_kb=kb, launches=launches, time_us=statistics.median(ts), min_us=min(ts))
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    if args.out:
        Path(args.out, "proto_launch_cost.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'shared KB':>9} {'launches':>8} {'median µs':>9} {'min µs':>7}")
    for r in rows:
        print(f"{r['shared_kb']:9} {r['launches']:8} {r['time_us']:9.2f} {r['min_us']:7.2f}")


if __name__ == "__main__":
    main()
