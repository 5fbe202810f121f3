"""Compile a Triton kernel of moetune for sm_90 on a machine with no GPU and read its resources.

`compile_sm90(kernel, constexprs, **options)` builds real PTX and cubin through
`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`, the way the JIT would on an H200
for the standard bf16 layout: pointers 16-byte aligned, sizes and strides multiples of 16, the unit
reduction stride specialised to 1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT64_PTRS = {"ids_ptr"}
INT32_PTRS = {"counts_ptr", "sorted_ptr", "hist_ptr", "sync_ptr"}
FP32_PTRS = {"y_ptr", "dst"}
UNIT_STRIDES = {"sk", "gsk", "dsk"}  # contiguous reduction axis of the standard layout
# sizes and strides that are multiples of 16 on every real shape (the JIT marks such ints itself)
ALIGNED_INTS = {"s_xt", "se", "sn", "up", "sbe", "bup", "s_hp", "s_yt", "N", "K", "k_split", "s_ot",
                "gse", "gsn", "gup", "gsbe", "gbup", "dse", "dsn", "dsbe"}


def tma_descs(bm: int, bn: int, bk: int, one_dot: bool = False) -> dict:
    """Box shapes of grouped_gemm_tma_kernel's two descriptors for a (BM, BN, BK) tile (one_dot: the
    gate/up weights' box [2, BN, BK])."""
    return dict(a_desc=[bm, bk], b_desc=[2, bn, bk] if one_dot else [bn, bk])


