"""Capture: find the MoE blocks of a transformers model and describe each one as a `MoEBlock`.

Blocks are recognised by their modules, not traced (see the transformers notes, §7):

1. An *experts* module is a child named `experts`. It is *hooked* when it carries the attributes
   of transformers' `@use_experts_implementation` (`has_gate`, `is_transposed`) and its class
   forward is the decorator's wrapper (`__wrapped__`). Its parent is the *block*.
2. The *router* is the block's child `gate` or `router`; its kind comes from `ROUTERS`, a table
   keyed by the router's qualified class name, never from generic attributes.
3. E, D, F come from the live parameter shapes and the hook's layout flags; k from the router;
   the activation from `config.hidden_act` (default `_apply_gate`) or from `ACTIVATIONS`.
4. With `check=True` the real router runs on random inputs and its ids (as sets) and weights
   are compared with `routing.route` of the captured spec; a mismatch leaves the block alone.

FP8 experts (transformers' `FP8Experts`, behind its FP8 experts hook) are captured with an fp8_block
`WeightFormat` read off the module: float8_e4m3fn weights, one `*_scale_inv` per `block_size` tile in
float32 or ue8m0 (float8_e8m0fnu), activations and outputs in the model's dtype (the router's). What the
kernels cannot read is refused with the reason: static activation scales, per-tensor scales
(block_size None), FP4 experts, no gate projection, sizes that end in a partial block, scale tensors of
another shape. Attributes are read defensively and the format is judged from the tensors' dtypes and
shapes, so FP8Experts of other transformers versions are captured or refused by what they hold.

Whatever is not captured comes back with `block=None` and the reason, which starts with the block's path and
class ("model.layers.0.mlp (Qwen3MoeSparseMoeBlock): ..."); the model is never changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .block import DTYPES, Activation, MoEBlock, Router, SharedExperts, WeightFormat, WeightLayout
from .errors import CaptureError, MoetuneError
from .routing import route, router_logits, selection_scores


@dataclass(frozen=True)
class Captured:
    """One block found in a model: its IR, or the reason it was left as it is."""

    path: str  # qualified name of the block module (parent of `experts`)
    block_class: str
    block: MoEBlock | None  # None when not captured
    reason: str | None  # why not captured (None when captured)
    experts: torch.nn.Module | None = field(default=None, compare=False, repr=False)
    router: torch.nn.Module | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.block is not None


def _tf(module: str, cls: str) -> str:
    return f"transformers.models.{module}.modeling_{module}.{cls}"


def _softmax_topk_flag(weights_dtype: str = "model") -> Callable[[torch.nn.Module], Router]:
    """softmax → top-k, renormalised iff the module's `norm_topk_prob` (Qwen2/3-MoE, OLMoE)."""
    return lambda m: Router("softmax_topk", renormalize=bool(m.norm_topk_prob), compute_dtype="model",
                            weights_dtype=weights_dtype)


def _deepseek_v3(m: torch.nn.Module) -> Router:
    return Router("sigmoid_grouped_topk", renormalize=bool(m.norm_topk_prob), score_bias=True,
                  n_group=int(m.num_group), topk_group=int(m.topk_group),
                  scaling=float(m.routed_scaling_factor), compute_dtype="float32", weights_dtype="float32")


# Router class (qualified name) → the Router spec built from that module's attributes.
# Read from transformers 5.17 and 5.24; the router check confirms each entry on every captured block.
ROUTERS: dict[str, Callable[[torch.nn.Module], Router]] = {
    _tf("mixtral", "MixtralTopKRouter"):
        lambda m: Router("softmax_topk", renormalize=True, compute_dtype="model", weights_dtype="float32"),
    _tf("qwen2_moe", "Qwen2MoeTopKRouter"): _softmax_topk_flag(),
    _tf("qwen3_moe", "Qwen3MoeTopKRouter"): _softmax_topk_flag(),
    _tf("qwen3_next", "Qwen3NextTopKRouter"): _softmax_topk_flag(),
    _tf("olmoe", "OlmoeTopKRouter"): _softmax_topk_flag(),
    _tf("qwen3_5_moe", "Qwen3_5MoeTopKRouter"):
        lambda m: Router("softmax_topk", renormalize=True, compute_dtype="model"),
    _tf("deepseek_v3", "DeepseekV3TopkRouter"): _deepseek_v3,
    _tf("gpt_oss", "GptOssTopKRouter"):
        lambda m: Router("topk_softmax", logit_bias=True, compute_dtype="model"),
    _tf("granitemoe", "GraniteMoeTopKRouter"): lambda m: Router("topk_softmax", compute_dtype="model"),
    _tf("granitemoeshared", "GraniteMoeSharedTopKRouter"):
        lambda m: Router("topk_softmax", compute_dtype="model"),
}

