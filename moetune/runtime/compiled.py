"""The compiled model: moetune's experts function behind transformers' official experts hook.

    import moetune                      # registers "moetune" in transformers' ExpertsInterface and
                                        # FP8ExpertsInterface
    moetune.compile(model)              # capture → a Plan per captured experts module → "moetune"
    moetune.uncompile(model)            # back to the previous experts implementation

    model = AutoModelForCausalLM.from_pretrained(d, experts_implementation="moetune")
    model(...)                          # the first experts call compiles the model (table: $MOETUNE_CACHE)

transformers calls `experts_forward(self, hidden_states [T, D], top_k_index [T, k], top_k_weights
[T, k])` for every hooked experts module of a model whose experts implementation is "moetune".
Both of transformers' experts hooks lead here: the bf16 experts' ExpertsInterface and FP8Experts'
FP8ExpertsInterface read the same `config._experts_implementation`, so one switch moves both. With a
plan attached (`module._moetune_plan`), it calls the custom op `moetune::experts` with the module's
own parameter tensors (no copy; FP8Experts' float8_e4m3fn weights and their `*_scale_inv` block scales
as they are) and the plan's id; the op looks the plan up and runs its
Dispatcher, which picks the bucket's kernel from the host-side T. The op has a fake (meta) kernel, so
whole-model torch.export and torch.compile(fullgraph=True) see one opaque node per MoE layer; the plan
id is a graph constant and the registry must still hold it when an exported program runs (uncompile
removes it). Untraced inference (eager, no_grad or inference_mode, plain tensors) runs the op's body
without the op's dispatch, which is host time in every MoE layer of an eager decode step
(`python -m bench host`).

A model that asked for "moetune" itself (`from_pretrained(..., experts_implementation="moetune")`)
and was never compiled is compiled on its first untraced experts call: the outermost transformers
model on the call stack that holds the experts module is compiled as `compile(model,
cache=$MOETUNE_CACHE)` would (no MOETUNE_CACHE: the default schedules). Blocks that capture leaves
alone, and a model traced (torch.compile, torch.export) before any eager call, run transformers'
grouped_mm (for FP8Experts its FP8 grouped_mm): the former with one warning giving the reasons.
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch

from ..codegen.backend import Backend, for_target, get
from ..codegen.tensors import ExpertTensors
from ..ir import MoEBlock, MoetuneError
from .default import pass_target
from .dispatch import Dispatcher
from .versions import target_of

IMPLEMENTATION = "moetune"
CACHE_VARIABLE = "MOETUNE_CACHE"  # the dispatch table of a model compiled on its first call


@dataclass(frozen=True, eq=False)
class Plan:
    """What one experts module runs: its block, the resolved dispatcher, its place in the model."""

    id: int
    path: str
    block: MoEBlock
    dispatcher: Dispatcher
    debug: bool = False  # check every call's ids on the device too (a host sync per call)
    device: torch.device | None = None  # the experts' weights' device at compile
    stored: torch.dtype | None = None  # their element dtype then (the block's weight format)
    computes: torch.dtype | None = None  # the activations' dtype (the format's compute dtype)


@dataclass(eq=False)
class CompileState:
    """Kept on a compiled model (`model._moetune_state`) so that uncompile can undo compile."""

    previous: dict | str | None
    plan_ids: list[int] = field(default_factory=list)
    captured: list = field(default_factory=list)  # every Captured, the refused ones with their reason
    backend: str = "torch"
    cache: str | None = None
    on_first_call: bool = False  # compiled by the first experts call, not by moetune.compile
    routers: dict = field(default_factory=dict)  # block path → None (router fused) or why it keeps its own


PLANS: dict[int, Plan] = {}
_ids = itertools.count(1)


# ------------------------------------------------------------------------------- the custom op --


@torch.library.custom_op("moetune::experts", mutates_args=())
def experts_op(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    plan_id: int,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts of plan `plan_id`: x [T, D], ids [T, k], weights [T, k] → [T, D] in x.dtype
    (the block scales: those of FP8 weights, None for unquantised ones)."""
    return _run_plan(x, ids, weights, gate_up, down, gate_up_bias, down_bias, plan_id, gate_up_scale, down_scale)