def compile_sm90(kernel, constexprs: dict, *, fp32_out: bool = False, descs: dict | None = None, **options):
    """descs: TMA descriptor argument → its box shape (bf16 descriptors)."""
    names = list(kernel.arg_names)
    descs = descs or {}
    constexprs = dict(constexprs)
    for prm in kernel.params:  # constexprs left out take their declared defaults, as the JIT does
        if prm.is_constexpr and prm.name not in constexprs and prm.has_default:
            constexprs[prm.name] = prm.default
    sig, cx, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in descs:
            sig[n] = f"tensordesc<bf16[{', '.join(map(str, descs[n]))}]>"
        elif n in constexprs or n in UNIT_STRIDES:
            sig[n] = "constexpr"
            cx[(i,)] = constexprs.get(n, 1)
        elif n.endswith("_ptr"):
            if n in INT64_PTRS:
                sig[n] = "*i64"
            elif n in INT32_PTRS:
                sig[n] = "*i32"
            elif n in FP32_PTRS and fp32_out:
                sig[n] = "*fp32"
            else:
                sig[n] = "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ("alpha", "limit"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n in ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_usage(k) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) of a compiled kernel, from Triton's bundled ptxas -v on its
    PTX: what the SM gives each thread, and whether ptxas had to spill (the PTX alone cannot tell)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(k.asm["ptx"])
        res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def representative() -> list[tuple[str, object, dict, dict]]:
    """(label, kernel, constexprs, options): one config per kernel path the bench's winners use
    (options may carry `descs`, the TMA boxes)."""
    from moetune.codegen.triton.combine import combine_kernel
    from moetune.codegen.triton.grouped_gemm import grouped_gemm_kernel, grouped_gemm_tma_kernel
    from moetune.codegen.triton.hybrid import hybrid_kernel
    from moetune.codegen.triton.routing import gather_kernel, route_kernel
    from moetune.codegen.triton.stream_gemv import stream_gemv_kernel

    base = dict(ACT=0, HAS_BIAS=False, W_IN=False, UPCAST=False)
    gv = dict(base, K_TOP=8, KP=8, BLOCK_E=128, BP=16, FUSED=True, ROWS=1, STAGES=4)
    o4, o8 = dict(num_warps=4, num_stages=4), dict(num_warps=8, num_stages=4)
    return [
        ("route/one", route_kernel, dict(PHASE=2, BLOCK_E=128, C=64, GB=1), dict(num_warps=4)),
        ("route/scatter", route_kernel, dict(PHASE=1, BLOCK_E=512, C=16, GB=8), dict(num_warps=4)),
        ("gemv/gate_up", stream_gemv_kernel, dict(gv, PROJ=0, BN=8, BK=256), o4),
        ("gemv/down_token", stream_gemv_kernel, dict(gv, PROJ=2, BN=4, BK=128), o4),
        ("gemv/down_token_nb4", stream_gemv_kernel, dict(gv, PROJ=2, BN=8, BK=128, NB=4), o4),
        ("gemv/down_expert", stream_gemv_kernel, dict(gv, PROJ=1, FUSED=False, BN=8, BK=128),
         o4),
        ("gemv/gate_up_rows16", stream_gemv_kernel, dict(gv, PROJ=0, FUSED=False, ROWS=16, BN=64, BK=128),
         o4),
        ("gemm/gate_up_m16", grouped_gemm_kernel,
         dict(base, PROJ=0, K_TOP=8, BLOCK_E=128, BM=16, BN=64, BK=128, GROUP_M=8), o4),
        ("gemm/down_m16_nb4", grouped_gemm_kernel,
         dict(base, PROJ=1, K_TOP=8, BLOCK_E=128, BM=16, BN=64, BK=128, GROUP_M=8, NB=4), o4),
        ("gemm/gate_up_m128", grouped_gemm_kernel,
         dict(base, PROJ=0, K_TOP=2, BLOCK_E=16, BM=128, BN=128, BK=64, GROUP_M=8), o8),
        ("gemm/down_m128", grouped_gemm_kernel,
         dict(base, PROJ=1, K_TOP=2, BLOCK_E=16, BM=128, BN=256, BK=64, GROUP_M=8), o8),
        ("gemm/gate_up_m128_one_dot", grouped_gemm_kernel,
         dict(base, PROJ=0, K_TOP=2, BLOCK_E=16, BM=128, BN=128, BK=64, GROUP_M=8, ONE_DOT=True), o8),
        ("gemm/gate_up_m128_tma", grouped_gemm_tma_kernel,
         dict(base, PROJ=0, BLOCK_E=16, BM=128, BN=128, BK=64, GROUP_M=8),
         dict(o8, descs=tma_descs(128, 128, 64))),
        ("gemm/gate_up_m128_tma_one_dot", grouped_gemm_tma_kernel,
         dict(base, PROJ=0, BLOCK_E=16, BM=128, BN=128, BK=64, GROUP_M=8, ONE_DOT=True),
         dict(o8, descs=tma_descs(128, 128, 64, one_dot=True))),
        ("gemm/down_m128_tma", grouped_gemm_tma_kernel,
         dict(base, PROJ=1, BLOCK_E=16, BM=128, BN=256, BK=64, GROUP_M=8),
         dict(o8, num_stages=3, descs=tma_descs(128, 256, 64))),
        ("route/gather", gather_kernel, dict(K_TOP=2, BLOCK_E=16, BR=16, BD=256), dict(num_warps=4)),
        ("hybrid/gate_up", hybrid_kernel,
         dict(base, PROJ=0, K_TOP=8, BLOCK_E=128, BM=16, BN=64, BK=128, BNV=8, BKV=256, RP=1, STAGES=4),
         o4),
        ("combine", combine_kernel, dict(S=1, K_TOP=8, KP=8, BD=512), dict(num_warps=4)),
        ("combine/y_half", combine_kernel, dict(S=2, K_TOP=2, KP=2, BD=1024), dict(num_warps=4)),
    ]


