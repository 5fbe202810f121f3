"""Probe (not in the package): does the down projection's access pattern alone stream slower than the gate/up's?

Why (bench/results/NOTES.md, Session 11 items 1-2): at few tokens the down kernels reach 55-78 % of DRAM peak
where the gate/up kernels of the same schedule reach 63-88 % (ncu), and walking several D-blocks per program
(down_nb) recovered only 1-3 %. These kernels do no arithmetic beyond a sum that keeps the loads alive: they
read the selected experts' weights with each addressing pattern of the package's kernels, so what they take
is the pattern's own cost.

    token   the token-mode down's: program (token, D-block of BN rows), a [KP, BN, BK] tile of all the token's
            k experts per K step (k streams in flight per program; an expert shared by tokens is read again)
    expert  program (distinct expert, block of BN rows), a [BN, BK] tile of one expert per K step (the
            expert-mode down and the gate/up GEMV's pattern)
    linear  program (distinct expert, contiguous chunk of CH elements of its matrix), [BLOCK] per step (the
            ideal stream: the one-launch read bound of the same bytes)

on the down weights [E, D, F] and, for reference, the gate/up weights [E, 2F, D]. Each is checked against
torch's sums of the same elements, then timed with the bench's method (graph replays, 256 MB read flush, median
of 100 over 32 routings). GB/s are of the distinct experts' bytes.

    python3 bench/proto_read_pattern.py --out DIR                 # H200; the table last
    TRITON_INTERPRET=1 python bench/proto_read_pattern.py --device cpu   # CPU: checks only, tiny shape
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


@triton.jit
def read_token_kernel(w_ptr, se, sn, ids_ptr, out_ptr, N, K, K_TOP: tl.constexpr, KP: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = offs_n < N
    jk = tl.arange(0, KP)
    jm = jk < K_TOP
    e = tl.load(ids_ptr + t * K_TOP + jk, mask=jm, other=0).to(tl.int64)
    wbase = w_ptr + e[:, None, None] * se + offs_n[None, :, None] * sn  # [KP, BN, 1]
    acc = tl.zeros([KP, BN, BK], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        m = jm[:, None, None] & nm[None, :, None] & (offs_k < K)[None, None, :]
        acc += tl.load(wbase + offs_k[None, None, :], mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + t * N + offs_n, tl.sum(tl.sum(acc, axis=2), axis=0), mask=nm)


@triton.jit
def read_expert_kernel(w_ptr, se, sn, uniq_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr,
                       STAGES: tl.constexpr):
    slot = tl.program_id(0)
    e = tl.load(uniq_ptr + slot)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = offs_n < N
    k_end = tl.where(e >= 0, K, 0)  # a slot past the distinct experts reads nothing
    wbase = w_ptr + tl.maximum(e, 0).to(tl.int64) * se + offs_n[:, None] * sn  # [BN, 1]
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in tl.range(0, k_end, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        acc += tl.load(wbase + offs_k[None, :], mask=nm[:, None] & (offs_k < K)[None, :], other=0.0,
                       eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + slot * N + offs_n, tl.sum(acc, axis=1), mask=nm)


@triton.jit
def read_linear_kernel(w_ptr, se, uniq_ptr, out_ptr, n_per_expert, chunks, CH: tl.constexpr, BLOCK: tl.constexpr,
                       STAGES: tl.constexpr):
    g = tl.program_id(0)
    e = tl.load(uniq_ptr + g // chunks)
    lo = (g % chunks) * CH
    hi = tl.where(e >= 0, tl.minimum(lo + CH, n_per_expert), lo)
    base = w_ptr + tl.maximum(e, 0).to(tl.int64) * se
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = s + tl.arange(0, BLOCK)
        acc += tl.load(base + offs, mask=offs < hi, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + g, tl.sum(acc, axis=0))


def distinct_padded(ids: torch.Tensor, slots: int) -> torch.Tensor:
    """The routing's distinct experts, -1 past them: [slots] int32 (host work before capture)."""
    u = torch.unique(ids.reshape(-1)).to(torch.int32)
    out = torch.full((slots,), -1, dtype=torch.int32, device=ids.device)
    out[: u.numel()] = u
    return out


def variants(k: int, N: int, K: int):
    """(name, matrix, pattern, options): the down matrix [D, F] (N = D rows of K = F) and gate/up [2F, D]."""
    kp = triton.next_power_of_2(k)
    out = [(f"down-token-n{bn}", "down", "token", dict(BN=bn, BK=128, STAGES=4, num_warps=4)) for bn in (2, 4, 8)]
    out += [(f"down-expert-n{bn}-k{bk}", "down", "expert", dict(BN=bn, BK=bk, STAGES=4, num_warps=4))
            for bn, bk in ((4, 128), (8, 128), (16, 128), (8, 256), (32, 128))]
    out += [(f"down-linear-{ch // 512}k", "down", "linear", dict(CH=ch, BLOCK=2048, STAGES=4, num_warps=4))
            for ch in (8192, 32768)]
    out += [("gateup-expert-n8-k256", "gate_up", "expert", dict(BN=8, BK=256, STAGES=4, num_warps=4)),
            ("gateup-linear-64k", "gate_up", "linear", dict(CH=32768, BLOCK=2048, STAGES=4, num_warps=4))]
    return [(n, m, p, o) for n, m, p, o in out if p != "token" or kp * o["BN"] * o["BK"] <= 8192]


