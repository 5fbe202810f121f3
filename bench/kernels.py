"""Time moetune's Triton experts kernels against transformers' experts functions and the floor.

Method (../shared/notes/gpu.md "How to time"):
  * the whole expert block, (x [T, D], ids [T, k], weights [T, k]) → out [T, D], every sort, permute,
    activation, weighting and combine step included; the router is not timed;
  * bf16 weights gate_up [E, 2F, D] ~ N(0, 1/D), down [E, D, F] ~ N(0, 1/F); never zeros;
  * 32 pre-generated uniform-random routings (and x), rotated; one CUDA graph captured per routing,
    replays timed with CUDA events; before every timed replay a 256 MB buffer is READ (buf.sum());
  * warm-up, median of ≥ 100 reps; every variant checked against a float32 reference first
    (‖out − ref‖/‖ref‖ < 1e-2 for bf16); peak extra device memory of one eager call;
  * ceilings (Triton streaming read, device copy, bf16 matmul) measured and printed first;
  * floor: the package's (moetune.passes.targets.floor on the h200 target: max(bytes / 4.8 TB/s,
    flops / 989 TFLOP/s)) with the distinct experts averaged over the 32 routings; the shapes are the
    package's presets.

Baselines: transformers.integrations.moe.grouped_mm_experts_forward and batched_mm_experts_forward
called on a stand-in module (gate_up_proj, down_proj, act_fn and the flags they read), in graph mode;
"eager" re-implements transformers' eager experts loop (one_hot → nonzero → per-expert linear →
index_add_): it synchronises with the host, so it is timed host-launched.

    python bench/kernels.py --out DIR [--shapes a,b] [--tokens 1,2,...] [--budget-s 500]

Writes DIR/<device>-kernels.json (a list of records) and DIR/<device>-kernels.md; prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetune.codegen.common import ExpertTensors  # noqa: E402
from moetune.ir import MoEBlock, RoutingStats, Schedule  # noqa: E402
from moetune.ir.presets import preset  # noqa: E402
from moetune.passes.targets import floor  # noqa: E402
from moetune.search.objective import reference  # noqa: E402
from moetune.search.timing import Case, routing_mean  # noqa: E402

SHAPES = {name: (b.E, b.k, b.D, b.F) for name, b in (  # name: (E, k, D, F), the package's presets
    (n, preset(n)) for n in ("qwen3-30b-a3b", "deepseek-v3", "qwen3.5-397b-a17b", "mixtral-8x7b"))}
TOKENS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# gpu.md, "best open-source" graph-mode µs per cell (the bar to beat)
BEST_OPEN = {
    "qwen3-30b-a3b": (37.0, 53.7, 70.0, 84.3, 137, 206, 272, 307, 313, 344, 364, 433),
    "deepseek-v3": (189, 343, 493, 646, 1264, 2005, 3194, 4359, 5226, 5374, 5492, 6295),
    "qwen3.5-397b-a17b": (81.4, 142, 199, 257, 479, 816, 1388, 2116, 2771, 3069, 3164, 3665),
    "mixtral-8x7b": (188, 344, 437, 447, 582, 660, 688, 669, 688, 758, 1069, 1664),
}
N_ROUT, REPS, WARM = 32, 100, 5


# ------------------------------------------------------------------------------------------ ceilings


@triton.jit
def read_kernel(src, dst, n, BLOCK: tl.constexpr):
    """Streaming read of src [n] by a fixed grid: the HBM read ceiling (and a one-launch read bound)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(dst + pid, tl.sum(acc, axis=0))


