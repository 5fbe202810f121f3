"""Compile a Triton kernel of moetune for sm_90 on a machine with no GPU and read its resources.

`compile_sm90(kernel, constexprs, **options)` builds real PTX and cubin through
`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`, the way the JIT would on an H200
for the standard bf16 layout: pointers 16-byte aligned, sizes and strides multiples of 16, the unit
reduction stride specialised to 1.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT64_PTRS = {"ids_ptr"}
INT32_PTRS = {"counts_ptr", "sorted_ptr", "hist_ptr"}
FP32_PTRS = {"y_ptr", "dst"}
UNIT_STRIDES = {"sk"}  # contiguous reduction axis of the standard layout
# sizes and strides that are multiples of 16 on every real shape (the JIT marks such ints itself)
ALIGNED_INTS = {"s_xt", "se", "sn", "up", "sbe", "bup", "s_hp", "s_yt", "N", "K", "k_split", "s_ot"}


def compile_sm90(kernel, constexprs: dict, *, fp32_out: bool = False, **options):
    fn = kernel.fn if hasattr(kernel, "fn") else kernel
    names = list(kernel.arg_names)
    sig, cx, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in constexprs or n in UNIT_STRIDES:
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
