"""Prototype, not in the package: the TMA grouped GEMM as a persistent kernel, one program per SM.

Why: the large-T cells are the furthest from their targets (mixtral-8x7b T = 512 / 1024 at 61 / 49 % of
the floor, 961 / 1500 µs; cuBLAS on the same multiplications with balanced experts 824 / 1313 µs;
bench/results/NOTES.md). The shipped TMA kernel launches one program per (row tile, column block) of an
upper bound of the tiles (`max_tiles`): 13–20 waves at mixtral T = 1024, each program's loads starting
only when its SM frees, its epilogue (SwiGLU, stores) not overlapped with anything. Here:

    grid      min(tiles bound, SMs) programs; each walks tile ids pid, pid + grid, … over the REAL tiles
              (Σ_e ⌈m_e / BM⌉ column blocks × splits, counted in-kernel from counts: no empty programs)
    loop      `tl.range(…, flatten=FLATTEN)`: with FLATTEN, Triton pipelines the K loop across tile
              boundaries (the next tile's first TMA loads issue during this tile's last steps and epilogue)
    body      as grouped_gemm_tma_kernel: two dots (gate, up) + SwiGLU store of h in sorted order; down
              with the routing weight, split-K fp32 partial planes, the package's combine

Same schedule parameters as `GemmParams(tma=True)` (block sizes, group_m, warps, stages, split_k). The
tile body repeats grouped_gemm_tma_kernel's: factored into one jit helper shared by both, the package's
down kernels compile to other PTX (digests of the shipped winners change), which would stale the table.
If the prototype wins, it moves into the package as one kernel with a re-tune.

    python3 bench/proto_persistent_gemm.py --out $OUT      # on the H200: each cell's table schedule and
                                                            # its persistent twins, checked, then timed
    TRITON_INTERPRET=0 PYTHONPATH=. python bench/proto_persistent_gemm.py --sm90   # resources, on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetune.codegen.common import ExpertTensors  # noqa: E402
from moetune.codegen.triton import combine as _combine  # noqa: E402
from moetune.codegen.triton import routing  # noqa: E402
from moetune.codegen.triton._common import (  # noqa: E402
    _find_tile,
    _grouped_tile,
    _store_h,
    _store_y,
    act_args,
    call_args,
    cdiv,
)
from moetune.codegen.triton.grouped_gemm import GemmParams, _desc, max_tiles, tma_refusal  # noqa: E402
from moetune.ir import MoEBlock, UnsupportedSchedule  # noqa: E402


@triton.jit(do_not_specialize=["P"])
def persistent_tma_kernel(
    a_desc, b_desc, wts_ptr, counts_ptr, sorted_ptr, b_ptr, sbe, sbn, bup,
    h_ptr, y_ptr, P, E, N, K, k_split, S, n_prog, alpha, limit,
    BLOCK_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PROJ: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_IN: tl.constexpr, UPCAST: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    ei = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + ei, mask=ei < E, other=0)  # [BLOCK_E]
    n_mt = tl.sum((cnt + BM - 1) // BM, axis=0)  # real row tiles of this routing
    per_split = n_mt * tl.cdiv(N, BN)
    for t in tl.range(tl.program_id(0), per_split * S, n_prog, flatten=FLATTEN):
        ks = t // per_split
        tile, n0 = _grouped_tile(t % per_split, n_mt, N, BN, GROUP_M)
        e, row0, left = _find_tile(counts_ptr, E, tile, BM, 0, False, BLOCK_E)
        r = tl.arange(0, BM)
        rmask = r < left
        pairs = tl.load(sorted_ptr + row0 + r, mask=rmask, other=0)  # [BM]
        wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)  # [BM]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if PROJ == 0:
            accu = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                a = a_desc.load([row0, k0])  # [BM, BK]
                bg = b_desc.load([e * 2 * N + n0, k0])  # [BN, BK]
                bu = b_desc.load([e * 2 * N + N + n0, k0])  # [BN, BK]
                if UPCAST:
                    a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
                acc = tl.dot(a, bg.T, acc)
                accu = tl.dot(a, bu.T, accu)
            _store_h(h_ptr, N, row0 + r, rmask, acc, accu, wt, b_ptr + e * sbe, sbn, bup, n0, N, alpha, limit,
                     BN, ACT, HAS_BIAS, W_IN)
        else:
            k_lo = ks * k_split
            for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BK):
                a = a_desc.load([row0, k0])  # [BM, BK]
                b = b_desc.load([e * N + n0, k0])  # [BN, BK]
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b.T, acc)
            _store_y(y_ptr + ks.to(tl.int64) * P * N, pairs, rmask, acc, wt, b_ptr + e * sbe, sbn,
                     (ks == 0).to(tl.float32), n0, N, BN, HAS_BIAS, W_IN)


_SMS: dict = {}


def programs(device: torch.device, bound: int) -> int:
    """One program per SM (the tiles' shared memory allows one), at most `bound`; 4 when interpreting."""
    if device.type != "cuda":
        return max(1, min(bound, 4))
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(bound, _SMS[device]))


