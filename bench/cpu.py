"""cpu: this machine's CPU ceilings (stream add bandwidth, fp32 matmul rate), for the `cpu` row of the target table.

    python -m bench cpu

Stream bandwidth: numpy `np.add(a, b, out=c)` over 3 × 256 MiB float32 arrays (STREAM "add":
2 reads + 1 write per element, 12 bytes counted), best of 10. Matmul: `torch.mm` fp32 2048³
with torch's default thread count, best of 5. The figures go into `moetune/targets.py` by hand, with the
date; they are the roofs the CPU floors are quoted against.
"""

from __future__ import annotations

import os
import time

import numpy as np


def stream_add_bandwidth(mib: int = 256, reps: int = 10) -> float:
    n = mib * 2**20 // 4
    a = np.ones(n, np.float32)  # [n]
    b = np.full(n, 2.0, np.float32)  # [n]
    c = np.empty(n, np.float32)  # [n]
    np.add(a, b, out=c)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.add(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 3 * 4 * n / best


def matmul_rate(n: int = 2048, reps: int = 5) -> tuple[float, int]:
    import torch

    a = torch.randn(n, n)  # [n, n]
    b = torch.randn(n, n)  # [n, n]
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best, torch.get_num_threads()


def add_arguments(ap) -> None:
    pass


def run(args) -> int:
    bw = stream_add_bandwidth()
    fl, threads = matmul_rate()
    print(f"date {time.strftime('%Y-%m-%d', time.gmtime())}  cpus {os.cpu_count()}")
    print(f"stream add bandwidth {bw / 1e9:.2f} GB/s")
    print(f"fp32 matmul 2048^3   {fl / 1e9:.1f} GFLOP/s ({threads} threads)")
    return 0