def _run_plan(x, ids, weights, gate_up, down, gate_up_bias, down_bias, plan_id: int,
              gate_up_scale=None, down_scale=None) -> torch.Tensor:
    """The op's body, also what the experts hook calls in untraced inference (`_untraced_inference`)."""
    plan = PLANS.get(plan_id)
    if plan is None:
        raise MoetuneError(
            f"moetune::experts: plan {plan_id} is not registered in this process "
            f"(the model was uncompiled, or the program was exported elsewhere); "
            f"run moetune.compile(model) again"
        )
    return plan.dispatcher(x, ids, weights,
                           ExpertTensors(gate_up, down, gate_up_bias, down_bias, gate_up_scale, down_scale))


@experts_op.register_fake
def _experts_fake(x, ids, weights, gate_up, down, gate_up_bias, down_bias, plan_id, gate_up_scale=None,
                  down_scale=None):
    return x.new_empty(x.shape)


def _no_backward(ctx, grad):
    raise MoetuneError(
        "moetune::experts has no backward: moetune compiles MoE blocks for inference; "
        "call moetune.uncompile(model) before training"
    )


experts_op.register_autograd(_no_backward)


# ------------------------------------------------------------------ transformers experts hook --


def experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The function registered as "moetune" in transformers' ExpertsInterface and FP8ExpertsInterface."""
    plan = getattr(self, "_moetune_plan", None)
    if plan is None and getattr(self, "_moetune_left", None) is None and _untraced():
        plan = _compile_on_first_call(self)
    if plan is None:
        return _transformers_grouped_mm(self)(self, hidden_states, top_k_index, top_k_weights)
    check_call(plan, hidden_states, top_k_index, top_k_weights, self.gate_up_proj)
    bias = plan.block.layout.has_bias
    args = (
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        self.gate_up_proj_bias if bias else None,
        self.down_proj_bias if bias else None,
    )
    scales = (self.gate_up_proj_scale_inv, self.down_proj_scale_inv) if plan.block.weight_format.quantized else ()
    if _untraced_inference(args + scales):  # plain eager inference: skip the custom op's dispatch
        return _run_plan(*args, plan.id, *scales)
    return torch.ops.moetune.experts(*args, plan.id, *scales)


