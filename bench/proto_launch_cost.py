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
import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    import kernels as B  # bench/kernels.py: its graph timing (flush, warm-up, median of 100)
    import torch

    flush = torch.randn(128 * 1024 * 1024, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(128, dtype=torch.float32, device="cuda")
    table = {}
    for kb in (16, 112, 224):
        for launches in (1, 2):
            def fn(x, ids, wt, w, kb=kb, launches=launches):
                for _ in range(launches):
                    touch_kernel[(128,)](out, ROWS=kb * 2, num_warps=4)  # 512 B a row
                return out

            med, times, _ = B.time_graph(fn, [(None, None, None)] * 2, None, flush)
            table[f"{kb} KB x{launches}"] = (med, min(times))
    if args.out:
        Path(args.out, "proto_launch_cost.json").write_text(json.dumps(table, indent=1))
    for key, (med, low) in table.items():
        print(f"{key:>12}: median {med:.2f} µs, min {low:.2f} µs")


if __name__ == "__main__":
    main()