def build(block: MoEBlock, p: GemmParams, flatten: bool):
    """ExpertsFn of the persistent twin of the TMA schedule `p` (standard layout, as its package kernel)."""
    if not p.tma:
        raise UnsupportedSchedule("the persistent prototype is the TMA path's twin: GemmParams(tma=True)")
    why = tma_refusal(block)
    if why:
        raise UnsupportedSchedule(why)
    E, D, F = block.E, block.D, block.F
    alpha, limit = act_args(block)
    memo: dict = {}

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertTensors) -> torch.Tensor:
        a = call_args(block, x, ids, weights, w, memo)
        T, P, gs, ds, wts_f = a.T, a.P, a.gs, a.ds, a.weights
        gu, dn = w.gate_up, w.down
        gu_desc = _desc(gu, E * 2 * F, D, gs.sn, [p.block_n, p.block_k])
        dn_desc = _desc(dn, E * D, F, ds.sn, [p.down_block_n, p.down_block_k])
        counts, sorted_pairs = routing.route(ids, E)
        meta = {n: v for n, v in a.meta.items() if n != "K_TOP"}
        meta.update(BM=p.block_m, GROUP_M=p.group_m, FLATTEN=flatten)
        nt = max_tiles(P, E, p.block_m)
        rows = max(P, 1)
        xs = routing.gather(x, counts, sorted_pairs, block.k, gu.dtype)  # [P, D] sorted token rows
        h = torch.empty(rows, F, dtype=gu.dtype, device=x.device)  # [P, F] sorted order
        g = programs(x.device, nt * cdiv(F, p.block_n))
        persistent_tma_kernel[(g,)](
            _desc(xs, rows, D, D, [p.block_m, p.block_k]), gu_desc,
            wts_f, counts, sorted_pairs, a.gate_up_bias, gs.sbe, gs.sbn, gs.bup,
            h, h, P, E, F, D, D, 1, g, alpha, limit,
            PROJ=0, BN=p.block_n, BK=p.block_k, num_warps=p.num_warps, num_stages=p.num_stages, **meta)
        k_split = cdiv(cdiv(F, p.split_k), p.down_block_k) * p.down_block_k
        S = cdiv(F, k_split)
        y = torch.empty(S, P, D, dtype=torch.float32, device=x.device)  # [S, P, D]
        g = programs(x.device, nt * cdiv(D, p.down_block_n) * S)
        persistent_tma_kernel[(g,)](
            _desc(h, rows, F, F, [p.block_m, p.down_block_k]), dn_desc,
            wts_f, counts, sorted_pairs, a.down_bias, ds.sbe, ds.sbn, 0,
            h, y, P, E, D, F, k_split, S, g, alpha, limit,
            PROJ=1, BN=p.down_block_n, BK=p.down_block_k, num_warps=p.down_warps, num_stages=p.down_stages,
            **meta)
        return _combine.combine(y, ids, torch.empty(T, D, dtype=x.dtype, device=x.device), E)

    return run


CELLS = "mixtral-8x7b:256,mixtral-8x7b:512,mixtral-8x7b:1024,qwen3-30b-a3b:512,qwen3-30b-a3b:1024," \
        "deepseek-v3:1024,qwen3.5-397b-a17b:1024"


