"""Compile the FP8 grouped GEMM's kernels (moetune/codegen/triton/grouped_gemm_fp8_kernels.py) for sm_90 on a machine
with no GPU and read their resources, as triton_sm90.py does for the 16-bit kernels: pointers 16-byte
aligned, sizes and strides multiples of 16, the unit reduction stride specialised to 1; the pointers typed
as one call of the schedule passes them (e4m3 weights and, with w8a8, e4m3 activations; fp32 or ue8m0
scales). Run with TRITON_INTERPRET unset: `python tests/codegen/fp8_sm90.py` prints one JSON line per
kernel of a representative grid of the space.
"""

from __future__ import annotations

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_sm90 import ALIGNED_INTS, UNIT_STRIDES, ptxas_usage

FP8_ALIGNED = ALIGNED_INTS | {"s_at", "sse", "ssn", "sup", "s_ast", "s_hsp"}
FP8_UNIT_STRIDES = UNIT_STRIDES | {"ssk"}  # the scales' contiguous K axis


def pointer_types(kernel_name: str, proj: int, a8: bool, ue8m0: bool, y_half: bool, qload: bool = False) -> dict:
    """Each pointer argument's Triton type in one launch of the FP8 grouped GEMM (or its pre-pass)."""
    act = "*fp8e4nv" if a8 and not qload else "*bf16"
    if kernel_name == "quant_rows_kernel":
        return dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32")
    return dict(a_ptr=act if proj == 1 or a8 else "*bf16", as_ptr="*fp32" if a8 and not qload else "*bf16",
                wts_ptr="*bf16", counts_ptr="*i32", sorted_ptr="*i32", w_ptr="*fp8e4nv",
                ws_ptr="*u8" if ue8m0 else "*fp32", h_ptr=act, hs_ptr="*fp32" if a8 and not qload else "*bf16",
                y_ptr="*bf16" if y_half else "*fp32")


