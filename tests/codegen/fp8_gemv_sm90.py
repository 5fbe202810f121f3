"""Compile the FP8 stream_gemv kernel for sm_90 on a machine with no GPU and read its resources.

Like triton_sm90.compile_sm90 (pointers 16-byte aligned, sizes and strides multiples of 16, the unit
reduction stride specialised away), with the FP8 kernel's argument types: e4m3 weights, float32 or ue8m0
(uint8) scales. `configs(block, tokens, params)` lists the (projection, constexprs, options) a schedule
launches; `main` prints one JSON line per configuration of the space's representative grid.

    python tests/codegen/fp8_gemv_sm90.py           (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT64_PTRS = {"ids_ptr"}
INT32_PTRS = {"counts_ptr", "sorted_ptr"}
FP8_PTRS = {"w_ptr", "d_ptr"}
SCALE_PTRS = {"s_ptr", "ds_ptr"}
ALIGNED_INTS = {"s_xt", "se", "sn", "up", "sbe", "bup", "s_hp", "s_yt", "N", "K", "k_split", "sse", "ssn", "sup",
                "dse", "dsn", "dsse", "dssn", "dbe", "s_ot", "D", "F"}
UNIT_STRIDES = {"ssk", "dssk"}  # consecutive column blocks: the scale tensors' unit stride


def compile_fp8_sm90(constexprs: dict, *, ue8m0: bool = False, fp32_out: bool = False, kernel: str = "gemv",
                     **options):
    """A kernel compiled for sm_90 with `constexprs`: "gemv" the GEMV's, "hybrid" the FP8 hybrid's."""
    from moetune.codegen.triton.hybrid_fp8 import hybrid_fp8_kernel
    from moetune.codegen.triton.stream_gemv_fp8 import stream_gemv_fp8_kernel

    kernel = dict(gemv=stream_gemv_fp8_kernel, hybrid=hybrid_fp8_kernel)[kernel]
    constexprs = dict(constexprs, UE8M0=ue8m0)
    sig, cx, attrs = {}, {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in constexprs:
            sig[n] = "constexpr"
            cx[(i,)] = constexprs[n]
        elif n.endswith("_ptr"):
            sig[n] = ("*i64" if n in INT64_PTRS else "*i32" if n in INT32_PTRS else "*fp8e4nv" if n in FP8_PTRS
                      else ("*u8" if ue8m0 else "*fp32") if n in SCALE_PTRS
                      else "*fp32" if n == "y_ptr" and fp32_out else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ("alpha", "limit"):
            sig[n] = "fp32"
        elif n in UNIT_STRIDES:
            sig[n] = "constexpr"
            cx[(i,)] = 1
        else:
            sig[n] = "i32"
            if n in ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def configs(block, tokens: int, p) -> list[tuple[str, dict, dict]]:
    """(projection, constexprs, options) of the launches of Fp8GemvParams or Fp8HybridParams `p` on `block` at
    `tokens`."""
    from moetune.codegen.triton import Fp8HybridParams
    from moetune.codegen.triton.layout import cdiv, next_pow2
    from moetune.codegen.triton.stream_gemv_fp8 import FUSED_ROUTE_MAX_PAIRS

    k = block.k
    rb, cb = block.weight_format.block
    if isinstance(p, Fp8HybridParams):
        m = dict(ACT=0, HAS_BIAS=False, W_IN=False, UPCAST=False, K_TOP=k,
                 BLOCK_E=max(16, 1 << (block.E - 1).bit_length()), BM=p.block_m, RB=rb, CB=cb)
        return [("hybrid_gate_up", dict(m, PROJ=0, BN=p.block_n, BK=p.block_k, BNV=p.gemv_block_n,
                                        BKV=p.gemv_block_k, STAGES=p.num_stages),
                 dict(num_warps=p.num_warps, num_stages=p.num_stages)),
                ("hybrid_down", dict(m, PROJ=1, BN=p.down_block_n, BK=p.down_block_k, BNV=p.down_gemv_block_n,
                                     BKV=p.down_gemv_block_k, STAGES=p.down_stages),
                 dict(num_warps=p.down_warps, num_stages=p.down_stages))]
    fused = p.fused_route and tokens * k <= FUSED_ROUTE_MAX_PAIRS
    m = dict(ACT=0, HAS_BIAS=False, W_IN=False, UPCAST=False, K_TOP=k, KP=1 << (k - 1).bit_length(),
             BLOCK_E=max(16, 1 << (block.E - 1).bit_length()),
             BP=max(16, 1 << (tokens * k - 1).bit_length()) if fused else 16,
             FUSED=fused, ROWS=p.rows, RB=rb, CB=cb, STAGES=p.num_stages)
    if p.f16_dot:
        m["F16"] = True
    m.update(PDL=p.pdl, KL=next_pow2(cdiv(block.F, 128)) if p.pdl else 1)
    return [("gate_up", dict(m, PROJ=0, BN=p.block_n, BK=p.block_k),
             dict(num_warps=p.num_warps, num_stages=p.num_stages)),
            ("down", dict(m, PROJ=2 if p.down_mode == "token" else 1, BN=p.down_block_n, BK=p.down_block_k,
                          NB=p.down_nb),
             dict(num_warps=p.down_warps, num_stages=p.num_stages, **({"launch_pdl": True} if p.pdl else {})))]


def resources(k) -> dict:
    ptx = k.asm["ptx"]
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from triton_sm90 import ptxas_usage

    regs, spill = ptxas_usage(k)
    return dict(shared=k.metadata.shared, regs=regs, spill_bytes=spill,
                cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)), local=len(re.findall(r"(ld|st)\.local", ptx)),
                mma=len(re.findall(r"\bmma\.|wgmma", ptx)), cvt_fp8=len(re.findall(r"cvt\.\S*e4m3", ptx)),
                grid_wait=len(re.findall(r"griddepcontrol\.wait", ptx)),
                grid_release=len(re.findall(r"griddepcontrol\.launch_dependents", ptx)),
                prefetch=len(re.findall(r"prefetch\.global\.L2", ptx)))


def sample() -> list[tuple[str, object, object, int]]:
    """(label, block, params, tokens): FP8 presets' defaults at T = 1 and 64 and a grid of the space
    (every tile path, both down modes, both scale dtypes), deduplicated by what they compile."""
    from moetune.codegen.triton import BACKEND, Fp8GemvParams
    from moetune.ir import WeightFormat
    from moetune.ir.presets import preset

    out = []
    for name in ("qwen3-30b-a3b", "mixtral-8x7b"):  # k = 8 and 2: the token-mode down's expert streams
        for sd in ("float32", "ue8m0"):
            block = preset(name).with_weight_format(WeightFormat.fp8_block(scale_dtype=sd))
            for T in (1, 64):
                out.append((f"{name}/{sd}/T{T}/default", block, BACKEND.default(block, "stream_gemv", T).params, T))
    block = preset("qwen3-30b-a3b").with_weight_format(WeightFormat.fp8_block())
    grid = [
        dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        for bn, bk, nw, ns in ((8, 128, 4, 2), (16, 256, 4, 5), (16, 512, 8, 3), (32, 256, 8, 4), (64, 128, 4, 2),
                               (128, 128, 8, 4))
    ] + [
        dict(rows=r, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, down_block_n=dbn, down_block_k=dbk,
             down_mode="expert", fused_route=False)
        for r, bn, bk, nw, dbn, dbk, ns in ((16, 64, 128, 8, 64, 128, 5), (16, 128, 128, 8, 128, 64, 3),
                                            (32, 64, 128, 4, 32, 128, 4), (16, 32, 64, 4, 16, 64, 2))
    ] + [
        dict(rows=r, block_n=bn, block_k=128, num_warps=nw, down_block_n=dbn, down_block_k=128, down_mode="expert",
             fused_route=False, f16_dot=True)
        for r, bn, nw, dbn in ((16, 64, 4, 64), (16, 128, 8, 128), (32, 64, 8, 32))
    ] + [
        dict(down_block_n=dbn, down_block_k=dbk, down_warps=dw, down_nb=nb)
        for dbn, dbk, dw, nb in ((2, 128, 4, 1), (8, 128, 4, 2), (16, 64, 8, 1), (4, 64, 4, 4), (4, 128, 4, 2))
    ] + [
        dict(down_block_n=dbn, down_nb=nb, pdl=True, fused_route=fr)
        for dbn, nb, fr in ((4, 1, True), (8, 2, False))
    ] + [
        dict(down_mode="expert", split_k=s, down_block_n=dbn, down_block_k=dbk, down_warps=dw)
        for s, dbn, dbk, dw in ((1, 16, 512, 4), (2, 32, 256, 8), (4, 8, 128, 4))
    ]
    space = BACKEND.space(block, "stream_gemv")
    for i, g in enumerate(grid):
        out.append((f"qwen3-30b-a3b/grid{i}", block, space.make(**g), 8))
    hy = BACKEND.space(block, "hybrid")
    out += [(f"qwen3-30b-a3b/T{T}/hybrid-default", block, BACKEND.default(block, "hybrid", T).params, T)
            for T in (8, 256)]
    out += [(f"qwen3-30b-a3b/hybrid{i}", block, hy.make(**g), 64) for i, g in enumerate((
        dict(block_m=32, block_n=128, block_k=128, num_warps=8, gemv_block_n=32, down_block_n=128, down_gemv_block_n=8),
        dict(block_m=64, block_n=64, block_k=64, num_stages=3, gemv_block_k=512, num_warps=8, down_block_k=64,
             down_stages=3)))]
    assert isinstance(out[-5][2], Fp8GemvParams)
    return out


def main() -> None:
    seen = set()
    for label, block, p, T in sample():
        ue8 = block.weight_format.scale_dtype == "ue8m0"
        for proj, cx, opts in configs(block, T, p):
            key = (tuple(sorted(cx.items())), tuple(sorted(opts.items())), ue8)
            if key in seen:
                continue
            seen.add(key)
            kind = "hybrid" if proj.startswith("hybrid") else "gemv"
            k = compile_fp8_sm90(cx, ue8m0=ue8, fp32_out=cx.get("PROJ") == 1, kernel=kind, **opts)
            print(json.dumps(dict(label=f"{label}/{proj}", default="default" in label, proj=cx.get("PROJ", 3),
                                  pdl=bool(cx.get("PDL")),
                                  rows=cx.get("ROWS", cx.get("BM", 1)), **resources(k))),
                  flush=True)


if __name__ == "__main__":
    main()