def ceilings(dev: torch.device) -> dict:
    n = 2 * 1024**3  # 4 GiB of bf16
    a = torch.randn(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty(132 * 8, dtype=torch.float32, device=dev)
    res = {}

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

    ms = t_ms(lambda: read_kernel[(132 * 8,)](a, dst, n, BLOCK=4096, num_warps=8))
    res["hbm_read_TBps"] = 2 * n / ms / 1e9
    b = torch.empty(n // 2, dtype=torch.bfloat16, device=dev)
    ms = t_ms(lambda: b.copy_(a[: n // 2]))
    res["d2d_copy_rw_TBps"] = 2 * n / ms / 1e9
    a = b = None
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    ms = t_ms(lambda: m @ m, reps=10)
    res["bf16_matmul_TFLOPs"] = 2 * 8192**3 / ms / 1e9
    m = None
    torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------- baselines


def standin(w: ExpertTensors, E: int) -> types.SimpleNamespace:
    """The attributes transformers' experts functions read from an experts module."""
    from transformers.integrations import moe as hf

    m = types.SimpleNamespace(gate_up_proj=w.gate_up, down_proj=w.down, num_experts=E, has_gate=True,
                              has_bias=False, is_transposed=False, _is_expert_parallel=False,
                              has_post_expert_norm=False, act_fn=torch.nn.functional.silu)
    m._apply_gate = types.MethodType(hf._default_apply_gate, m)
    return m


def hf_fn(name: str, w: ExpertTensors, E: int):
    from transformers.integrations import moe as hf

    f = {"grouped_mm": hf.grouped_mm_experts_forward, "batched_mm": hf.batched_mm_experts_forward}[name]
    m = standin(w, E)
    return lambda x, ids, wt, _w: f(m, x, ids, wt)


def eager_fn(E: int):
    """transformers' eager experts loop, re-implemented op for op (host-synchronising)."""
    def run(x, ids, wt, w):
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(ids, num_classes=E).permute(2, 1, 0)  # [E, k, T]
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            pos, tok = torch.where(mask[e])
            gate, up = torch.nn.functional.linear(x[tok], w.gate_up[e]).chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
            y = torch.nn.functional.linear(h, w.down[e]) * wt[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out
    return run


# ------------------------------------------------------------------------------------------ helpers


def expert_weights(E: int, D: int, F: int, dev, seed: int = 0) -> ExpertTensors:
    """bf16 gate_up [E, 2F, D] ~ N(0, 1/D) and down [E, D, F] ~ N(0, 1/F), never zeros."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    return ExpertTensors(torch.randn(E, 2 * F, D, device=dev, generator=gen, dtype=torch.bfloat16) / math.sqrt(D),
                         torch.randn(E, D, F, device=dev, generator=gen, dtype=torch.bfloat16) / math.sqrt(F))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def graph_checked_time(fn, sets, w, flush, ref) -> tuple[float | None, float, float]:
    """(graph-mode median µs, or None when the replays' output fails the 1e-2 check; that error; the
    tuner's summary of the same replays, `routing_mean`: the mean over routings of each one's median µs.
    Where a cell's routings fall in two modes (mixtral-8x7b T = 2 touches 3 or 4 experts), the median of
    all replays (gpu.md's method, `time_us`) and that mean can rank close variants differently.)"""
    t_us, times, gout = time_graph(fn, sets, w, flush)
    gerr = rel_err(gout, ref)
    return (t_us if gerr < 1e-2 else None), gerr, routing_mean(times, len(sets))


def routings(T: int, E: int, k: int, D: int, dev, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(N_ROUT):
        logits = torch.randn(T, E, device=dev, generator=g)
        val, ids = logits.topk(k, dim=-1)
        wt = torch.softmax(val, dim=-1).to(torch.bfloat16)
        x = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        sets.append((x, ids, wt))
    return sets


def time_graph(fn, sets, w, flush, reps=REPS) -> tuple[float, list, torch.Tensor]:
    pool = torch.cuda.graph_pool_handle()
    graphs, outs = [], []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x, ids, wt in sets[:2]:
            fn(x, ids, wt, w)
    torch.cuda.current_stream().wait_stream(s)
    for x, ids, wt in sets:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outs.append(fn(x, ids, wt, w))
        graphs.append(g)
    for i in range(WARM):
        graphs[i % len(graphs)].replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i in range(reps):
        flush.sum()
        ev[i][0].record()
        graphs[i % len(graphs)].replay()
        ev[i][1].record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) * 1e3 for a, b in ev]
    last = outs[0].clone()  # what the replays of graph 0 wrote: checked against the reference
    del graphs, outs
    return statistics.median(times), times, last


def time_host(fn, sets, w, flush, reps=REPS) -> float:
    for x, ids, wt in sets[:2]:
        fn(x, ids, wt, w)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i in range(reps):
        x, ids, wt = sets[i % len(sets)]
        flush.sum()
        ev[i][0].record()
        fn(x, ids, wt, w)
        ev[i][1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def extra_memory(fn, x, ids, wt, w) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(x, ids, wt, w)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def floor_us(E, k, D, F, T, distinct) -> float:
    """The package's roofline floor (moetune.passes.targets.floor on the h200 target, bf16) with the
    distinct experts measured over the timed routings."""
    block = MoEBlock(E=E, k=k, D=D, F=F)
    rows = T * k / distinct
    stats = RoutingStats(tokens=T, distinct_experts=distinct, rows_per_active=rows, max_rows=rows,
                         source="the timed routings")
    return floor(block, "h200", T, stats).time_s * 1e6


# ------------------------------------------------------------------------------------------ variants


def table_variant(path: str, shape: str, T: int) -> list[tuple[str, Schedule]]:
    """[("table", schedule)]: what the dispatch table at `path` routes T to for the preset of this
    shape, i.e. what a compiled model runs (none when the file, the entry or a current one is missing;
    stale or foreign entries are said in one warning, as at run time)."""
    if not path or shape not in SHAPES:  # the bench shapes are the presets of the same name
        return []
    from moetune.ir.presets import preset
    from moetune.runtime.table import CacheError, load_entries

    try:
        usable = load_entries(path, preset(shape), "h200", "triton", device="cuda")
    except CacheError as e:  # an unreadable table costs the `table` variant, never the sweep
        print(f"variant `table` left out: {e}", flush=True)
        return []
    return [("table", s) for lo, hi, s in usable if lo <= T <= hi]


def variants(E: int, k: int, D: int, F: int, T: int):
    """A few parameter choices per kind, picked by rows per active expert."""
    from moetune.codegen.triton import GemmParams, GemvParams, HybridParams

    distinct = E * (1 - (1 - k / E) ** T)
    rows = T * k / distinct
    kp = 1 << (k - 1).bit_length()
    tdn = max(2, 32 // kp)  # token-mode down: KP·BN·128 accumulators
    split = 2 if F <= 1024 else 1
    out = []

    def gemv(tag, **kw):
        out.append((tag, Schedule("stream_gemv", backend="triton", params=GemvParams(**kw))))

    def gemm(tag, **kw):
        out.append((tag, Schedule("grouped_gemm", backend="triton", params=GemmParams(**kw))))

    def hyb(tag, r, **kw):
        out.append((tag, Schedule("hybrid", row_threshold=r, backend="triton", params=HybridParams(**kw))))

    if rows <= 1.5:
        gemv("ga", block_n=8, block_k=256, num_warps=4, num_stages=4, down_block_n=tdn, down_block_k=128,
             down_warps=4)
        gemv("gb", block_n=4, block_k=256, num_warps=2, num_stages=4, down_block_n=max(1, tdn // 2),
             down_block_k=128, down_warps=2)
        gemv("gd", block_n=8, block_k=512, num_warps=4, num_stages=3, down_block_n=tdn, down_block_k=256,
             down_warps=4)
    if 1.3 <= rows <= 3:
        gemv("gr2", rows=2, block_n=8, block_k=128, num_warps=4, num_stages=4, down_block_n=8,
             down_block_k=128, down_mode="expert", split_k=split)
    if 1.05 <= rows <= 3:
        hyb("h2", 2, block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, gemv_block_n=8,
            gemv_block_k=256, down_block_n=64, down_block_k=128, down_gemv_block_n=4, down_gemv_block_k=128,
            down_stages=4)
    if 2.5 <= rows <= 48:
        gemv("g16", rows=16, block_n=64, block_k=128, num_warps=4, num_stages=4, down_block_n=64,
             down_block_k=128, down_warps=4, down_mode="expert", fused_route=False)
    if 1.05 <= rows <= 24:
        gemm("m16", block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, down_block_n=64,
             down_block_k=128, down_stages=4)
    if rows >= 12:
        gemm("m64", block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=4, down_block_n=128,
             down_block_k=64, down_warps=8, down_stages=4)
        gemm("m64n64", block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4, down_block_n=128,
             down_block_k=64, down_warps=4, down_stages=4)
    if rows >= 48:
        gemm("m128", block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, down_block_n=128,
             down_block_k=64, down_warps=8, down_stages=3)
        gemm("m128s4", block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, down_block_n=256,
             down_block_k=64, down_warps=8, down_stages=4)
        gemm("m128k128", block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3, down_block_n=128,
             down_block_k=128, down_warps=8, down_stages=3)
        gemm("m128g1", block_m=128, block_n=128, block_k=64, group_m=1, num_warps=8, num_stages=4,
             down_block_n=256, down_block_k=64, down_warps=8, down_stages=4)
        gemm("m128g32", block_m=128, block_n=128, block_k=64, group_m=32, num_warps=8, num_stages=4,
             down_block_n=256, down_block_k=64, down_warps=8, down_stages=4)
    # twins: `-1` the gate/up as one N = 2·block_n tl.dot (pointer path), `-t` the TMA operand path (sorted
    # copy of x), `-t1` the TMA path with the gate/up as one dot from one [2, block_n, block_k] box, `-t1s2`
    # that with the down GEMM split in two along F (session 10 H200: -t1s2 beat -ts2 by 1-3 % at
    # mixtral-8x7b T = 512 / 1024; -ts2, -t and -1s2 of the 128-row tiles retired)
    twins = []
    for tag, s in out:
        p = s.params
        if s.kind == "grouped_gemm" and p.block_m >= 64 and not p.tma:
            twins.append((tag + "-1", dataclasses.replace(s, params=dataclasses.replace(p, one_dot=True))))
        if tag in ("m16", "m64n64"):  # the TMA operand path at 16 / 64 rows (the tuner picks it for mixtral)
            twins.append((tag + "-t", dataclasses.replace(s, params=dataclasses.replace(p, tma=True))))
        if tag in ("m64n64", "m128s4"):  # m128s4-t1: the tuner's choice for mixtral-8x7b [634, 1024] (session 10)
            twins.append((tag + "-t1", dataclasses.replace(s, params=dataclasses.replace(
                p, tma=True, one_dot=True, down_stages=3))))
        if tag in ("m128s4", "m128g32"):
            twins.append((tag + "-t1s2", dataclasses.replace(
                s, params=dataclasses.replace(p, tma=True, one_dot=True, down_stages=3, split_k=2))))
    # `-y`: the down GEMM's rows y in bf16 (GemmParams.y_half) for the variants that were best somewhere at
    # many pairs (P ≥ 1024, where y is ≥ 8 MB at D = 2048 and its fp32 write and read cost µs)
    ys = [(tag + "-y", dataclasses.replace(s, params=dataclasses.replace(s.params, y_half=True)))
          for tag, s in out + twins if tag in Y_TWINS and T * k >= 1024]
    return out + twins + ys


Y_TWINS = ("m16-t", "m64n64", "m64n64-t", "m128g1-1", "m128g32-t1s2", "m128s4-t1s2", "m128s4-t1")


def nb_twins(cands: list[tuple[str, Schedule]], nbs=(2, 4)) -> list[tuple[str, Schedule]]:
    """`-n2` / `-n4`: the down projection's D-blocks walked 2 / 4 per program in one flattened loop
    (GemvParams / GemmParams.down_nb), for every token-mode GEMV and pointer-path grouped GEMM candidate (the
    TMA path and the expert-mode GEMV refuse down_nb)."""
    out = []
    for tag, s in cands:
        p = s.params
        if (p is None or getattr(p, "down_nb", 0) != 1 or getattr(p, "down_mode", "token") != "token"
                or getattr(p, "tma", False)):
            continue
        out += [(f"{tag}-n{n}", dataclasses.replace(s, params=dataclasses.replace(p, down_nb=n))) for n in nbs]
    return out


# ------------------------------------------------------------------------------------------ main


def profiled(calls: list[tuple]) -> None:
    """Each (fn, *args) called once between cudaProfilerStart and Stop (what `ncu --profile-from-start
    off` records), then synchronised."""
    torch.cuda.profiler.start()
    for fn, *a in calls:
        fn(*a)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def probe(out_dir: Path) -> None:
    """One eager call per GEMV configuration inside cudaProfilerStart/Stop, for
    `ncu --profile-from-start off`: per-kernel time, DRAM bytes, registers and occupancy."""
    from moetune.codegen.triton import BACKEND, GemvParams

    dev = torch.device("cuda")
    plan = []
    for shape, T in (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 4), ("deepseek-v3", 1)):
        E, k, D, F = SHAPES[shape]
        block = MoEBlock(E=E, k=k, D=D, F=F, name=shape)
        w = expert_weights(E, D, F, dev, seed=1)
        x, ids, wt = routings(T, E, k, D, dev, seed=7)[0]
        cfgs = []
        for bn, bk, nw, st in ((8, 256, 4, 4), (4, 256, 2, 4), (16, 256, 4, 4), (8, 512, 4, 3),
                               (4, 128, 2, 4), (8, 128, 4, 4), (16, 128, 4, 4), (8, 256, 4, 2)):
            cfgs.append(dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=st,
                             down_block_n=max(2, bn // 2), down_block_k=128, down_warps=nw))
        for c in cfgs:
            fn = BACKEND.build(block, Schedule("stream_gemv", backend="triton", params=GemvParams(**c)))
            fn(x, ids, wt, w)
            fn(x, ids, wt, w)
            torch.cuda.synchronize()
            plan.append((shape, T, c, fn, x, ids, wt, w))
    profiled([(fn, x, ids, wt, w) for *_, fn, x, ids, wt, w in plan])
    (out_dir / "probe_plan.json").write_text(json.dumps([(s, t, c) for s, t, c, *_ in plan]))


def probe_table(out_dir: Path, cells: str, table: str) -> None:
    """The shipped table's schedule of each cell ("shape:T,T;shape:T"), one eager call each inside
    cudaProfilerStart/Stop for `ncu --profile-from-start off`: the time of each of its kernels alone
    (routing, gate/up, down, combine), to set against the cell's graph-mode time."""
    from moetune.codegen.triton import BACKEND

    dev = torch.device("cuda")
    plan = []
    for group in cells.split(";"):
        shape, ts = group.split(":")
        E, k, D, F = SHAPES[shape]
        block = MoEBlock(E=E, k=k, D=D, F=F, name=shape)
        w = expert_weights(E, D, F, dev, seed=1)
        for T in map(int, ts.split(",")):
            for _, s in table_variant(table, shape, T):
                x, ids, wt = routings(T, E, k, D, dev, seed=7)[0]
                fn = BACKEND.build(block, s)
                fn(x, ids, wt, w)  # compiled before the profiled range
                torch.cuda.synchronize()
                plan.append((shape, T, s.describe(), fn, x, ids, wt, w))
    profiled([(fn, x, ids, wt, w) for *_, fn, x, ids, wt, w in plan])
    (out_dir / "probe_table_plan.json").write_text(json.dumps([(s, t, d) for s, t, d, *_ in plan]))


def probe_variants(out_dir: Path, cells: str) -> None:
    """Named variants per cell ("shape:T:tag,tag;..."; the `-n2` / `-n4` twins of nb_twins too), one eager
    call each inside cudaProfilerStart/Stop for `ncu --profile-from-start off`, in the order given."""
    from moetune.codegen.triton import BACKEND

    dev = torch.device("cuda")
    plan = []
    for group in cells.split(";"):
        shape, T, tags = group.split(":")
        T = int(T)
        E, k, D, F = SHAPES[shape]
        block = MoEBlock(E=E, k=k, D=D, F=F, name=shape)
        w = expert_weights(E, D, F, dev, seed=1)
        named = variants(E, k, D, F, T)
        named = dict(named + nb_twins(named))
        x, ids, wt = routings(T, E, k, D, dev, seed=7)[0]
        for tag in tags.split(","):
            fn = BACKEND.build(block, named[tag])
            fn(x, ids, wt, w)  # compiled before the profiled range
            torch.cuda.synchronize()
            plan.append((shape, T, tag, fn, x, ids, wt, w))
    profiled([(fn, x, ids, wt, w) for *_, fn, x, ids, wt, w in plan])
    (out_dir / "probe_variants_plan.json").write_text(json.dumps([(s, t, g) for s, t, g, *_ in plan]))


def probe_gemm(out_dir: Path) -> None:
    """The large-T GEMM path of mixtral-8x7b (T = 512, 1024) inside cudaProfilerStart/Stop for ncu:
    kernels in order route (×2), gate/up, down, combine per call."""
    from moetune.codegen.triton import BACKEND

    dev = torch.device("cuda")
    E, k, D, F = SHAPES["mixtral-8x7b"]
    block = MoEBlock(E=E, k=k, D=D, F=F, name="mixtral-8x7b")
    w = expert_weights(E, D, F, dev, seed=1)
    plan = []
    for T in (512, 1024):
        x, ids, wt = routings(T, E, k, D, dev, seed=7)[0]
        s = dict(variants(E, k, D, F, T))["m128s4"]
        fn = BACKEND.build(block, s)
        fn(x, ids, wt, w)
        torch.cuda.synchronize()
        plan.append((T, s.describe(), fn, x, ids, wt))
    profiled([(fn, x, ids, wt, w) for *_, fn, x, ids, wt in plan])
    (out_dir / "probe_gemm_plan.json").write_text(json.dumps([(t, d) for t, d, *_ in plan]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--baselines", default="grouped_mm,batched_mm,eager")
    ap.add_argument("--eager-tokens", default="1")
    ap.add_argument("--tags", default=".*", help="regex: only moetune variants whose tag matches")
    ap.add_argument("--table", default=str(Path(__file__).resolve().parents[1] / "cache" / "h200.sqlite"),
                    help="shipped dispatch table: its current entry for the cell's T joins as variant `table` "
                         "(what a compiled model runs); '' to leave it out")
    ap.add_argument("--table-before", default="", help="a second table (e.g. a copy taken before a re-tune): "
                    "its entry joins as variant `table-before`, timed in the same run as `table`")
    ap.add_argument("--probe", action="store_true", help="GEMV configurations for ncu, then exit")
    ap.add_argument("--probe-gemm", action="store_true", help="mixtral large-T GEMM for ncu, then exit")
    ap.add_argument("--probe-table", metavar="CELLS", help="the table's schedule of each cell "
                    "('shape:T,T;shape:T') for ncu, then exit")
    ap.add_argument("--nb-twins", action="store_true", help="also every candidate's down_nb 2 / 4 twin "
                    "(token-mode GEMV and pointer-path grouped GEMM down, bench.kernels.nb_twins)")
    ap.add_argument("--probe-variants", metavar="CELLS", help="named variants of each cell "
                    "(\"shape:T:tag,tag;...\") for ncu, then exit")
    ap.add_argument("--render", metavar="JSON", help="rewrite the markdown table of a results JSON, then exit")
    args = ap.parse_args()
    if args.render:
        print(render(args.render))
        return
    if args.probe_gemm:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        probe_gemm(Path(args.out))
        return
    if args.probe:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        probe(Path(args.out))
        return
    if args.probe_variants:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        probe_variants(Path(args.out), args.probe_variants)
        return
    if args.probe_table:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        probe_table(Path(args.out), args.probe_table, args.table)
        return
    t_start = time.time()
    dev = torch.device("cuda")
    from moetune.codegen.triton import BACKEND

    name = torch.cuda.get_device_name().replace(" ", "-").lower()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath = out_dir / f"{name}-kernels.json"
    ceil = ceilings(dev)
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"triton {__import__('triton').__version__}", flush=True)
    print("ceilings: " + "  ".join(f"{k} {v:.3g}" for k, v in ceil.items()), flush=True)
    records: list[dict] = []
    flush = torch.randn(128 * 1024 * 1024, dtype=torch.bfloat16, device=dev)  # 256 MB, read per rep
    tokens = [int(t) for t in args.tokens.split(",")]
    eager_tokens = {int(t) for t in args.eager_tokens.split(",") if t}
    baselines = [b for b in args.baselines.split(",") if b]
    stop = False
    for shape in args.shapes.split(","):
        E, k, D, F = SHAPES[shape]
        block = MoEBlock(E=E, k=k, D=D, F=F, name=shape)
        w = expert_weights(E, D, F, dev)
        for T in tokens:
            if time.time() - t_start > args.budget_s:
                print(f"budget reached: stopping before {shape} T={T}", flush=True)
                stop = True
                break
            sets = routings(T, E, k, D, dev, seed=1000 + T)
            distinct = statistics.mean(len(torch.unique(s[1])) for s in sets)
            fl = floor_us(E, k, D, F, T, distinct)
            x0, ids0, wt0 = sets[0]
            ref = reference(block, Case(x0, ids0, wt0, w))  # the tuner's fp32 reference, expert by expert
            best_open = BEST_OPEN[shape][TOKENS.index(T)] if T in TOKENS else None
            named = [(tag, s) for tag, s in variants(E, k, D, F, T) + table_variant(args.table, shape, T)
                     if re.fullmatch(args.tags, tag)]
            named += [("table-before", s) for _, s in table_variant(args.table_before, shape, T)]
            if args.nb_twins:
                named += nb_twins(named)
            cands = [(f"moetune:{s.kind}", tag, s, BACKEND.build(block, s)) for tag, s in named]
            for b in baselines:
                if b == "batched_mm" and (T > 64 or T * k * 3 * D * F * 2 > 24e9):
                    continue
                if b == "eager" and T not in eager_tokens:
                    continue
                cands.append((b, "", None, eager_fn(E) if b == "eager" else hf_fn(b, w, E)))
            for impl, tag, sched, fn in cands:
                rec = dict(device=name, shape=shape, E=E, k=k, D=D, F=F, tokens=T, impl=impl, variant=tag,
                           schedule=sched.describe() if sched else None, floor_us=round(fl, 2),
                           distinct=distinct, best_open_us=best_open)
                try:
                    out = fn(x0, ids0, wt0, w)
                    torch.cuda.synchronize()
                    err = rel_err(out, ref)
                    rec["rel_err"] = err
                    rec["extra_mem_bytes"] = extra_memory(fn, x0, ids0, wt0, w)
                    if not err < 1e-2:
                        rec["error"] = f"rel_err {err:.3g} ≥ 1e-2: not timed"
                    elif impl == "eager":
                        rec["time_us"] = time_host(fn, sets, w, flush)
                        rec["mode"] = "host"
                    else:
                        t_us, rec["graph_rel_err"], mean_us = graph_checked_time(fn, sets, w, flush, ref)
                        if t_us is not None:
                            rec["time_us"] = t_us
                            rec["routing_mean_us"] = mean_us
                            rec["mode"] = "graph"
                        else:
                            rec["error"] = f"graph replay rel_err {rec['graph_rel_err']:.3g} ≥ 1e-2: not counted"
                except Exception as exc:  # a failing candidate is recorded, never stops the sweep
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    torch.cuda.synchronize()
                if "time_us" in rec:
                    rec["pct_floor"] = 100.0 * fl / rec["time_us"]
                    if best_open:
                        rec["speedup_vs_best_open"] = best_open / rec["time_us"]
                records.append(rec)
                torch.cuda.empty_cache()
            # host-launched time of the cell's best moetune kernel
            mine = [r for r in records if r["shape"] == shape and r["tokens"] == T
                    and r["impl"].startswith("moetune") and "time_us" in r]
            if mine:
                best = min(mine, key=lambda r: r["time_us"])
                fn = next(c[3] for c in cands if c[1] == best["variant"] and c[0] == best["impl"])
                best["host_us"] = time_host(fn, sets, w, flush, reps=50)
                print(f"{shape:18s} T={T:5d} floor {fl:8.1f}  best {best['impl']}/{best['variant']} "
                      f"{best['time_us']:8.1f} µs ({best['pct_floor']:.0f}%)  open {best_open}  "
                      f"host {best['host_us']:.1f}  [{time.time() - t_start:.0f}s]", flush=True)
            jpath.write_text(json.dumps(dict(ceilings=ceil, records=records), indent=1))
        del w
        torch.cuda.empty_cache()
        if stop:
            break
    md = table(records, ceil, name)
    (out_dir / f"{name}-kernels.md").write_text(md)
    print(md)


def table(records: list[dict], ceil: dict, name: str) -> str:
    lines = [f"# moetune Triton experts kernels on {name}", "",
             "ceilings measured in the same run: " + ", ".join(f"{k} {v:.3g}" for k, v in ceil.items()),
             "",
             "| shape | T | floor µs | best moetune µs | % floor | kind/variant | table µs | best open-source µs "
             "| speedup | moetune host-launched µs | grouped_mm | batched_mm | eager (host) | GEMV best | GEMM best "
             "| hybrid best | rel_err | extra MiB |",
             "|" + "---|" * 18]
    summary = []  # (speedup, % floor, target %, table µs / best µs or None) per cell
    cells = sorted({(r["shape"], r["tokens"]) for r in records},
                   key=lambda c: (list(SHAPES).index(c[0]), c[1]))
    for shape, T in cells:
        rs = [r for r in records if r["shape"] == shape and r["tokens"] == T]
        timed = [r for r in rs if "time_us" in r]
        mine = [r for r in timed if r["impl"].startswith("moetune")]

        def best_of(pred, timed=timed):
            c = [r for r in timed if pred(r)]
            return min(c, key=lambda r: r["time_us"]) if c else None

        def fmt(r):
            return f"{r['time_us']:.1f}" if r else "–"
        b = best_of(lambda r: r["impl"].startswith("moetune"))
        fl = rs[0]["floor_us"]
        bo = rs[0]["best_open_us"]
        if not b:
            lines.append(f"| {shape} | {T} | {fl:.1f} | – (no moetune kernel timed) |")
            continue

        def named(name, best_of=best_of):
            return fmt(best_of(lambda rec: rec["impl"] == name))
        tab = best_of(lambda rec: rec["impl"].startswith("moetune") and rec["variant"] == "table")
        host = f"{b['host_us']:.1f}" if "host_us" in b else "–"  # the best kernel, host-launched (eager)
        tab_ratio = tab["time_us"] / b["time_us"] if tab else None
        summary.append((bo / b["time_us"] if bo else None, 100 * fl / b["time_us"], target_pct(T), tab_ratio))
        lines.append(
            f"| {shape} | {T} | {fl:.1f} | {fmt(b)} | {100 * fl / b['time_us']:.0f}% | "
            f"{b['impl'].split(':')[1]}/{b['variant']} | "
            f"{fmt(tab) + (f' ({1 / tab_ratio:.2f}×)' if tab_ratio and tab is not b else '')} | {bo} | "
            f"{(bo / b['time_us']) if bo else float('nan'):.2f}× | "
            f"{host} | "
            f"{named('grouped_mm')} | {named('batched_mm')} | {named('eager')} | "
            f"{named('moetune:stream_gemv')} | {named('moetune:grouped_gemm')} | {named('moetune:hybrid')} | "
            f"{max(r['rel_err'] for r in mine):.1e} | {b['extra_mem_bytes'] / 2**20:.2f} |")
    lines += [""] + summary_lines(summary)
    errs = [r for r in records if "error" in r]
    if errs:
        lines += ["", "Failures:"] + [
            f"- {r['shape']} T={r['tokens']} {r['impl']}/{r['variant']}: {r['error']}" for r in errs]
    return "\n".join(lines) + "\n"


def target_pct(T: int) -> float:
    """The issue's % of floor target for a cell: 80 % at T = 1, 85 % at T = 2…64, 75 % above."""
    return 80.0 if T == 1 else 85.0 if T <= 64 else 75.0


def summary_lines(summary: list[tuple]) -> list[str]:
    """The table's footer: speedups over the best open-source figures, % of floor against the targets, and
    how close the shipped table's own choice (variant `table`) comes to the best variant."""
    def gmean(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")

    sp = [c[0] for c in summary if c[0]]
    pf = [c[1] for c in summary]
    under = sum(1 for _, p, t, _ in summary if p < t)
    tab = [c[3] for c in summary if c[3]]
    out = [f"{len(summary)} cells: speedup over the best open-source figure, geometric mean {gmean(sp):.3f}× "
           f"(lowest {min(sp):.3f}×); % of floor, geometric mean {gmean(pf):.1f} %; "
           f"{under} cells under their target (80 % at T = 1, 85 % at T = 2–64, 75 % above)."] if sp else []
    if tab:
        near = sum(1 for r in tab if r <= 1.02)
        out.append(f"`table` (the shipped dispatch table's schedule for the cell's T, what a compiled model runs): "
                   f"within 2 % of the best variant in {near} of {len(tab)} cells, at worst {1 / max(tab):.2f}× "
                   "its speed.")
    return out


def render(json_path: str) -> str:
    """The markdown table of a results JSON, written beside it (no GPU needed)."""
    path = Path(json_path)
    d = json.loads(path.read_text())
    name = path.name.removesuffix("-kernels.json")
    md = table(d["records"], d["ceilings"], name)
    path.with_name(f"{name}-kernels.md").write_text(md)
    return md


if __name__ == "__main__":
    main()