def check_call(plan: Plan, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor) -> None:
    """MoetuneError for a call the plan cannot serve, from what the host knows (dtypes, devices, shapes): a model
    moved to another dtype or device after compile, activations in another dtype than the block's, tensors on
    several devices, integer-less ids. Ids outside [0, E) are dropped by every kernel (a pair that selects no
    expert, as sentinel ids do); with `debug=True` at compile each untraced call checks them on the device and
    raises."""
    where = f"moetune: {plan.path}"
    if gate_up.dtype != plan.stored or gate_up.device != plan.device:
        raise MoetuneError(f"{where}: compiled for {_name(plan.stored)} experts on {plan.device}, called with "
                           f"{_name(gate_up.dtype)} on {gate_up.device}: the model was moved after moetune.compile; "
                           f"call moetune.compile(model) again")
    if x.dtype != plan.computes:
        raise MoetuneError(f"{where}: hidden states in {_name(x.dtype)}, the block computes in {_name(plan.computes)} "
                           f"(the model's dtype)")
    for name, t in (("hidden states", x), ("top_k_index", ids), ("top_k_weights", weights)):
        if t.device != gate_up.device:
            raise MoetuneError(f"{where}: {name} on {t.device}, the experts' weights on {gate_up.device}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise MoetuneError(f"{where}: top_k_index is {ids.dtype}, expected an integer dtype")
    if plan.debug and ids.numel() and _untraced():
        E = plan.block.E
        bad = (ids < 0) | (ids >= E)
        if bool(bad.any()):
            raise MoetuneError(f"{where}: {int(bad.sum())} of {ids.numel()} expert ids outside [0, {E}) "
                               f"(e.g. {ids[bad][0].item()}); without debug such pairs select no expert")


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def _transformers_grouped_mm(experts: torch.nn.Module):
    """transformers' grouped_mm experts function for `experts`: the FP8 one for FP8Experts."""
    from ..ir.capture import is_fp8_experts

    if is_fp8_experts(experts):
        from transformers.integrations.finegrained_fp8 import fp8_grouped_mm_experts_forward

        return fp8_grouped_mm_experts_forward
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward


def _untraced_inference(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    """True when no tracer sees this call (dynamo, export, jit, a dispatch or function mode, a
    functorch transform such as vmap, a tensor subclass such as FakeTensor) and no gradient can flow
    through it. Only then does the experts hook run the op's body itself: the custom op exists for
    tracers and for autograd's error, and its dispatch is host time on every call
    (`python -m bench host --tokens 0`, rows op − body)."""
    if not _untraced():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or (grad and t.requires_grad):
            return False
    return True


def _untraced() -> bool:
    """True when no tracer (dynamo, export, jit, a dispatch or function mode, a functorch transform)
    sees this call."""
    return not any(probe() for probe in _TRACING)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _torch_c(name: str):
    """A private torch probe; where this torch has none, a probe that always says "maybe traced", so
    the hook keeps to the op rather than guess."""
    return getattr(torch._C, name, lambda: True)


_TRACING = (
    torch.compiler.is_compiling,
    torch.compiler.is_exporting,
    torch.jit.is_tracing,
    _torch_c("_len_torch_dispatch_stack"),  # FakeTensorMode, make_fx's proxy mode, functionalisation
    _torch_c("_is_torch_function_mode_enabled"),
    _torch_c("_are_functorch_transforms_active"),  # vmap, grad: their tensors look plain
)


def register_with_transformers() -> bool:
    """Register "moetune" in transformers' ExpertsInterface, and in its FP8ExpertsInterface (the FP8Experts'
    hook, a registry of its own) where this transformers has one; False when transformers is absent."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers whose FP8 experts have no hook: capture refuses them (no hook)
        return True
    FP8ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    return True


REGISTERED = register_with_transformers()


# ------------------------------------------------------------------------- compile / uncompile --


def _device(experts: torch.nn.Module) -> torch.device:
    return experts.gate_up_proj.device


def _pick_backend(name: str | None, device: torch.device, target: str) -> Backend:
    """Backend `name` (None: triton for CUDA weights when usable, else torch), made for the target description
    of `target`, the table's target (its shared memory and SM count bound the kernels' defaults)."""
    if name is not None:
        be = get(name)
        why = be.available()
        if why:
            raise MoetuneError(f"moetune.compile: backend {name!r} is not usable here: {why}")
        return for_target(be.name, pass_target(target))
    if device.type == "cuda":
        try:
            be = get("triton")
            if be.available() is None:
                return for_target(be.name, pass_target(target))
        except (MoetuneError, ImportError):
            pass
    return get("torch")


def compile(
    model: torch.nn.Module,
    cache: str | None = None,
    backend: str | None = None,
    *,
    target: str | None = None,
    check: bool = True,
    T_max: int = 4096,
    fuse_router: bool = True,
    debug: bool = False,
) -> torch.nn.Module:
    """Run `model`'s captured MoE experts through moetune; returns the same model object.

    cache        a dispatch-table file (runtime/table.py), or a folder of them: its <target>.sqlite is read
                 (cache/h100.sqlite on an H100); None: every bucket on the default heuristic
    backend      "torch" | "triton"; None: triton for CUDA weights when usable, else torch
    target       the table's target name; None: from the weights' device ("cpu", "h200", …)
    fuse_router  on the triton backend, each captured block's router runs in one launch while few tokens
                 pass (runtime/router.py); False: the routers stay the model's own
    debug        every experts call also checks its ids on the device (one host sync a call): ids outside
                 [0, E) raise instead of selecting no expert

    Blocks capture refuses stay as they are, named with their reasons in one warning. Compiling
    copies no weight: the kernels read each experts module's parameters at call time.
    """
    state = _compile(model, cache, backend, target=target, check=check, T_max=T_max, fuse_router=fuse_router,
                     debug=debug)
    left = [c for c in state.captured if c.block is None]
    if left:
        name = type(model).__name__
        what = (f"no MoE block of {name} was captured; the model runs unchanged" if not state.plan_ids else
                f"{len(left)} of {len(state.captured)} MoE blocks of {name} were not captured and run "
                f"transformers' experts")
        warnings.warn(f"moetune.compile: {what}: {_reasons(left)}", stacklevel=2)
    return model


def _reasons(left: list) -> str:
    """The reasons of the blocks left as is, one per distinct reason with the paths of its blocks: each
    reason reads "path (block class): why" (capture's form)."""
    paths: dict[str, list[str]] = {}
    for c in left:
        why = c.reason or f"{c.path} ({c.block_class}): not captured"
        paths.setdefault(why.removeprefix(c.path), []).append(c.path)
    return "; ".join(f"{', '.join(ps)}{why}" for why, ps in paths.items())


def _compile(
    model: torch.nn.Module,
    cache: str | None,
    backend: str | None,
    *,
    target: str | None = None,
    check: bool = True,
    T_max: int = 4096,
    on_first_call: bool = False,
    fuse_router: bool = True,
    debug: bool = False,
) -> CompileState:
    """`compile` without its warning: the state it leaves on `model` (`model._moetune_state`)."""
    from ..ir.capture import capture

    if getattr(model, "_moetune_state", None) is not None:
        uncompile(model)
    captured = capture(model, check=check, T_max=T_max)
    state = CompileState(previous=None, captured=list(captured), cache=None if cache is None else str(cache),
                         on_first_call=on_first_call)
    dispatchers: dict[tuple[str, str], Dispatcher] = {}  # one per (block signature, backend)
    try:
        for i, c in enumerate(captured):
            if c.block is not None and c.experts is not None:
                tgt = target or target_of(str(_device(c.experts)))
                be = _pick_backend(backend, _device(c.experts), tgt)
                kinds = be.kinds(c.block)
                if all(kinds.values()):  # e.g. a weight format none of the backend's kernels reads
                    why = "; ".join(f"{k}: {v}" for k, v in kinds.items())
                    c = state.captured[i] = dataclasses.replace(
                        c, block=None, reason=f"{c.path} ({c.block_class}): backend {be.name} runs none of its "
                                              f"kernels on this block ({why}); left as is")
            if c.block is None and c.experts is not None:
                c.experts._moetune_left = c.reason  # runs transformers' own experts, never a first-call compile
            if c.block is None or c.experts is None:
                continue
            ExpertTensors.of(c.experts).check(c.block)
            device = _device(c.experts)
            state.backend = be.name
            key = (c.block.signature(), be.name)
            if key not in dispatchers:
                if cache is None:
                    dispatchers[key] = Dispatcher.default(c.block, be, target=tgt)
                else:
                    from .table import load_entries, table_path

                    notes: list[str] = []  # folded into the dispatcher's one warning
                    estimated: list[tuple[int, int]] = []
                    entries = load_entries(cache, c.block, tgt, be.name, device=str(device), notes=notes,
                                           estimated=estimated)
                    dispatchers[key] = Dispatcher.from_entries(
                        c.block, be, entries, target=tgt, where=f"dispatch table {table_path(cache, tgt)}",
                        table_notes=notes, estimated=estimated,
                    )
            fmt = c.block.weight_format
            plan = Plan(next(_ids), c.path, c.block, dispatchers[key], debug, device, getattr(torch, fmt.dtype),
                        getattr(torch, fmt.compute_dtype))
            PLANS[plan.id] = plan
            state.plan_ids.append(plan.id)
            c.experts._moetune_plan = plan
            if fuse_router and be.name == "triton" and c.router is not None:
                from . import router  # Triton's: imported where the triton backend runs

                state.routers[c.path] = router.attach(c.router, c.block)
    except BaseException:
        _detach(model, state)
        raise
    if state.plan_ids:
        state.previous = _without_moetune(model)
        model.set_experts_implementation(IMPLEMENTATION)
    model._moetune_state = state
    return state


def _without_moetune(model: torch.nn.Module) -> dict:
    """The model's experts implementations with "moetune" replaced by transformers' default: what
    uncompile restores (a model loaded with "moetune" goes back to transformers' own experts)."""
    impl = model.get_experts_implementation()
    if IMPLEMENTATION not in impl.values():
        return impl
    default = model.get_correct_experts_implementation(None)
    return {k: default if v == IMPLEMENTATION else v for k, v in impl.items()}


# ----------------------------------------------------------- compiled on the first experts call --


def _compile_on_first_call(experts: torch.nn.Module) -> Plan | None:
    """The plan of `experts` after compiling the model that calls it (`_calling_model`) with the table
    named by $MOETUNE_CACHE, or None when it runs transformers' grouped_mm. Every experts module left
    without a plan is marked with the reason (`_moetune_left`), so that this runs once per model, and
    one warning gives the reasons."""
    model = _calling_model(experts)
    if model is None:
        experts._moetune_left = (
            f"{type(experts).__name__} was called outside a transformers model's forward, so moetune "
            f"cannot find its block; call moetune.compile(model)"
        )
        warnings.warn(f"experts_implementation={IMPLEMENTATION!r}: {experts._moetune_left}; it runs "
                      f"transformers' grouped_mm", stacklevel=4)
        return None
    # The router check runs the model's routers; in a context of its own, transformers' output
    # recorders (output_router_logits, kept in a context variable) do not see those calls.
    state = contextvars.Context().run(
        _compile, model, os.environ.get(CACHE_VARIABLE) or None, None, on_first_call=True
    )
    reasons = []
    for c in state.captured:
        if c.block is None:
            reasons.append(c.reason)
            if c.experts is not None:
                c.experts._moetune_left = c.reason
    plan = getattr(experts, "_moetune_plan", None)
    if plan is None and getattr(experts, "_moetune_left", None) is None:
        experts._moetune_left = (f"{type(experts).__name__} is not the `experts` child of a block of "
                                 f"{type(model).__name__}")
        reasons.append(experts._moetune_left)
    if reasons:
        warnings.warn(
            f"experts_implementation={IMPLEMENTATION!r}: {len(reasons)} MoE block(s) of {type(model).__name__} "
            f"run transformers' grouped_mm, not moetune: {'; '.join(reasons)}",
            stacklevel=4,
        )
    return plan


def _calling_model(experts: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost transformers model on the call stack whose modules include `experts`: the model
    whose forward is running this experts call."""
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if (owner is not found and isinstance(owner, torch.nn.Module)
                and hasattr(owner, "set_experts_implementation")
                and any(m is experts for m in owner.modules())):
            found = owner
        frame = frame.f_back
    return found


def _detach(model: torch.nn.Module, state: CompileState) -> None:
    if state.routers:
        from . import router

        for m in model.modules():
            router.detach(m)
    for m in model.modules():
        if getattr(m, "_moetune_plan", None) is not None and m._moetune_plan.id in state.plan_ids:
            del m._moetune_plan
        if getattr(m, "_moetune_left", None) is not None:
            del m._moetune_left
    for pid in state.plan_ids:
        PLANS.pop(pid, None)


def uncompile(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `compile`: detach the plans and restore the previous experts implementation."""
    state: CompileState | None = getattr(model, "_moetune_state", None)
    if state is None:
        return model
    _detach(model, state)
    if state.previous is not None:
        model.set_experts_implementation(state.previous)
    model._moetune_state = None
    return model


def plans(model: torch.nn.Module) -> list[Plan]:
    """The plans attached to `model`'s experts modules, in module order."""
    return [m._moetune_plan for m in model.modules() if getattr(m, "_moetune_plan", None) is not None]


def describe(model: torch.nn.Module) -> str:
    """Each compiled experts module with its buckets and their schedules (and where they came from)."""
    state: CompileState | None = getattr(model, "_moetune_state", None)
    name = type(model).__name__
    if state is None:
        impl = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else {}
        if IMPLEMENTATION in impl.values():
            table = os.environ.get(CACHE_VARIABLE) or "(none: defaults)"
            return (f"{name}: experts_implementation {IMPLEMENTATION!r}, compiled by its first forward "
                    f"(table ${CACHE_VARIABLE}: {table})")
        return f"{name}: not compiled by moetune"
    how = ", compiled by its first forward" if state.on_first_call else ""
    lines = [f"{name}: backend {state.backend}, table {state.cache or '(none: defaults)'}{how}"]
    c_router = {c.path: c.router for c in state.captured}
    for p in plans(model):
        lines.append(f"{p.path}  [{p.block.signature_hash()}]  plan {p.id}")
        lines.append(p.dispatcher.describe())
        if p.path in state.routers:
            why = state.routers[p.path]
            f = getattr(c_router.get(p.path), "_moetune_router", None)
            lines.append(f"  router: the model's own ({why})" if why else
                         f"  router: fused (moetune::route), one launch for 1–{f.max_tokens if f else '?'} tokens, "
                         f"the model's own above")
    for c in state.captured:
        if c.block is None:
            lines.append(f"{c.path}: left as is ({c.reason})")
    return "\n".join(lines)