def sm90_resources() -> None:
    """Compile both projections for sm_90 on this machine (no GPU needed) with mixtral-8x7b's shipped TMA
    tile (128 × 128 × 64, 8 warps, 4 stages; down 128 × 256), with and without flatten; print registers,
    spills and shared memory (tests/codegen/triton_sm90.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "codegen"))
    import triton_sm90 as S

    base = dict(ACT=0, HAS_BIAS=False, W_IN=False, UPCAST=False, BLOCK_E=16, GROUP_M=8)
    for flatten in (False, True):
        for proj, bn in ((0, 128), (1, 256)):
            k = S.compile_sm90(persistent_tma_kernel, dict(base, PROJ=proj, BM=128, BN=bn, BK=64, FLATTEN=flatten),
                               num_warps=8, num_stages=4, descs=S.tma_descs(128, bn, 64))
            regs, spills = S.ptxas_usage(k)
            print(f"flatten={flatten!s:5} {'gate/up' if proj == 0 else 'down':7}: {regs} registers, "
                  f"{spills} B spilled, {k.metadata.shared} B shared memory")


def main() -> None:
    if "--sm90" in sys.argv:  # TRITON_INTERPRET=0 PYTHONPATH=. python bench/proto_persistent_gemm.py --sm90
        sm90_resources()
        return
    import kernels as B  # bench/kernels.py: the same weights, routings, reference, flush and timer

    from moetune.codegen.triton import BACKEND
    from moetune.search.objective import Case, reference

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--table", default="cache/h200.sqlite")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this path (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    flush = torch.randn(128 * 1024 * 1024 if dev.type == "cuda" else 16, dtype=torch.bfloat16, device=dev)
    rows = []
    for cell in args.cells.split(","):
        shape, T = cell.split(":")
        T = int(T)
        E, k, D, F = B.SHAPES[shape]
        block = MoEBlock(E=E, k=k, D=D, F=F, name=shape)
        w = B.expert_weights(E, D, F, dev)
        sets = B.routings(T, E, k, D, dev, seed=1000 + T)
        distinct = statistics.mean(len(torch.unique(s[1])) for s in sets)
        fl = B.floor_us(E, k, D, F, T, distinct)
        x0, ids0, wt0 = sets[0]
        ref = reference(block, Case(x0, ids0, wt0, w))
        cands = []
        for tag, s in B.table_variant(args.table, shape, T):
            p = s.params
            tma = p if p.tma else dataclasses.replace(p, tma=True, one_dot=False)
            cands.append((tag, BACKEND.build(block, s)))
            if not p.tma:
                cands.append((tag + "-t", BACKEND.build(block, dataclasses.replace(s, params=tma))))
            for flatten in (False, True):
                cands.append((tag + ("-pf" if flatten else "-p"), build(block, tma, flatten)))
        for tag, fn in cands:
            rec = dict(shape=shape, tokens=T, impl=tag, floor_us=fl)
            try:
                rec["rel_err"] = B.rel_err(fn(x0, ids0, wt0, w), ref)
                if rec["rel_err"] < 1e-2:
                    t_us, rec["graph_rel_err"], rec["routing_mean_us"] = B.graph_checked_time(fn, sets, w, flush, ref)
                    if t_us is not None:
                        rec["time_us"], rec["pct_floor"] = t_us, 100 * fl / t_us
            except Exception as exc:  # noqa: BLE001 - a failing variant is recorded, the sweep goes on
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                torch.cuda.synchronize()
            rows.append(rec)
            print(json.dumps(rec), flush=True)
        del w
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "proto-persistent-gemm.json").write_text(json.dumps(rows, indent=1))
    print(f"{'cell':24s} {'variant':10s} {'µs':>9s} {'% floor':>8s} {'rel_err':>8s}")
    for r in rows:
        t = f"{r['time_us']:9.1f} {r['pct_floor']:7.1f}%" if "time_us" in r else f"{r.get('error', '–')[:40]:>18s}"
        print(f"{r['shape'] + ' T=' + str(r['tokens']):24s} {r['impl']:10s} {t} {r.get('rel_err', float('nan')):8.1e}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