def build(w: torch.Tensor, pattern: str, k: int, opts: dict, uniq_of: dict):
    """fn(x, ids, wt, w) → the pattern's sums; uniq_of maps ids.data_ptr() to the routing's distinct experts."""
    E, N, K = w.shape
    o = dict(opts)
    warps = o.pop("num_warps")

    def run(x, ids, wt, _w):
        T = ids.shape[0]
        if pattern == "token":
            out = torch.empty(T, N, dtype=torch.float32, device=w.device)
            read_token_kernel[(T, triton.cdiv(N, o["BN"]))](w, w.stride(0), w.stride(1), ids, out, N, K,
                                                            K_TOP=k, KP=triton.next_power_of_2(k), num_warps=warps,
                                                            **o)
            return out
        uniq = uniq_of[ids.data_ptr()]
        if pattern == "expert":
            out = torch.empty(uniq.numel(), N, dtype=torch.float32, device=w.device)
            read_expert_kernel[(uniq.numel(), triton.cdiv(N, o["BN"]))](w, w.stride(0), w.stride(1), uniq, out, N, K,
                                                                        num_warps=warps, **o)
            return out
        chunks = triton.cdiv(N * K, o["CH"])
        out = torch.empty(uniq.numel() * chunks, dtype=torch.float32, device=w.device)
        read_linear_kernel[(uniq.numel() * chunks,)](w, w.stride(0), uniq, out, N * K, chunks, num_warps=warps, **o)
        return out

    return run


def reference(w: torch.Tensor, pattern: str, opts: dict, ids: torch.Tensor, uniq: torch.Tensor) -> torch.Tensor:
    """What each pattern's kernel writes, from torch (float32 sums of the same elements)."""
    E, N, K = w.shape
    wf = w.float()
    if pattern == "token":
        return wf[ids.long()].sum(dim=(1, 3))  # [T, N]: Σ over the token's experts and K
    ue = uniq.long()
    rows = torch.where((ue >= 0)[:, None], wf[ue.clamp(min=0)].sum(dim=2), 0.0)  # [slots, N]
    if pattern == "expert":
        return rows
    flat = wf[ue.clamp(min=0)].reshape(ue.numel(), -1)
    chunks = triton.cdiv(N * K, opts["CH"])
    pad = torch.zeros(ue.numel(), chunks * opts["CH"], device=w.device)
    pad[:, : N * K] = flat
    return torch.where((ue >= 0)[:, None], pad.view(ue.numel(), chunks, -1).sum(-1), 0.0).reshape(-1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cells", default="qwen3.5-397b-a17b:1,qwen3-30b-a3b:1,qwen3-30b-a3b:16,deepseek-v3:1")
    ap.add_argument("--device", default="cuda", help="cpu: TRITON_INTERPRET=1, a tiny shape, checks only")
    args = ap.parse_args(argv)
    import kernels as B

    dev = torch.device(args.device)
    cpu = dev.type == "cpu"
    shapes = {"tiny": (8, 2, 64, 48)} if cpu else B.SHAPES
    cells = [("tiny", 3)] if cpu else [(c.split(":")[0], int(c.split(":")[1])) for c in args.cells.split(",")]
    flush = None if cpu else torch.randn(128 * 1024 * 1024, dtype=torch.bfloat16, device=dev)
    rows = []
    for shape, T in cells:
        E, k, D, F = shapes[shape]
        w = B.expert_weights(E, D, F, dev) if not cpu else B.ExpertTensors(
            torch.randn(E, 2 * F, D).to(torch.bfloat16), torch.randn(E, D, F).to(torch.bfloat16))
        sets = B.routings(T, E, k, D, dev, seed=1000 + T)[: 2 if cpu else None]
        slots = min(T * k, E)
        uniq_of = {ids.data_ptr(): distinct_padded(ids, slots) for _, ids, _ in sets}
        distinct = statistics.mean(int((u >= 0).sum()) for u in uniq_of.values())
        for name, mat, pattern, opts in variants(k, D, F):
            wm = w.down if mat == "down" else w.gate_up
            fn = build(wm, pattern, k, opts, uniq_of)
            x0, ids0, wt0 = sets[0]
            err = B.rel_err(fn(x0, ids0, wt0, w), reference(wm, pattern, opts, ids0, uniq_of[ids0.data_ptr()]))
            rec = dict(shape=shape, tokens=T, variant=name, rel_err=err,
                       distinct_mb=round(distinct * wm[0].numel() * 2 / 1e6, 2))
            if not err < 1e-4:
                rec["error"] = f"rel_err {err:.2e}: not timed"
            elif not cpu:
                t_us = B.time_graph(fn, sets, w, flush)[0]
                rec.update(time_us=t_us, gbps=distinct * wm[0].numel() * 2 / t_us / 1e3)
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "read_pattern.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'cell':22} {'variant':24} {'MB':>7} {'µs':>8} {'GB/s':>7}")
    for r in rows:
        print(f"{r['shape'] + ' T=' + str(r['tokens']):22} {r['variant']:24} {r['distinct_mb']:7.1f} "
              f"{r.get('time_us', float('nan')):8.1f} {r.get('gbps', float('nan')):7.0f} {r.get('error', '')}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