def compile_fp8(kernel, constexprs: dict, types: dict, descs: dict | None = None, **options):
    """triton.compile for sm_90 with the pointers typed by `types` (argument name → '*fp8e4nv', ...) and the TMA
    descriptors by `descs` (argument name → (element type, box shape))."""
    descs = descs or {}
    constexprs = dict(constexprs)
    for prm in kernel.params:
        if prm.is_constexpr and prm.name not in constexprs and prm.has_default:
            constexprs[prm.name] = prm.default
    sig, cx, attrs = {}, {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in descs:
            ty, box = descs[n]
            sig[n] = f"tensordesc<{ty}[{', '.join(map(str, box))}]>"
        elif n in constexprs or n in FP8_UNIT_STRIDES:
            sig[n] = "constexpr"
            cx[(i,)] = constexprs.get(n, 1)
        elif n.endswith("_ptr"):
            sig[n] = types[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ("alpha", "limit"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n in FP8_ALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def schedule_kernels(block, params) -> list[tuple[str, object, dict, dict, dict]]:
    """(projection, kernel, constexprs, pointer types, options) of every kernel an Fp8GemmParams schedule
    launches on `block` (the launcher's constexprs)."""
    from moetune.codegen.quant import act_group
    from moetune.codegen.triton.grouped_gemm_fp8 import dot_k
    from moetune.codegen.triton.grouped_gemm_fp8_kernels import grouped_gemm_fp8_kernel, grouped_gemm_fp8_tma_kernel
    from moetune.codegen.triton.quant_rows import quant_rows_kernel, rows_per_program

    p = params
    g = act_group(p.act_quant)
    a8 = g is not None
    ue8m0 = block.weight_format.scale_dtype == "ue8m0"
    r, c = block.weight_format.block
    be = max(16, 1 << (block.E - 1).bit_length())
    m = dict(K_TOP=block.k, BLOCK_E=be, ACT=0, W_IN=False, BM=p.block_m, GROUP_M=p.group_m,
             R=r, C=c, G=g or c, A8=a8, UE8M0=ue8m0, FOLD=p.fold_scale and not a8, EMULATE=False)
    if p.quant_on_load:
        m["QLOAD"] = True
    if p.pdl:
        m["PDL"] = True
    out = []
    br = rows_per_program(g) if a8 else 0  # the pre-pass's rows a program
    if a8 and not p.quant_on_load:
        out.append(("quant_x", quant_rows_kernel, dict(BR=br, G=g, EMULATE=False, PDL=p.pdl),
                    pointer_types("quant_rows_kernel", 0, a8, ue8m0, False),
                    dict(num_warps=4, **({"launch_pdl": True} if p.pdl else {}))))
    kern = grouped_gemm_fp8_tma_kernel if p.tma else grouped_gemm_fp8_kernel
    act = "fp8e4nv" if a8 and not p.quant_on_load else "bf16"
    if p.h_pass:
        m["HPASS"] = True
    for proj, bn, bk, warps, stages in ((0, p.block_n, p.block_k, p.num_warps, p.num_stages),
                                        (1, p.down_block_n, p.down_block_k, p.down_warps, p.down_stages)):
        opts = dict(num_warps=warps, num_stages=stages, **({"launch_pdl": True} if p.pdl else {}))
        ks = dot_k(block, p, proj)
        if p.tma:  # A: the sorted rows (x's gathered copy or h), B: the e4m3 weights, boxes of one dot's columns
            opts["descs"] = dict(a_desc=(act, [p.block_m, ks]), b_desc=("fp8e4nv", [bn, ks]))
        types = pointer_types(kern.fn.__name__, proj, a8, ue8m0, p.y_half, p.quant_on_load)
        if p.h_pass and proj == 0:  # 16-bit h, quantised by its own pass
            types = dict(types, h_ptr="*bf16")
        cx = dict(m, PROJ=proj, BN=bn, BK=bk, KS=ks, **({"NB": p.down_nb} if proj == 1 and p.down_nb > 1 else {}))
        out.append(("gate_up" if proj == 0 else "down", kern, cx, types, opts))
        if p.h_pass and proj == 0:
            out.append(("quant_h", quant_rows_kernel, dict(BR=br, G=g, EMULATE=False, PDL=p.pdl, WAIT_FIRST=True),
                        pointer_types("quant_rows_kernel", 0, a8, ue8m0, False),
                        dict(num_warps=4, **({"launch_pdl": True} if p.pdl else {}))))
    if p.pdl:  # the routing's phases (and the gather) before, the combine after
        from moetune.codegen.triton.combine import block_d, combine_kernel
        from moetune.codegen.triton.layout import next_pow2
        from moetune.codegen.triton.routing import gather_kernel, route_kernel

        ints = dict(ids_ptr="*i64", counts_ptr="*i32", hist_ptr="*i32", sorted_ptr="*i32")
        for phase in (2, 1):
            out.insert(0, (f"route{phase}", route_kernel, dict(PHASE=phase, BLOCK_E=be, C=64, GB=1, PDL=True),
                           ints, dict(num_warps=4, **({"launch_pdl": True} if phase == 1 else {}))))
        if p.tma:
            at = next(i for i, o in enumerate(out) if o[0] == "gate_up")
            out.insert(at, ("gather", gather_kernel, dict(K_TOP=block.k, BLOCK_E=be, BR=16, BD=256, PDL=True),
                            dict(x_ptr=f"*{act}", counts_ptr="*i32", sorted_ptr="*i32", xs_ptr=f"*{act}"),
                            dict(num_warps=4, launch_pdl=True)))

        bd, warps = block_d(block.D, 2 if p.y_half else 4)
        out.append(("combine", combine_kernel,
                    dict(S=p.split_k, K_TOP=block.k, KP=next_pow2(block.k), BD=bd, PDL=True),
                    dict(y_ptr="*bf16" if p.y_half else "*fp32", ids_ptr="*i64", out_ptr="*bf16"),
                    dict(num_warps=warps, launch_pdl=True)))
    return out


def resources(k) -> dict:
    """Shared memory, registers, spills and the instructions the checks look for, of a compiled kernel."""
    ptx = k.asm["ptx"]
    regs, spill = ptxas_usage(k)
    return dict(shared=k.metadata.shared, regs=regs, spill_bytes=spill,
                cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)),
                local=len(re.findall(r"(ld|st)\.local", ptx)),
                mma=len(re.findall(r"\bmma\.|wgmma", ptx)),
                fp8_mma=len(re.findall(r"wgmma\.mma_async\S*e4m3|mma\S*e4m3", ptx)),
                cvt_e4m3=len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx)),
                tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                grid_wait=len(re.findall(r"griddepcontrol\.wait", ptx)),
                grid_release=len(re.findall(r"griddepcontrol\.launch_dependents", ptx)))