def schedule_kernels(block, tokens: int, schedule) -> list[tuple[str, object, dict, dict]]:
    """(projection, kernel, constexprs, options) of every kernel a Triton schedule launches on `block` at
    `tokens` (the launchers' constexprs; options may carry `descs`, the TMA boxes)."""
    from moetune.codegen.triton.fused_gemv import _GAP, fused_gemv_kernel
    from moetune.codegen.triton.grouped_gemm import grouped_gemm_kernel, grouped_gemm_tma_kernel
    from moetune.codegen.triton.hybrid import hybrid_kernel
    from moetune.codegen.triton.stream_gemv import stream_gemv_kernel

    E, k = block.E, block.k
    be = max(16, 1 << (E - 1).bit_length())
    base = dict(ACT=0, HAS_BIAS=False, W_IN=False, UPCAST=False)
    p = schedule.params
    if schedule.kind == "fused_gemv":  # bf16 weights: 64 elements a 128-byte line
        P = tokens * k
        kl = 1 << max(0, (-(-block.F // 64) - 1).bit_length())
        cx = dict(base, K_TOP=k, KP=1 << (k - 1).bit_length(), BLOCK_E=be, BP=max(16, 1 << (P - 1).bit_length()),
                  FUSED=P <= 64, BF=p.block_f, BK=p.block_k, BD=p.block_d, DBK=p.down_block_k, RB=1, CB=1,
                  FP8=False, UE8M0=False, STAGES=p.num_stages, PDL=p.pdl, PREFETCH=p.prefetch,
                  KL=kl if p.prefetch else 1, LINE=64, SPIN=True, GAP=_GAP)
        return [("fused", fused_gemv_kernel, cx, dict(num_warps=p.num_warps, num_stages=p.num_stages))]
    if schedule.kind == "stream_gemv":
        m = dict(base, K_TOP=k, KP=1 << (k - 1).bit_length(), BLOCK_E=be, BP=16,
                 FUSED=p.fused_route and tokens * k <= 64, ROWS=p.rows, STAGES=p.num_stages)
        down = dict(m, PROJ=2 if p.down_mode == "token" else 1, BN=p.down_block_n, BK=p.down_block_k)
        if p.down_nb > 1:  # (NB left at its default otherwise: the stored winners keep their digests)
            down["NB"] = p.down_nb
        return [("gate_up", stream_gemv_kernel, dict(m, PROJ=0, BN=p.block_n, BK=p.block_k),
                 dict(num_warps=p.num_warps, num_stages=p.num_stages)),
                ("down", stream_gemv_kernel, down, dict(num_warps=p.down_warps, num_stages=p.num_stages))]
    nb = dict(NB=p.down_nb) if getattr(p, "down_nb", 1) > 1 else {}  # grouped_gemm's pointer-path down
    if schedule.kind == "grouped_gemm" and p.tma:
        m = dict(base, BLOCK_E=be, BM=p.block_m, GROUP_M=p.group_m)
        gate_up = dict(m, PROJ=0, BN=p.block_n, BK=p.block_k)
        if p.one_dot:  # (the winners stored before it keep their digests: ONE_DOT left at its default)
            gate_up["ONE_DOT"] = True
        return [("gate_up", grouped_gemm_tma_kernel, gate_up,
                 dict(num_warps=p.num_warps, num_stages=p.num_stages,
                      descs=tma_descs(p.block_m, p.block_n, p.block_k, p.one_dot))),
                ("down", grouped_gemm_tma_kernel, dict(m, PROJ=1, BN=p.down_block_n, BK=p.down_block_k),
                 dict(num_warps=p.down_warps, num_stages=p.down_stages,
                      descs=tma_descs(p.block_m, p.down_block_n, p.down_block_k)))]
    if schedule.kind == "grouped_gemm":
        m = dict(base, K_TOP=k, BLOCK_E=be, BM=p.block_m, GROUP_M=p.group_m)
        return [("gate_up", grouped_gemm_kernel, dict(m, PROJ=0, BN=p.block_n, BK=p.block_k, ONE_DOT=p.one_dot),
                 dict(num_warps=p.num_warps, num_stages=p.num_stages)),
                ("down", grouped_gemm_kernel, dict(m, PROJ=1, BN=p.down_block_n, BK=p.down_block_k, **nb),
                 dict(num_warps=p.down_warps, num_stages=p.down_stages))]
    rp = 1 << max(0, (schedule.row_threshold - 2).bit_length())
    m = dict(base, K_TOP=k, BLOCK_E=be, BM=p.block_m, RP=rp)
    return [("gate_up", hybrid_kernel, dict(m, PROJ=0, BN=p.block_n, BK=p.block_k, BNV=p.gemv_block_n,
                                            BKV=p.gemv_block_k, STAGES=p.num_stages),
             dict(num_warps=p.num_warps, num_stages=p.num_stages)),
            ("down", hybrid_kernel, dict(m, PROJ=1, BN=p.down_block_n, BK=p.down_block_k, BNV=p.down_gemv_block_n,
                                         BKV=p.down_gemv_block_k, STAGES=p.down_stages),
             dict(num_warps=p.down_warps, num_stages=p.down_stages))]


def ptx_digest(k) -> str:
    """sha256[:16] of a compiled kernel's PTX without its debug lines (.loc / .file, comments, labels):
    two sources that compile to the same instructions give the same digest."""
    import hashlib

    lines = k.asm["ptx"].split(".section\t.debug")[0].splitlines()
    keep = [ln for ln in lines if not ln.lstrip().startswith(("//", ".loc", ".file", "$L__")) and "debug" not in ln]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def table_digests(path: str) -> dict[str, str]:
    """PTX digest of every kernel of every entry of a shipped H200 table whose block is a preset, compiled for
    sm_90 at the bucket's first and last T: equal digests before and after a source edit show the edit left
    the stored winners' code unchanged (their timings still hold; `python -m tests.codegen.relabel` acts on it)."""
    from moetune.ir.presets import PRESETS, preset
    from moetune.runtime.table import DispatchTable

    blocks = {b.signature_hash(): b for b in map(preset, PRESETS)}
    out = {}
    with DispatchTable(path, create=False) as t:
        for e in t.entries(backend="triton"):
            block = blocks.get(e.signature)
            if block is None:
                continue
            s = e.schedule(block)
            for T in sorted({e.bucket_lo, e.bucket_hi}):
                for proj, k in compiled_schedule(block, T, s):
                    out[f"{block.name or e.signature} [{e.bucket_lo},{e.bucket_hi}] T={T} {proj}"] = ptx_digest(k)
    return out


def compiled_schedule(block, tokens: int, schedule) -> list[tuple[str, object]]:
    """(projection, sm_90 kernel) of every kernel a Triton schedule launches on `block` at `tokens`: the 16-bit
    kernels here, the FP8 block-quantised ones by fp8_sm90.py (grouped GEMM) and fp8_gemv_sm90.py (GEMV)."""
    if not block.weight_format.quantized:
        return [(proj, compile_sm90(kern, cx, fp32_out=cx.get("PROJ") == 1, **opts))
                for proj, kern, cx, opts in schedule_kernels(block, tokens, schedule)]
    here = os.path.dirname(os.path.abspath(__file__))  # the FP8 compile helpers import this file by name
    if here not in sys.path:
        sys.path.insert(0, here)
    import fp8_gemv_sm90
    import fp8_sm90

    if schedule.kind == "stream_gemv":
        ue8m0 = block.weight_format.scale_dtype == "ue8m0"
        return [(proj, fp8_gemv_sm90.compile_fp8_sm90(cx, ue8m0=ue8m0, fp32_out=cx["PROJ"] == 1, **opts))
                for proj, cx, opts in fp8_gemv_sm90.configs(block, tokens, schedule.params)]
    return [(proj, fp8_sm90.compile_fp8(kern, cx, types, **opts))
            for proj, kern, cx, types, opts in fp8_sm90.schedule_kernels(block, schedule.params)]


def main() -> None:
    """Compile `representative()` (run with TRITON_INTERPRET unset); one JSON line per config."""
    import json
    import re

    for label, kernel, cx, opts in representative():
        k = compile_sm90(kernel, cx, fp32_out=cx.get("PROJ") == 1 or label == "combine", **opts)
        ptx = k.asm["ptx"]
        regs, spill = ptxas_usage(k)
        print(json.dumps(dict(label=label, shared=k.metadata.shared, regs=regs, spill_bytes=spill,
                              tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                              cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)),
                              local=len(re.findall(r"(ld|st)\.local", ptx)),
                              mma=len(re.findall(r"\bmma\.|wgmma", ptx)),
                              wgmma_n=max(map(int, re.findall(r"wgmma\.mma_async\.\S*?m64n(\d+)k", ptx)), default=0),
                              bar_sync=len(re.findall(r"\bbar\.sync|barrier\.sync", ptx)))), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--digests":  # python tests/codegen/triton_sm90.py --digests TABLE
        import json

        print(json.dumps(table_digests(sys.argv[2]), indent=0, sort_keys=True))
    else:
        main()