# Experts classes that override `_apply_gate` with an activation moetune knows.
ACTIVATIONS: dict[str, Callable[[torch.nn.Module], Activation]] = {
    _tf("gpt_oss", "GptOssExperts"):
        lambda m: Activation("clamped_swiglu", alpha=float(m.alpha), limit=float(m.limit)),
}

# Blocks whose experts do not take transformers' experts hook, and why moetune leaves them alone.
UNHOOKED: dict[str, str] = {
    _tf("llama4", "Llama4TextMoe"):
        "Llama4: no experts hook (Llama4TextExperts is not @use_experts_implementation); the routing "
        "score scales the expert input and every expert runs on all tokens (dense bmm)",
    _tf("dbrx", "DbrxFFN"):
        "DBRX: no experts hook (DbrxExperts is not @use_experts_implementation); flat [E·F, D] "
        "weights and p-norm renormalisation of the routing weights",
}

SILU_NAMES = ("silu", "swish")
_CHECK_TOKENS = (1, 7, 64)  # router check: token counts of the random inputs


def qualname(obj: object) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_hooked(experts: torch.nn.Module) -> bool:
    """True for an experts module that carries transformers' experts hook."""
    return (hasattr(experts, "has_gate") and hasattr(experts, "is_transposed")
            and hasattr(type(experts).forward, "__wrapped__"))


def capture(model: torch.nn.Module, *, check: bool = True, T_max: int = 4096) -> list[Captured]:
    """Every MoE block in `model`, in module order: captured (with its MoEBlock) or not (with a reason)."""
    modules = dict(model.named_modules())
    found = []
    for path, mod in modules.items():
        experts = mod._modules.get("experts")
        if experts is None:
            continue
        router = mod._modules.get("gate")
        if router is None:
            router = mod._modules.get("router")
        where = f"{path} ({type(mod).__name__})"  # every reason starts with it
        try:
            block = _describe(modules, path, mod, experts, router, T_max)
            if check:
                check_router(block, router, experts)
        except MoetuneError as e:  # CaptureError, or IRError from a MoEBlock that breaks an invariant
            why = str(e) if str(e).startswith(where) else f"{where}: {e}"
            found.append(Captured(path, type(mod).__name__, None, why, experts, router))
            continue
        except Exception as e:  # the model's own router failed on the check's inputs: leave the block
            why = f"{where}: router check could not run {type(router).__name__}: {type(e).__name__}: {e}"
            found.append(Captured(path, type(mod).__name__, None, why, experts, router))
            continue
        found.append(Captured(path, type(mod).__name__, block, None, experts, router))
    return found