QUICK = [  # (tag, preset, params): one point per path the tests' compile check covers
    ("w8a16", "qwen3-30b-a3b", dict(block_m=16, block_n=128, block_k=128, num_stages=4, down_block_n=128,
                                    down_block_k=128, down_stages=4)),
    ("w8a16", "qwen3.5-397b-a17b", dict(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=4,
                                        down_block_n=128, down_block_k=128, down_warps=8, down_stages=4)),
    ("w8a16_exact", "qwen3-30b-a3b", dict(block_m=16, block_n=64, block_k=128, num_stages=4, down_block_n=64,
                                          down_block_k=128, fold_scale=False)),
    ("w8a16", "mixtral-8x7b", dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                                   down_block_n=128, down_block_k=64, down_warps=8, down_stages=4)),
    ("w8a8", "qwen3-30b-a3b", dict(block_m=16, block_n=128, block_k=128, num_stages=4, down_block_n=64,
                                   down_block_k=128, act_quant="fp8_1x128")),
    ("w8a8", "mixtral-8x7b", dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3,
                                  down_block_n=128, down_block_k=128, down_warps=8, act_quant="fp8_1x128")),
    ("w8a8_qload", "deepseek-v3", dict(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3,
                                       down_block_n=128, down_block_k=128, down_warps=8, down_stages=3,
                                       act_quant="fp8_1x128", quant_on_load=True)),
    ("w8a8_tma", "mixtral-8x7b", dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=4,
                                      down_block_n=128, down_block_k=128, down_warps=8, down_stages=4,
                                      act_quant="fp8_1x128", tma=True)),
    ("w8a16_tma", "qwen3-30b-a3b", dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                                        down_block_n=128, down_block_k=64, down_warps=8, down_stages=4, tma=True)),
    ("w8a8_pdl", "qwen3-30b-a3b", dict(block_m=16, block_n=128, block_k=128, num_stages=4, down_block_n=128,
                                       down_block_k=128, act_quant="fp8_1x128", pdl=True)),
    ("w8a8_tma_pdl", "qwen3.5-397b-a17b", dict(block_m=16, block_n=128, block_k=128, num_stages=4,
                                               down_block_n=128, down_block_k=128, act_quant="fp8_1x128", tma=True,
                                               pdl=True)),
    ("w8a8_k256", "mixtral-8x7b", dict(block_m=16, block_n=128, block_k=256, num_stages=3, down_block_n=64,
                                       down_block_k=256, down_stages=3, act_quant="fp8_1x128")),
    ("w8a8_k256_tma_pdl", "qwen3.5-397b-a17b", dict(block_m=16, block_n=128, block_k=256, num_stages=3,
                                                    down_block_n=128, down_block_k=256, down_stages=3,
                                                    act_quant="fp8_1x128", tma=True, y_half=True, pdl=True)),
    ("w8a8_h_pass_k256", "mixtral-8x7b", dict(block_m=16, block_n=64, block_k=256, num_stages=3, down_block_n=64,
                                              down_block_k=128, down_stages=4, act_quant="fp8_1x128", h_pass=True)),
    ("w8a8_h_pass_tma_pdl", "qwen3.5-397b-a17b", dict(block_m=16, block_n=64, block_k=128, num_stages=4,
                                                      down_block_n=128, down_block_k=128, act_quant="fp8_1x128",
                                                      h_pass=True, tma=True, pdl=True)),
    ("w8a8_h_pass_down_nb4", "qwen3-30b-a3b", dict(block_m=16, block_n=64, block_k=128, num_stages=4,
                                                  down_block_n=64, down_block_k=128, down_stages=4, down_nb=4,
                                                  act_quant="fp8_1x128", h_pass=True)),
    ("w8a8_down_nb2_tma_pdl", "qwen3-30b-a3b", dict(block_m=16, block_n=128, block_k=128, num_stages=4,
                                                   down_block_n=128, down_block_k=128, down_stages=3, down_nb=2,
                                                   act_quant="fp8_1x128", tma=True, y_half=True, pdl=True)),
    ("w8a8_qload_k256_tma", "qwen3.5-397b-a17b", dict(block_m=16, block_n=64, block_k=256, num_stages=3,
                                                      down_block_n=128, down_block_k=256, down_stages=3,
                                                      act_quant="fp8_1x128", quant_on_load=True, tma=True)),
]
EXTRA = [  # compiled by the full run only: candidates whose resources are worth knowing
    ("w8a8_qload", "mixtral-8x7b", dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3,
                                        down_block_n=256, down_block_k=128, down_warps=8, down_stages=3,
                                        act_quant="fp8_1x128", quant_on_load=True)),
    ("w8a8_qload", "qwen3-30b-a3b", dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4,
                                         down_block_n=128, down_block_k=128, down_warps=4, down_stages=4,
                                         act_quant="fp8_1x128", quant_on_load=True)),
    ("w8a8_qload", "qwen3-30b-a3b", dict(block_m=16, block_n=64, block_k=128, num_stages=4, down_block_n=64,
                                         down_block_k=128, down_stages=4, act_quant="fp8_1x128",
                                         quant_on_load=True)),
    ("w8a8", "mixtral-8x7b", dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3,
                                  down_block_n=256, down_block_k=128, down_warps=8, down_stages=3,
                                  act_quant="fp8_1x128")),
    ("w8a8_qload_tma", "deepseek-v3", dict(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3,
                                           down_block_n=128, down_block_k=128, down_warps=8, down_stages=3,
                                           act_quant="fp8_1x128", quant_on_load=True, tma=True)),
]


