"""Prototypes for the two small launches around the GEMMs at large T (not in the package; one H200 call
checks and times them beside the package's kernels).

ncu on the H200 (bench/results/h200-s9/README.md, call 4), qwen3-30b-a3b T = 1024: routing 7.5 + 10.5 µs
(two launches), combine 14.2 µs for 33.6 MB (2.4 TB/s), against 380 µs for the whole block.

Combine (y [S, P, D] → out [T, D], the sum over each token's k rows):
  package   moetune.codegen.triton.combine: one row at a time inside a runtime loop over the S splits.
  t         the k rows as one [BD, KP] tile (D the contiguous axis), BD = one 16-byte vector per thread
            over all threads, so each thread holds its vector of all k rows: all loads in flight at once
            and the sum inside each thread (sm_90 PTX: no bar.sync, no shuffle; at BD = 512 and 4 warps,
            bf16, the compiler spreads k over threads and reduces through shared memory, as session 9's
            [KP, BD] tile did, which was 2-4x slower than the package's kernel).
Routing (ids [T, k] → counts [E], stable expert-sorted pairs [P]):
  package   moetune.codegen.triton.routing.route: histogram launch, then prefix + scatter launch.
  one       both phases in ONE launch of G ≤ 64 programs (all co-resident on 132 SMs): after storing its
            histogram row a program passes a CTA barrier, adds 1 to a device counter with release
            semantics and spins with acquire loads until all G have; the last program to finish zeroes
            the counter (the pattern that session 9's one-launch GEMV ran correctly on the H200). The
            interpreter runs programs one after another, so it can check this only with G = 1.

    python3 bench/proto_route_combine.py --out DIR [--reps 200]         # GPU: check, then time; table last
    TRITON_INTERPRET=1 python bench/proto_route_combine.py --device cpu  # CPU: the checks, small shapes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import SHAPES  # noqa: E402  (bench/kernels.py: name → (E, k, D, F))

from moetune.codegen.triton import combine as pkg_combine  # noqa: E402
from moetune.codegen.triton import routing as pkg_routing  # noqa: E402
from moetune.codegen.triton._common import cdiv, next_pow2  # noqa: E402

CELLS = {f"{name}:{T}": (*SHAPES[name][:3], T)  # name: (E, k, D, T)
         for name, T in (("qwen3-30b-a3b", 256), ("qwen3-30b-a3b", 1024), ("deepseek-v3", 1024),
                         ("qwen3.5-397b-a17b", 1024), ("mixtral-8x7b", 1024))}
CPU_CELLS = {"small:k8": (16, 8, 200, 9), "small:k2": (8, 2, 96, 5)}


# --------------------------------------------------------------------------------------------- combine


@triton.jit(do_not_specialize=["P"])
def combine_t_kernel(y_ptr, ids_ptr, out_ptr, s_ot, P, E, N,
                     S: tl.constexpr, K_TOP: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)  # [BD]
    nm = offs < N
    jk = tl.arange(0, KP)
    p = t * K_TOP + jk  # [KP]
    e = tl.load(ids_ptr + p, mask=jk < K_TOP, other=-1).to(tl.int32)
    ok = (jk < K_TOP) & (e >= 0) & (e < E)
    acc = tl.zeros([BD], dtype=tl.float32)
    for s in tl.static_range(S):
        tile = y_ptr + (s * P + p).to(tl.int64)[None, :] * N + offs[:, None]  # [BD, KP]
        acc += tl.sum(tl.load(tile, mask=nm[:, None] & ok[None, :], other=0.0).to(tl.float32), axis=1)
    tl.store(out_ptr + t.to(tl.int64) * s_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=nm)


def combine_variant(name: str, y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, E: int):
    """out [T, D] = Σ over each token's k rows (and the S splits) of y [S, P, D], by variant `name`."""
    S, P, D = y.shape
    T, k = ids.shape
    if name == "package":
        return pkg_combine.combine(y, ids, out, E)
    if name == "t":  # BD = one 16-byte vector per thread across all threads: k stays in each thread
        vec = 16 // y.element_size()
        warps = max(1, min(4, next_pow2(D) // (32 * vec)))
        bd = 32 * vec * warps
        combine_t_kernel[(T, cdiv(D, bd))](y, ids, out, out.stride(0), P, E, D, S=S, K_TOP=k, KP=next_pow2(k),
                                           BD=bd, num_warps=warps)
    else:
        raise ValueError(name)
    return out


# --------------------------------------------------------------------------------------------- routing


@triton.jit(do_not_specialize=["P", "per_prog", "G"])
def route_one_kernel(ids_ptr, counts_ptr, hist_ptr, sorted_ptr, sync_ptr, P, E, per_prog, G,
                     BLOCK_E: tl.constexpr, C: tl.constexpr, GB: tl.constexpr):
    """The package's two routing phases (routing.route_kernel PHASE 0, then PHASE 1: its helpers) with a
    grid barrier between them (module doc)."""
    g = tl.program_id(0)
    ei = tl.arange(0, BLOCK_E)
    lo = g * per_prog
    hi = tl.minimum(lo + per_prog, P)
    tl.store(hist_ptr + g * BLOCK_E + ei, pkg_routing._histogram(ids_ptr, lo, hi, ei, BLOCK_E, C))
    tl.debug_barrier()  # every thread's histogram stores before the one-thread release below
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < G:
        pass
    cnt, before = pkg_routing._hist_prefix(hist_ptr, g, G, ei, BLOCK_E, GB)
    tl.store(counts_ptr + ei, cnt, mask=(ei < E) & (g == 0))
    pkg_routing._scatter(ids_ptr, sorted_ptr, lo, hi, E, ei, tl.cumsum(cnt, axis=0) - cnt + before, C)
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:  # the last one out: reset
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


_SYNC: dict = {}


def route_variant(name: str, ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "package":
        return pkg_routing.route(ids, E)
    if name != "one":
        raise ValueError(name)
    flat = ids.reshape(-1)  # [P]
    P = flat.numel()
    block_e, c, per, g = pkg_routing.route_plan(P, E)
    sync = _SYNC.get(ids.device)
    if sync is None:
        sync = _SYNC[ids.device] = torch.zeros(2, dtype=torch.int32, device=ids.device)
    counts = torch.empty(E, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(max(P, 1), dtype=torch.int32, device=ids.device)
    hist = torch.empty(g * block_e, dtype=torch.int32, device=ids.device)
    route_one_kernel[(g,)](flat, counts, hist, sorted_pairs, sync, P, E, per, g, BLOCK_E=block_e, C=c,
                           GB=pkg_routing._hist_rows(g, block_e), num_warps=4)
    return counts, sorted_pairs


# ---------------------------------------------------------------------------------------------- checks


def make_ids(T: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])  # [T, k]


def check_combine(name: str, cell: tuple, dev: str, gen: torch.Generator) -> float:
    E, k, D, T = cell
    P = T * k
    ids = make_ids(T, E, k, gen)
    ids[0, 0] = -1  # a sentinel pair: left out of the sum
    errs = []
    for S, dtype in ((1, torch.bfloat16), (2, torch.float32)):
        y = torch.randn(S, P, D, generator=gen).to(dtype)  # [S, P, D]
        keep = ((ids >= 0) & (ids < E)).reshape(1, P, 1)
        ref = (y.float() * keep).sum(0).view(T, k, D).sum(1)  # [T, D]
        out = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device=dev)
        got = combine_variant(name, y.to(dev), ids.to(dev), out, E).float().cpu()
        errs.append(((got - ref).norm() / ref.norm()).item())
    return max(errs)


def check_route(name: str, cell: tuple, dev: str, gen: torch.Generator) -> bool:
    E, k, _, T = cell
    ids = make_ids(T, E, k, gen)
    flat = ids.reshape(-1)
    counts, order = route_variant(name, ids.to(dev), E)
    ok = torch.equal(counts.cpu(), torch.bincount(flat, minlength=E).to(torch.int32))
    return ok and torch.equal(order.cpu().long(), torch.sort(flat, stable=True).indices)


# -------------------------------------------------------------------------------------------------- time


def graph_time_us(fn, reps: int = 200) -> float:
    """Median µs of CUDA-graph replays of fn, each after a 256 MB read that flushes L2."""
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.float32, device="cuda")
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        flush.sum()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=200, help="graph replays timed per variant (ncu: a few)")
    args = ap.parse_args()
    dev = args.device
    cells = CELLS if dev == "cuda" else CPU_CELLS
    gen = torch.Generator().manual_seed(0)
    rows = []
    for cname, cell in cells.items():
        E, k, D, T = cell
        for v in ("package", "t"):
            err = check_combine(v, cell, dev, gen)
            r = dict(cell=cname, op="combine", variant=v, rel_err=err, ok=err < 1e-2)
            if dev == "cuda" and r["ok"]:
                y = torch.randn(1, T * k, D, device=dev).to(torch.bfloat16)
                ids = make_ids(T, E, k, gen).to(dev)
                out = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
                r["time_us"] = graph_time_us(lambda v=v, y=y, ids=ids, out=out, E=E: combine_variant(v, y, ids, out, E),
                                             args.reps)
                r["gbps"] = (T * k * D * 2 + T * D * 2) / r["time_us"] / 1e3
            rows.append(r)
        for v in ("package", "one"):
            if v == "one" and dev != "cuda" and pkg_routing.route_plan(T * k, E)[3] > 1:
                continue  # the interpreter runs programs one by one: a grid barrier of G > 1 cannot pass
            r = dict(cell=cname, op="route", variant=v, ok=check_route(v, cell, dev, gen))
            if dev == "cuda" and r["ok"]:
                ids = make_ids(T, E, k, gen).to(dev)
                r["time_us"] = graph_time_us(lambda v=v, ids=ids, E=E: route_variant(v, ids, E), args.reps)
                for _ in range(20):  # back-to-back calls after the graph: the counter returned to zero
                    r["ok"] = r["ok"] and check_route(v, cell, dev, gen)
            rows.append(r)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "proto_route_combine.json").write_text(json.dumps(rows, indent=1))
    print(f"{'cell':24s} {'op':8s} {'variant':8s} {'ok':>3s} {'rel_err':>9s} {'µs':>8s} {'GB/s':>7s}")
    for r in rows:
        print(f"{r['cell']:24s} {r['op']:8s} {r['variant']:8s} {'yes' if r['ok'] else 'NO':>3s} "
              f"{r.get('rel_err', float('nan')):9.1e} {r.get('time_us', float('nan')):8.1f} "
              f"{r.get('gbps', float('nan')):7.0f}")
    if not all(r["ok"] for r in rows):
        raise SystemExit("a prototype failed its check")


if __name__ == "__main__":
    main()
