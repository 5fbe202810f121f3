"""What the kernels suite times moetune against: transformers' experts functions (grouped_mm, batched_mm) on a
stand-in module, its FP8Experts module with each of them, its eager experts loop op for op, and transformers' FP8
kernel (finegrained-fp8) from a local copy of its source instead of the hub.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import torch

from moetune.ir import MoEBlock


def standin(w, E: int) -> types.SimpleNamespace:
    """The attributes transformers' experts functions read from an experts module."""
    from transformers.integrations import moe as hf

    m = types.SimpleNamespace(gate_up_proj=w.gate_up, down_proj=w.down, num_experts=E, has_gate=True,
                              has_bias=False, is_transposed=False, _is_expert_parallel=False,
                              has_post_expert_norm=False, act_fn=torch.nn.functional.silu)
    m._apply_gate = types.MethodType(hf._default_apply_gate, m)
    return m


def hf_fn(name: str, w, E: int):
    from transformers.integrations import moe as hf

    f = {"grouped_mm": hf.grouped_mm_experts_forward, "batched_mm": hf.batched_mm_experts_forward}[name]
    m = standin(w, E)
    return lambda x, ids, wt, _w: f(m, x, ids, wt)


def hf_fp8_fn(name: str, w, block: MoEBlock):
    """transformers' own FP8 experts module (FP8Experts behind its FP8 experts hook, built as its FP8 loading builds
    it: `moetune.testing.fp8.fp8_experts_class`) holding the bench's FP8 tensors in place, run with experts
    implementation `name` through its forward ("eager": FP8Experts' own loop)."""
    from moetune.testing.fp8 import fp8_experts_class

    cfg = types.SimpleNamespace(hidden_size=block.D, num_experts=block.E, num_local_experts=block.E,
                                moe_intermediate_size=block.F, intermediate_size=block.F, hidden_act="silu",
                                _experts_implementation=name)
    with torch.device("meta"):
        m = fp8_experts_class()(cfg, block_size=block.weight_format.block)
    for attr, t in (("gate_up_proj", w.gate_up), ("down_proj", w.down), ("gate_up_proj_scale_inv", w.gate_up_scale),
                    ("down_proj_scale_inv", w.down_scale)):
        setattr(m, attr, torch.nn.Parameter(t, requires_grad=False))
    return lambda x, ids, wt, _w: m(x, ids, wt)


def fp8_kernel_package(folder: str) -> Path:
    """The finegrained_fp8 package in `folder`, or FileNotFoundError naming the folder."""
    pkg = Path(folder) / "finegrained_fp8"
    if not (pkg / "__init__.py").is_file():
        raise FileNotFoundError(f"--hf-fp8-kernel {folder}: no finegrained_fp8/__init__.py in it (give the folder "
                                "that holds the kernel's package, its source tree's torch-ext)")
    return pkg


def use_fp8_kernel_source(folder: str) -> dict:
    """Give transformers' FP8 experts the finegrained-fp8 Triton kernel from a local copy of its source instead of
    the hub download it asks for: `folder` holds the kernel's `finegrained_fp8` package (the `torch-ext` folder of
    its source tree). The package is imported as the hub build would be (its generated `_ops` module, the torch op
    namespace, made here when the source has none) and its three entry points put where transformers keeps the
    loaded kernel. Returns what names the source in the results: a digest of the package's files and the version
    its source tree's build.toml gives the hub build (None without one)."""
    import hashlib
    import importlib

    from transformers.integrations import finegrained_fp8 as f8

    pkg = fp8_kernel_package(folder)
    if not (pkg / "_ops.py").is_file() and "finegrained_fp8._ops" not in sys.modules:
        ops = types.ModuleType("finegrained_fp8._ops")
        ops.ops = torch.ops._finegrained_fp8_local
        ops.add_op_namespace_prefix = lambda op: f"_finegrained_fp8_local::{op}"
        sys.modules["finegrained_fp8._ops"] = ops
    sys.path.insert(0, str(Path(folder).resolve()))
    kernel = importlib.import_module("finegrained_fp8")
    f8._FINEGRAINED_FP8 = f8.FineGrainedFP8(matmul=kernel.matmul_2d, batched_matmul=kernel.matmul_batched,
                                            grouped_matmul=kernel.matmul_grouped)
    digest = hashlib.sha256()
    for f in sorted(pkg.glob("*.py")):
        digest.update(f.name.encode() + f.read_bytes())
    toml = Path(folder).resolve().parent / "build.toml"
    version = re.search(r"^version\s*=\s*(\d+)", toml.read_text(), re.M) if toml.is_file() else None
    return dict(sha256=digest.hexdigest()[:16], version=int(version.group(1)) if version else None)


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