def router_tensors(router_module: torch.nn.Module, spec: Router
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight [E, D], logit bias [E] or None, score bias [E] or None) of a captured router module."""
    bias = router_module.bias if spec.logit_bias else None
    score_bias = router_module.e_score_correction_bias if spec.score_bias else None
    return router_module.weight, bias, score_bias


# --- description from the modules ---------------------------------------------------------------

def _describe(modules: dict[str, torch.nn.Module], path: str, block_mod: torch.nn.Module,
              experts: torch.nn.Module, router: torch.nn.Module | None, T_max: int) -> MoEBlock:
    where = f"{path} ({type(block_mod).__name__})"
    ecls = qualname(experts)
    names = [c.__name__ for c in type(experts).__mro__] + [type(block_mod).__name__]
    if any(n.startswith("Mxfp4") for n in names):
        raise CaptureError(f"{where}: quantized experts {type(experts).__name__} (MXFP4) are not "
                           "supported; left as is")
    fp8 = is_fp8_experts(experts)
    if not is_hooked(experts):
        why = UNHOOKED.get(qualname(block_mod))
        raise CaptureError(f"{where}: " + (why or f"experts module {ecls} has no transformers experts hook "
                                                   "(@use_experts_implementation)") + "; left as is")
    if getattr(experts, "_is_expert_parallel", False):
        raise CaptureError(f"{where}: expert-parallel experts (_is_expert_parallel=True, local num_experts="
                           f"{getattr(experts, 'num_experts', '?')}) are not supported; left as is")
    if getattr(experts, "has_post_expert_norm", False):
        raise CaptureError(f"{where}: experts with a norm after each expert (has_post_expert_norm=True) "
                           "are not supported; left as is")
    if not experts.has_gate:
        raise CaptureError(f"{where}: experts without a gate projection (has_gate=False, up_proj only) "
                           "are not supported; left as is")
    if router is None:
        raise CaptureError(f"{where}: no router child named 'gate' or 'router'")
    rcls = qualname(router)
    if rcls not in ROUTERS:
        raise CaptureError(f"{where}: unknown router class {rcls}; known: "
                           + ", ".join(sorted(c.rsplit('.', 1)[1] for c in ROUTERS)))
    spec = ROUTERS[rcls](router)
    activation = _fp8_activation(where, experts) if fp8 else _activation(where, experts)

    layout = WeightLayout(transposed=bool(experts.is_transposed), interleaved=not experts.is_concatenated,
                          has_bias=bool(experts.has_bias))
    gate_up, down = _param(where, experts, "gate_up_proj", 3), _param(where, experts, "down_proj", 3)
    if fp8 and (gate_up.dtype == torch.int8 or getattr(experts, "expert_dtype", "fp8") == "fp4"):
        raise CaptureError(f"{where}: FP4 experts (e2m1 packed two per int8, expert_dtype='fp4') are not "
                           "supported; supported: float8_e4m3fn weights")
    rw = _param(where, router, "weight", 2)
    E, D = rw.shape
    F = down.shape[1] if layout.transposed else down.shape[2]
    want = {
        "experts.gate_up_proj": (gate_up, layout.gate_up_shape(E, D, F)),
        "experts.down_proj": (down, layout.down_shape(E, D, F)),
    }
    if layout.has_bias:
        want["experts.gate_up_proj_bias"] = (_param(where, experts, "gate_up_proj_bias", 2), (E, 2 * F))
        want["experts.down_proj_bias"] = (_param(where, experts, "down_proj_bias", 2), (E, D))
    if spec.logit_bias:
        want["router.bias"] = (_param(where, router, "bias", 1), (E,))
    if spec.score_bias:
        want["router.e_score_correction_bias"] = (_param(where, router, "e_score_correction_bias", 1), (E,))
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise CaptureError(f"{where}: {name} has shape {list(t.shape)}, expected {list(shape)} for "
                               f"router.weight {list(rw.shape)} (E={E}, D={D}) and F={F} "
                               f"in the {layout} layout")
    n_exp = getattr(experts, "num_experts", E)
    if n_exp != E:
        raise CaptureError(f"{where}: experts.num_experts = {n_exp} but router.weight has E = {E} rows")
    k = int(getattr(router, "top_k", 0))

    fmt = None
    if fp8:
        fmt = _fp8_format(where, experts, router, spec, gate_up, down, E, D, F)
        wdt = fmt.compute_dtype
    else:
        wdt = str(gate_up.dtype).replace("torch.", "")
    if fmt is None and wdt not in DTYPES:
        raise CaptureError(f"{where}: expert weights are {wdt}; supported: {', '.join(DTYPES)}; left as is")
    if fmt is None and str(down.dtype).replace("torch.", "") != wdt:
        raise CaptureError(f"{where}: experts.down_proj is {down.dtype} but gate_up_proj is {gate_up.dtype}")
    rwdt = "float32" if spec.weights_dtype == "float32" else wdt
    block = MoEBlock(E=E, k=k, D=D, F=F, activation=activation, router=spec, weight_application="output",
                     shared=_shared(where, modules, path, block_mod), layout=layout, weight_dtype=wdt,
                     routing_weight_dtype=rwdt, T_max=T_max, name=path)
    return block if fmt is None else block.with_weight_format(fmt)


# --- FP8 experts ---------------------------------------------------------------------------------

_SCALE_DTYPES = {"float32": "float32", "float8_e8m0fnu": "ue8m0"}  # scale tensor dtype → WeightFormat's


def is_fp8_experts(experts: torch.nn.Module) -> bool:
    """True for transformers' FP8Experts (or a subclass of it)."""
    return any(c.__name__ == "FP8Experts" for c in type(experts).__mro__)


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _fp8_activation(where: str, experts: torch.nn.Module) -> Activation:
    """The activation of FP8Experts' own `_apply_gate`: SwiGLU of the halves, clamped (GPT-OSS style) when
    the module has swiglu_alpha and swiglu_limit; a softcapped or clamp-only gate is refused."""
    gate_fn = getattr(type(experts), "_apply_gate", None)
    owner = getattr(gate_fn, "__qualname__", "")
    if owner != "FP8Experts._apply_gate" and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        raise CaptureError(f"{where}: {type(experts).__name__} overrides FP8Experts._apply_gate ({owner}); "
                           "moetune knows FP8Experts' own gate only")
    if getattr(experts, "gate_softcap", None) is not None or getattr(experts, "up_softcap", None) is not None:
        raise CaptureError(f"{where}: FP8 experts with a softcapped SwiGLU (mlp_gate_softcap="
                           f"{getattr(experts, 'gate_softcap', None)}) are not supported; supported: swiglu, "
                           "clamped_swiglu")
    alpha, limit = getattr(experts, "swiglu_alpha", None), getattr(experts, "swiglu_limit", None)
    if alpha is not None:
        if limit is None:
            raise CaptureError(f"{where}: FP8 experts with swiglu_alpha={alpha} but no swiglu_limit")
        return Activation("clamped_swiglu", alpha=float(alpha), limit=float(limit))
    if getattr(experts, "limit", None) is not None:
        raise CaptureError(f"{where}: FP8 experts clamp the gate at limit={experts.limit} without swiglu_alpha; "
                           "supported: swiglu, clamped_swiglu")
    cfg = getattr(experts, "config", None)
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act is None:
        act = "silu" if type(getattr(experts, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation") else None
    if act not in SILU_NAMES:
        raise CaptureError(f"{where}: activation hidden_act={act!r} is not supported; supported: silu (SwiGLU)")
    return Activation("swiglu")


def _fp8_block_size(where: str, experts: torch.nn.Module, down_scale: torch.Tensor, D: int, F: int
                    ) -> tuple[int, int]:
    """The module's `block_size` as (rows, cols); where the module has no such attribute, the block that
    makes down_proj_scale_inv [E, D/rows, F/cols] whole."""
    if hasattr(experts, "block_size"):
        bs = experts.block_size
        if bs is None:
            raise CaptureError(f"{where}: FP8 experts with per-tensor scales (block_size=None) are not "
                               "supported; supported: fp8_block (one scale per block, e.g. 128x128)")
        try:
            rows, cols = (int(b) for b in bs)
        except (TypeError, ValueError):
            raise CaptureError(f"{where}: FP8 experts block_size={bs!r}, expected (rows, cols)") from None
        return rows, cols
    nr, nc = down_scale.shape[-2:]
    if nr and nc and D % nr == 0 and F % nc == 0:
        return D // nr, F // nc
    raise CaptureError(f"{where}: FP8 experts without block_size whose down_proj_scale_inv "
                       f"{list(down_scale.shape)} does not divide D={D}, F={F} into whole blocks")


def _fp8_format(where: str, experts: torch.nn.Module, router: torch.nn.Module, spec: Router, gate_up: torch.Tensor,
                down: torch.Tensor, E: int, D: int, F: int) -> WeightFormat:
    """The fp8_block WeightFormat of an FP8Experts module, or CaptureError naming what does not fit."""
    scheme = getattr(experts, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CaptureError(f"{where}: FP8 experts with activation_scheme={scheme!r} (per-tensor activation "
                           "scales) are not supported; supported: dynamic")
    for name, t in (("gate_up_proj", gate_up), ("down_proj", down)):
        if t.dtype != torch.float8_e4m3fn:
            raise CaptureError(f"{where}: FP8 experts.{name} is {_dt(t)}; supported: float8_e4m3fn")
    scales = {n: getattr(experts, f"{n}_scale_inv", None) for n in ("gate_up_proj", "down_proj")}
    for n, s in scales.items():
        if not isinstance(s, torch.Tensor) or s.dim() != 3:
            got = None if not isinstance(s, torch.Tensor) else list(s.shape)
            raise CaptureError(f"{where}: FP8 experts.{n}_scale_inv is {got}, expected [E, rows, cols] "
                               "block scales")
    gus, dns = scales["gate_up_proj"], scales["down_proj"]
    rows, cols = _fp8_block_size(where, experts, dns, D, F)
    partial = WeightFormat.fp8_block((rows, cols)).partial_blocks(D, F)
    if partial:
        raise CaptureError(f"{where}: FP8 experts of D={D}, F={F}: {partial}; moetune reads whole blocks only")
    want = {"gate_up_proj_scale_inv": (gus, (E, 2 * F // rows, D // cols)),
            "down_proj_scale_inv": (dns, (E, D // rows, F // cols))}
    for n, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise CaptureError(f"{where}: experts.{n} has shape {list(t.shape)}, expected {list(shape)} for "
                               f"E={E}, D={D}, F={F} in {rows}x{cols} blocks")
    sdt = {_dt(gus), _dt(dns)}
    if len(sdt) != 1 or next(iter(sdt)) not in _SCALE_DTYPES:
        raise CaptureError(f"{where}: FP8 block scales are {' and '.join(sorted(sdt))}; supported: "
                           f"{', '.join(_SCALE_DTYPES)} (both tensors alike)")
    # activations are in the model's dtype: that of a router computing in it (its weight meets them in one
    # matrix product), else the config's, else the router's (DeepSeek-V3 keeps a float32 one)
    if spec.compute_dtype == "model":
        compute = _dt(router.weight)
    else:
        compute = str(getattr(getattr(experts, "config", None), "dtype", None) or _dt(router.weight))
    compute = compute.replace("torch.", "")
    if compute not in DTYPES:
        raise CaptureError(f"{where}: FP8 experts in a {compute} model; supported: {', '.join(DTYPES)}")
    return WeightFormat.fp8_block((rows, cols), _SCALE_DTYPES[next(iter(sdt))], compute)


def _param(where: str, mod: torch.nn.Module, name: str, ndim: int) -> torch.Tensor:
    t = getattr(mod, name, None)
    if not isinstance(t, torch.Tensor):
        raise CaptureError(f"{where}: {type(mod).__name__} has no tensor '{name}'")
    if t.dim() != ndim:
        raise CaptureError(f"{where}: {type(mod).__name__}.{name} has shape {list(t.shape)}, "
                           f"expected {ndim} dims")
    return t


def _activation(where: str, experts: torch.nn.Module) -> Activation:
    gate_fn = getattr(type(experts), "_apply_gate", None)
    default = (getattr(gate_fn, "__name__", "") == "_default_apply_gate"
               and getattr(gate_fn, "__module__", "") == "transformers.integrations.moe")
    if not default:
        make = ACTIVATIONS.get(qualname(experts))
        if make is None:
            raise CaptureError(f"{where}: {type(experts).__name__} overrides _apply_gate with an activation "
                               f"moetune does not know; known: {', '.join(sorted(ACTIVATIONS)) or 'none'}")
        return make(experts)
    act = getattr(getattr(experts, "config", None), "hidden_act", None)
    if act is None:  # no config: judge from the module
        act_cls = type(getattr(experts, "act_fn", None)).__name__
        act = "silu" if act_cls in ("SiLU", "SiLUActivation") else None
    if act not in SILU_NAMES:
        raise CaptureError(f"{where}: activation hidden_act={act!r} is not supported; "
                           "supported: silu (SwiGLU)")
    return Activation("swiglu")


def _shared(where: str, modules: dict[str, torch.nn.Module], path: str, block_mod: torch.nn.Module
            ) -> SharedExperts | None:
    ch = block_mod._modules
    parent = modules.get(path.rsplit(".", 1)[0]) if "." in path else None
    if ch.get("shared_expert") is not None:
        mlp, gated, inside = ch["shared_expert"], ch.get("shared_expert_gate") is not None, True
    elif ch.get("shared_experts") is not None:
        mlp, gated, inside = ch["shared_experts"], False, True
    elif parent is not None and parent._modules.get("shared_mlp") is not None:
        mlp, gated, inside = parent._modules["shared_mlp"], False, False
    else:
        return None
    F = _shared_F(where, mlp)
    return SharedExperts(F, gated=gated, inside_block=inside) if F > 0 else None  # size 0: none


def _shared_F(where: str, mlp: torch.nn.Module) -> int:
    gp = getattr(mlp, "gate_proj", None)
    if isinstance(gp, torch.nn.Linear):
        return gp.out_features
    il = getattr(mlp, "input_linear", None)  # Granite: fused [2·Fs, D]
    if isinstance(il, torch.nn.Linear):
        return il.out_features // 2
    raise CaptureError(f"{where}: shared experts {type(mlp).__name__} have neither gate_proj "
                       "nor input_linear")


# --- the router check ---------------------------------------------------------------------------

def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for routing weights handed over in `dtype`: one rounding to it, with a margin."""
    return max(torch.finfo(dtype).eps, 1e-5), 1e-6


@torch.no_grad()
def check_router(block: MoEBlock, router: torch.nn.Module, experts: torch.nn.Module, seed: int = 0) -> None:
    """Run the model's router on random [T, D] inputs and compare with `route` of the block's spec.

    Index sets must agree (a tie in the selection scores excuses a different pick), weights must
    agree within the routing-weight dtype's tolerance, and the weights' dtype must be the
    captured `routing_weight_dtype`. Raises CaptureError stating the mismatch.
    """
    if experts.gate_up_proj.is_meta or router.weight.is_meta:
        return  # nothing to run on
    where = type(router).__name__
    spec = block.router
    weight, bias, score_bias = router_tensors(router, spec)
    dtype = getattr(torch, block.weight_format.compute_dtype)
    device = router.weight.device
    gen = torch.Generator().manual_seed(seed)
    for T in _CHECK_TOKENS:
        x = torch.randn(T, block.D, generator=gen).to(dtype=dtype, device=device)  # [T, D]
        their_w, their_ids = router_weights_and_ids(router(x), where)  # [T, k], [T, k]
        if tuple(their_ids.shape) != (T, block.k) or tuple(their_w.shape) != (T, block.k):
            raise CaptureError(f"{where}: router returned ids {list(their_ids.shape)} and weights "
                               f"{list(their_w.shape)}, expected [{T}, {block.k}] (k = router.top_k)")
        got_dt = str(their_w.dtype).replace("torch.", "")
        if got_dt != block.routing_weight_dtype:
            raise CaptureError(f"{where}: router returns weights in {got_dt}, captured "
                               f"routing_weight_dtype is {block.routing_weight_dtype} "
                               f"(router spec weights_dtype={spec.weights_dtype})")
        logits = router_logits(spec, x, weight, bias)  # [T, E]
        ids, w = route(spec, logits, score_bias, block.k)  # [T, k], [T, k]
        _compare(where, spec, selection_scores(spec, logits, score_bias), ids, w,
                 their_ids.long(), their_w.float(), _tolerance(their_w.dtype))


def router_weights_and_ids(out: object, where: str = "router") -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of a router's output: a triple with the weights in the middle and the integer ids at
    one end, the logits at the other; (logits, weights, ids) and (ids, weights, logits) both occur."""
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        raise CaptureError(f"{where}: router returned {type(out).__name__}, expected (logits, weights, ids)")
    ends = [t for t in (out[0], out[2]) if not (t.is_floating_point() or t.is_complex())]
    if len(ends) != 1:
        raise CaptureError(f"{where}: router returned tensors of {', '.join(_dt(t) for t in out)}, expected "
                           "(logits, weights, ids) or (ids, weights, logits) with integer ids")
    return out[1], ends[0]


def _compare(where: str, spec: Router, scores: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
             their_ids: torch.Tensor, their_w: torch.Tensor, tol: tuple[float, float]) -> None:
    ids_s, order = ids.sort(-1)  # [T, k]
    th_s, th_order = their_ids.sort(-1)  # [T, k]
    same = (ids_s == th_s).all(-1)  # [T]
    for t in (~same).nonzero().flatten().tolist():
        if (th_s[t] < 0).any() or (th_s[t] >= scores.shape[1]).any():
            raise CaptureError(f"{where}: router picked expert ids {th_s[t].tolist()} "
                               f"outside [0, {scores.shape[1]})")
        mine = scores[t, ids_s[t]].sort().values
        theirs = scores[t, th_s[t]].sort().values
        if not (torch.isfinite(theirs).all() and torch.allclose(mine, theirs, rtol=1e-6, atol=0)):
            raise CaptureError(f"{where}: router check failed: for a random token the model's router picks "
                               f"experts {th_s[t].tolist()}, the captured {spec} picks {ids_s[t].tolist()}")
    w_s, th_w = w.gather(1, order)[same], their_w.gather(1, th_order)[same]  # [T', k]
    if not torch.allclose(w_s, th_w, rtol=tol[0], atol=tol[1]):
        err = (w_s - th_w).abs()
        i = int(err.max(-1).values.argmax())
        raise CaptureError(f"{where}: router check failed: routing weights differ by up to {err.max():.3g} "
                           f"(tolerance rtol={tol[0]:g}, atol={tol[1]:g}): model {th_w[i].tolist()} vs "
                           f"captured {spec} {w_s[i].tolist()}")
