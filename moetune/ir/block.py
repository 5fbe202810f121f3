"""The MoEBlock IR: one Mixture-of-Experts block, described by numbers only.

Dimension letters, used everywhere in moetune:
    E  routed experts            k  experts per token (top-k)
    D  hidden size               F  expert intermediate size
    T  tokens in a call          m_e rows routed to expert e (Σ m_e = T·k)

Weights are read in the model's own layout (see `WeightLayout`); nothing here holds a tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Literal

from .errors import IRError
from .symbolic import ExpertRows, SymInt

DTYPES = ("float32", "bfloat16", "float16")  # activations, routing weights and unquantised expert weights
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
QUANT_SCHEMES = ("none", "fp8_block")
SCALE_DTYPES = ("float32", "ue8m0")

ActivationKind = Literal["swiglu", "clamped_swiglu"]
RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_grouped_topk"]
WeightApplication = Literal["output", "input"]


@dataclass(frozen=True)
class Activation:
    """How the gate and up halves combine into the F-wide hidden row.

    swiglu          h = silu(g) · u
    clamped_swiglu  g = min(g, limit); u = clamp(u, ±limit); h = (u + 1) · g · σ(alpha·g)   (GPT-OSS)
    """

    kind: ActivationKind = "swiglu"
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        if self.kind == "swiglu":
            if self.alpha is not None or self.limit is not None:
                raise IRError("Activation", "alpha/limit", (self.alpha, self.limit), "swiglu takes neither")
        elif self.kind == "clamped_swiglu":
            if self.alpha is None or self.limit is None or self.limit <= 0:
                raise IRError("Activation", "alpha/limit", (self.alpha, self.limit),
                              "clamped_swiglu needs alpha and a positive limit")
        else:
            raise IRError("Activation", "kind", self.kind, "supported: swiglu, clamped_swiglu")

    def __str__(self) -> str:
        if self.kind == "swiglu":
            return "swiglu"
        return f"clamped_swiglu(alpha={self.alpha:g}, limit={self.limit:g})"


@dataclass(frozen=True)
class Router:
    """The routing function, logits [T, E] → (top-k ids [T, k], weights [T, k]).

    softmax_topk          p = softmax(logits); top-k of p; renormalise the k values iff `renormalize`
    topk_softmax          top-k of logits; softmax over the k values
    sigmoid_grouped_topk  s = σ(logits); c = s + score_bias; keep `topk_group` of `n_group` groups
                          (group score: sum of the top-2 of c); top-k of c; weights gathered from s,
                          renormalised iff `renormalize` (+1e-20), times `scaling`   (DeepSeek-V3)

    `logit_bias`: the router linear has a bias (GPT-OSS). `weights_dtype`: the dtype the experts
    receive the routing weights in ("model" means the hidden-state dtype).
    """

    kind: RouterKind
    renormalize: bool = False
    logit_bias: bool = False
    score_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    compute_dtype: Literal["float32", "model"] = "float32"
    weights_dtype: Literal["float32", "model"] = "model"

    def __post_init__(self) -> None:
        if self.kind not in ("softmax_topk", "topk_softmax", "sigmoid_grouped_topk"):
            raise IRError("Router", "kind", self.kind,
                          "supported: softmax_topk, topk_softmax, sigmoid_grouped_topk")
        if not 1 <= self.topk_group <= self.n_group:
            raise IRError("Router", "topk_group", (self.topk_group, self.n_group), "need 1 ≤ topk_group ≤ n_group")
        if self.kind != "sigmoid_grouped_topk" and (self.score_bias or self.n_group != 1):
            raise IRError("Router", "score_bias/n_group", (self.score_bias, self.n_group),
                          f"only sigmoid_grouped_topk has score bias or groups, not {self.kind}")
        if self.scaling <= 0:
            raise IRError("Router", "scaling", self.scaling, "must be positive")

    def __str__(self) -> str:
        s = self.kind
        if self.kind != "topk_softmax":
            s += f"(renorm={self.renormalize}"
            if self.kind == "sigmoid_grouped_topk":
                s += f", score_bias={self.score_bias}, groups={self.topk_group}/{self.n_group}, scale={self.scaling:g}"
            s += ")"
        if self.logit_bias:
            s += "+logit_bias"
        return s


@dataclass(frozen=True)
class WeightLayout:
    """Where the expert weights live, as transformers 5 stores them in memory.

    standard    gate_up_proj [E, 2F, D] (gate rows 0..F-1, up rows F..2F-1), down_proj [E, D, F]; y = x·Wᵀ
    transposed  gate_up_proj [E, D, 2F], down_proj [E, F, D]; y = x·W
    interleaved gate = even columns/rows of the 2F axis, up = odd ones (GPT-OSS); else gate | up halves
    has_bias    gate_up_proj_bias [E, 2F], down_proj_bias [E, D]
    """

    transposed: bool = False
    interleaved: bool = False
    has_bias: bool = False

    def gate_up_shape(self, E: int, D: int, F: int) -> tuple[int, int, int]:
        return (E, D, 2 * F) if self.transposed else (E, 2 * F, D)

    def down_shape(self, E: int, D: int, F: int) -> tuple[int, int, int]:
        return (E, F, D) if self.transposed else (E, D, F)

    def __str__(self) -> str:
        parts = ["transposed" if self.transposed else "standard"]
        if self.interleaved:
            parts.append("interleaved")
        if self.has_bias:
            parts.append("bias")
        return "+".join(parts)


@dataclass(frozen=True)
class WeightFormat:
    """How the expert weights are stored: element dtype, quantisation scheme, and the scale tensors.

    none       gate_up_proj / down_proj hold `dtype` values (float32, bfloat16, float16); no scales
    fp8_block  they hold float8_e4m3fn values; each expert matrix has one scale per `block` = (rows, cols)
               tile, stored beside it as `<name>_scale_inv` [E, ⌈out/rows⌉, ⌈in/cols⌉] in `scale_dtype`
               (float32, or ue8m0: powers of two); weight = value · scale

    `compute_dtype` is what activations and outputs are in (the model's dtype); for unquantised weights
    it is `dtype`. The signature text of an unquantised format is its dtype alone.
    """

    dtype: str = "bfloat16"
    scheme: str = "none"
    block: tuple[int, int] | None = None
    scale_dtype: str | None = None
    compute_dtype: str | None = None

    def __post_init__(self) -> None:
        node = "WeightFormat"
        if self.scheme not in QUANT_SCHEMES:
            raise IRError(node, "scheme", self.scheme, f"supported: {', '.join(QUANT_SCHEMES)}")
        if self.scheme == "none":
            if self.dtype not in DTYPES:
                raise IRError(node, "dtype", self.dtype, f"unquantised weights: {', '.join(DTYPES)}")
            if self.block is not None or self.scale_dtype is not None:
                raise IRError(node, "block/scale_dtype", (self.block, self.scale_dtype), "unquantised: no scales")
            if self.compute_dtype not in (None, self.dtype):
                raise IRError(node, "compute_dtype", self.compute_dtype, f"unquantised: the weights' {self.dtype}")
            object.__setattr__(self, "compute_dtype", self.dtype)
            return
        if self.dtype != "float8_e4m3fn":
            raise IRError(node, "dtype", self.dtype, "fp8_block weights are float8_e4m3fn")
        if not (isinstance(self.block, tuple) and len(self.block) == 2 and all(
                isinstance(b, int) and b > 0 for b in self.block)):
            raise IRError(node, "block", self.block, "need (rows, cols), positive ints")
        if self.scale_dtype not in SCALE_DTYPES:
            raise IRError(node, "scale_dtype", self.scale_dtype, f"supported: {', '.join(SCALE_DTYPES)}")
        if self.compute_dtype is None:
            object.__setattr__(self, "compute_dtype", "bfloat16")
        if self.compute_dtype not in DTYPES:
            raise IRError(node, "compute_dtype", self.compute_dtype, f"supported: {', '.join(DTYPES)}")

    @classmethod
    def fp8_block(cls, block: tuple[int, int] = (128, 128), scale_dtype: str = "float32",
                  compute_dtype: str = "bfloat16") -> WeightFormat:
        """float8_e4m3fn weights with one `scale_dtype` scale per `block` (DeepSeek-V3 / Qwen3-FP8 style)."""
        return cls("float8_e4m3fn", "fp8_block", tuple(block), scale_dtype, compute_dtype)

    @property
    def quantized(self) -> bool:
        return self.scheme != "none"

    def matrix_bytes(self, rows: int, cols: int) -> float:
        """Bytes of one expert's [rows, cols] weight matrix, its scales included."""
        b = rows * cols * DTYPE_BYTES[self.dtype]
        if self.block is not None:
            br, bc = self.block
            b += -(-rows // br) * -(-cols // bc) * (4 if self.scale_dtype == "float32" else 1)
        return b

    def partial_blocks(self, D: int, F: int) -> str | None:
        """Why experts of hidden size D and intermediate size F do not split into whole blocks of this
        format (gate and up [F, D] each, down [D, F]), or None: moetune reads whole blocks only."""
        if self.block is None:
            return None
        rows, cols = self.block
        bad = [f"{n}={v} is not a multiple of {b}" for n, v, b in
               (("F (gate/up rows)", F, rows), ("D (gate/up cols)", D, cols), ("D (down rows)", D, rows),
                ("F (down cols)", F, cols)) if v % b]
        if not bad:
            return None
        return f"block {rows}x{cols} leaves a partial last block ({'; '.join(dict.fromkeys(bad))})"

    def signature(self) -> str:
        if not self.quantized:
            return self.dtype
        return f"{self.dtype}/{self.scheme}:{self.block[0]}x{self.block[1]}/{self.scale_dtype}/{self.compute_dtype}"

    def __str__(self) -> str:
        return self.signature()


@dataclass(frozen=True)
class SharedExperts:
    """Dense experts every token goes through, added to the routed output.

    `gated`: scaled by σ(x·w_gate) (Qwen2-MoE style). `inside_block`: False when the shared MLP sits
    in the decoder layer rather than in the block (Granite-MoE-Shared), so it is outside the hook.
    """

    F: int
    gated: bool = False
    inside_block: bool = True

    def __post_init__(self) -> None:
        if self.F <= 0:
            raise IRError("SharedExperts", "F", self.F, "must be positive")


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block with symbolic token count `T` and symbolic expert rows `rows`."""

    E: int
    k: int
    D: int
    F: int
    activation: Activation = field(default_factory=Activation)
    router: Router = field(default_factory=lambda: Router("softmax_topk", renormalize=True))
    weight_application: WeightApplication = "output"
    shared: SharedExperts | None = None
    layout: WeightLayout = field(default_factory=WeightLayout)
    weight_dtype: str = "bfloat16"  # the stored element dtype (weight_format.dtype)
    routing_weight_dtype: str = "bfloat16"
    T_max: int = 4096
    name: str = ""  # where it came from (a preset name or a module path); not part of the signature
    weight_format: WeightFormat | None = None  # None: unquantised `weight_dtype` weights

    def __post_init__(self) -> None:
        fmt = self.weight_format
        if (fmt is None or not fmt.quantized) and self.weight_dtype in DTYPES:  # derived from weight_dtype
            object.__setattr__(self, "weight_format", WeightFormat(self.weight_dtype))
        verify(self)

    # symbolic shapes
    @property
    def T(self) -> SymInt:
        return SymInt("T", 1, self.T_max)

    @property
    def rows(self) -> ExpertRows:
        return ExpertRows(self.T, self.E, self.k)

    def replace(self, **changes) -> MoEBlock:
        return dataclasses.replace(self, **changes)

    def with_weight_format(self, fmt: WeightFormat) -> MoEBlock:
        """This block with its expert weights stored in `fmt` (activations stay in fmt.compute_dtype)."""
        return dataclasses.replace(self, weight_dtype=fmt.dtype, weight_format=fmt)

    # sizes
    @property
    def weight_bytes_per_expert(self) -> float:
        fmt = self.weight_format
        b = fmt.matrix_bytes(2 * self.F, self.D) + fmt.matrix_bytes(self.D, self.F)
        if self.layout.has_bias:
            b += (2 * self.F + self.D) * DTYPE_BYTES[fmt.compute_dtype]
        return b

    def signature(self) -> str:
        """Canonical text of everything a kernel's result and speed depend on (dispatch key)."""
        act = self.activation
        act_s = act.kind if act.kind == "swiglu" else f"{act.kind}:{act.alpha!r}:{act.limit!r}"
        return (f"moe/v1 E={self.E} k={self.k} D={self.D} F={self.F} act={act_s} "
                f"apply={self.weight_application} layout={self.layout} "
                f"w={self.weight_format.signature()} rw={self.routing_weight_dtype}")

    def signature_hash(self) -> str:
        return hashlib.sha256(self.signature().encode()).hexdigest()[:16]

    def __str__(self) -> str:
        lines = [
            f"MoEBlock {self.name or '(unnamed)'}  [{self.signature_hash()}]",
            f"  E={self.E} k={self.k} D={self.D} F={self.F}  T∈[1,{self.T_max}]  {self.rows}",
            f"  activation: {self.activation}",
            f"  router: {self.router}  (routing weights {self.routing_weight_dtype}, "
            f"applied to the expert {self.weight_application})",
            f"  weights: {self.weight_format}, layout {self.layout}  "
            f"gate_up {list(self.layout.gate_up_shape(self.E, self.D, self.F))} "
            f"down {list(self.layout.down_shape(self.E, self.D, self.F))}",
        ]
        if self.shared is not None:
            where = "in block" if self.shared.inside_block else "in decoder layer, outside the block"
            lines.append(f"  shared experts: F={self.shared.F} gated={self.shared.gated} ({where})")
        return "\n".join(lines)


def signature_scheme(signature_text: str) -> str:
    """The weight-format scheme a block signature (`MoEBlock.signature`) names: "none" for unquantised."""
    for word in signature_text.split():
        if word.startswith("w="):
            fmt = word[2:].split("/")
            return fmt[1].partition(":")[0] if len(fmt) > 1 else "none"
    return "none"


def verify(block: MoEBlock) -> MoEBlock:
    """Check a MoEBlock's invariants; raise IRError naming the field and the values."""
    node = f"MoEBlock({block.name or block.E})"
    for f_name in ("E", "k", "D", "F", "T_max"):
        v = getattr(block, f_name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise IRError(node, f_name, v, "must be a positive int")
    if block.k > block.E:
        raise IRError(node, "k", block.k, f"top-k larger than E = {block.E}")
    r = block.router
    if r.kind == "sigmoid_grouped_topk":
        if block.E % r.n_group:
            raise IRError(node, "router.n_group", r.n_group, f"does not divide E = {block.E}")
        if block.k > r.topk_group * (block.E // r.n_group):
            raise IRError(node, "router.topk_group", r.topk_group,
                          f"keeps {r.topk_group * (block.E // r.n_group)} experts, fewer than k = {block.k}")
    if block.routing_weight_dtype not in DTYPES:
        raise IRError(node, "routing_weight_dtype", block.routing_weight_dtype, f"supported: {', '.join(DTYPES)}")
    fmt = block.weight_format
    if not isinstance(fmt, WeightFormat):
        raise IRError(node, "weight_dtype", block.weight_dtype,
                      f"unquantised weights: {', '.join(DTYPES)}; other formats need a WeightFormat")
    if fmt.dtype != block.weight_dtype:
        raise IRError(node, "weight_dtype", block.weight_dtype, f"weight_format stores {fmt.dtype}")
    lay = block.layout
    if fmt.quantized and (lay.transposed or lay.interleaved or lay.has_bias):
        raise IRError(node, "layout", str(lay), f"{fmt.scheme} weights: standard layout, halves, no biases "
                      "(as transformers' FP8Experts holds them)")
    if block.weight_application not in ("output", "input"):
        raise IRError(node, "weight_application", block.weight_application, "must be 'output' or 'input'")
    if not isinstance(block.activation, Activation):
        raise IRError(node, "activation", block.activation, "must be an Activation")
    return block