def presets(scale_dtype: str = "float32") -> dict:
    """The FP8 presets' blocks (128×128 weight blocks); mixtral-8x7b with ue8m0 scales (both scale paths)."""
    from moetune.ir import MoEBlock, WeightFormat

    shapes = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3.5-397b-a17b": (512, 10, 4096, 1024),
              "deepseek-v3": (256, 8, 7168, 2048), "mixtral-8x7b": (8, 2, 4096, 14336)}
    return {n: MoEBlock(E=E, k=k, D=D, F=F, name=n).with_weight_format(
        WeightFormat.fp8_block(scale_dtype="ue8m0" if n == "mixtral-8x7b" else scale_dtype))
        for n, (E, k, D, F) in shapes.items()}


def representative(quick: bool = False) -> list[tuple[str, object, object]]:
    """(label, block, params): QUICK's points; unless `quick`, also the default of every preset at the
    timing script's token counts and the GPU tests' sample of the space (both act_quant settings)."""
    from test_triton_fp8_grouped_gemm import GPU_SAMPLE

    from moetune.codegen.triton import BACKEND

    blocks = presets()
    points = [(tag, blocks[n], g) for tag, n, g in QUICK]
    if not quick:
        points += [(tag, blocks[n], g) for tag, n, g in EXTRA]
        for block in blocks.values():
            for T in (64, 128, 256, 512, 1024):
                p = BACKEND.default(block, "grouped_gemm", T).params
                points.append((f"default_T{T}", block, {f: getattr(p, f) for f in p.__dataclass_fields__}))
            points += [(f"sample{i}", block, g) for i, g in enumerate(GPU_SAMPLE)]
    out, seen = [], set()
    for tag, block, g in points:
        p = BACKEND.space(block, "grouped_gemm").make(**g)  # the target's limits: refused points fail here
        key = (block.name, p)
        if key in seen:
            continue
        seen.add(key)
        out.append((f"{tag}/m{p.block_m}/{block.name}", block, p))
    return out


def main(quick: bool = False) -> None:
    for label, block, p in representative(quick):
        for proj, kern, cx, types, opts in schedule_kernels(block, p):
            k = compile_fp8(kern, cx, types, **opts)
            print(json.dumps(dict(label=f"{label}/{proj}", a8=p.act_quant != "none", pdl=p.pdl, h_pass=p.h_pass,
                                  **resources(k))), flush=True)


if __name__ == "__main__":  # python tests/codegen/fp8_sm90.py [--quick]
    sys.exit(main(quick="--quick" in sys.argv))
