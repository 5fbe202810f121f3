"""A captured block's router in one kernel launch while few tokens pass (decode).

On the triton backend `moetune.compile` gives each captured block's router module (its `gate` or
`router` child) a forward of its own: up to `fused_tokens(E)` tokens go through the custom op
`moetune::route` (codegen/triton/router.py: logits, scores, top-k and weights in one launch), more tokens
through the module's own forward. The module keeps its class, parameters and hooks (transformers' output
recorders still see its logits), and returns what its own forward returns: the same triple, in the same
order and dtypes. Before it is attached, both forwards run on random tokens: the logits must agree within
two roundings to their dtype, and the fused experts and weights must be the reference routing
(ir/routing.py) of the fused logits (the same experts but for ties in the scores, the weights within the
capture's router tolerance), as the capture checked the module's own against that reference; where not,
or the kind has no fused kernel, the module keeps its forward and `describe` says why. `uncompile` restores
it.
"""

from __future__ import annotations

import types

import torch

from ..codegen.triton.router import KINDS, fused_route, fused_tokens, refusal
from ..ir import MoEBlock, Router
from ..ir.capture import CaptureError, _compare, _tolerance, router_tensors, router_weights_and_ids
from ..ir.routing import route, selection_scores

_KIND_NAMES = {v: k for k, v in KINDS.items()}


@torch.library.custom_op("moetune::route", mutates_args=())
def route_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counter: torch.Tensor, k: int,
             kind: int, renormalize: bool, logits_dtype: torch.dtype, weights_dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [T, E], weights [T, k], ids [T, k]) of x [T, D], 1 ≤ T ≤ MAX_TOKENS. `counter` (int32 [1], zero)
    is the kernel's ticket counter, zero again when the launch ends."""
    spec = Router(_KIND_NAMES[kind], renormalize=renormalize, logit_bias=bias is not None)
    return fused_route(x, weight, bias, counter, spec, k, logits_dtype, weights_dtype)


@route_op.register_fake
def _route_fake(x, weight, bias, counter, k, kind, renormalize, logits_dtype, weights_dtype):
    T = x.shape[0]
    return (x.new_empty((T, weight.shape[0]), dtype=logits_dtype), x.new_empty((T, k), dtype=weights_dtype),
            x.new_empty((T, k), dtype=torch.int64))


def _forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """The router module's forward while moetune is attached (module doc)."""
    f = self._moetune_router
    x = hidden_states.reshape(-1, f.D)
    T = x.shape[0]
    if (not 1 <= T <= f.max_tokens or f.weight.dtype != f.dtype or f.weight.device != f.counter.device
            or (torch.is_grad_enabled() and (x.requires_grad or f.weight.requires_grad))):
        return f.original(hidden_states)  # a module moved after compile too: the experts' call check says so
    out = torch.ops.moetune.route(x, f.weight, f.bias, f.counter, f.k, f.kind, f.renormalize, f.logits_dtype,
                                  f.weights_dtype)
    return out[::-1] if f.reversed else out


class FusedRouter:
    """What `_forward` reads from its module (`module._moetune_router`): the original bound forward, the
    tensors, the output's order and dtypes."""

    def __init__(self, module: torch.nn.Module, block: MoEBlock, reversed_: bool, logits_dtype: torch.dtype):
        weight, bias, _ = router_tensors(module, block.router)
        self.original = module.forward
        self.weight, self.bias, self.spec, self.k, self.D = weight, bias, block.router, block.k, block.D
        self.reversed, self.logits_dtype = reversed_, logits_dtype
        self.weights_dtype = getattr(torch, block.routing_weight_dtype)
        self.counter = torch.zeros(1, dtype=torch.int32, device=weight.device)
        self.max_tokens = fused_tokens(block.E)
        self.dtype, self.kind, self.renormalize = weight.dtype, KINDS[self.spec.kind], bool(self.spec.renormalize)


def attach(module: torch.nn.Module, block: MoEBlock, seed: int = 0) -> str | None:
    """Give `module` (the block's router) the fused forward; None when attached, else why not (it keeps its own)."""
    why = refusal(block.router)
    if why:
        return why
    if block.router.score_bias:
        return "a router with a score bias"
    weight = module.weight
    if weight.is_meta:
        return "the router's weight is on the meta device"
    if weight.dim() != 2 or tuple(weight.shape) != (block.E, block.D):
        return f"router weight {list(weight.shape)}, expected [{block.E}, {block.D}]"
    where = type(module).__name__
    dtype = getattr(torch, block.weight_format.compute_dtype)
    gen = torch.Generator().manual_seed(seed)
    most = fused_tokens(block.E)
    probes = [torch.randn(T, block.D, generator=gen).to(dtype=dtype, device=weight.device)
              for T in sorted({1, min(5, most), most, most + 1})]  # the last: the module's own forward
    with torch.no_grad():
        theirs = [module(x) for x in probes]
        first = theirs[0]
        reversed_ = isinstance(first, tuple) and len(first) == 3 and not first[0].is_floating_point()
        logits_of = (lambda o: o[2]) if reversed_ else (lambda o: o[0])
        fused = FusedRouter(module, block, reversed_, logits_of(first).dtype)
        module._moetune_router = fused
        try:
            for x, out in zip(probes, theirs, strict=True):
                mine = _forward(module, x)
                _agree(where, block.router, out, mine, logits_of)
        except (CaptureError, RuntimeError, ValueError) as e:
            del module._moetune_router
            return f"the fused router did not agree with {where}'s own forward: {e}"
    module.forward = types.MethodType(_forward, module)
    return None


def _agree(where: str, spec: Router, theirs, mine, logits_of) -> None:
    """Raise CaptureError unless the fused router's output `mine` is `theirs` within the module doc's bounds."""
    their_lg, my_lg = logits_of(theirs), logits_of(mine)
    if my_lg.dtype != their_lg.dtype or my_lg.shape != their_lg.shape:
        raise CaptureError(f"{where}: logits {my_lg.dtype} {list(my_lg.shape)} against the module's "
                           f"{their_lg.dtype} {list(their_lg.shape)}")
    eps = torch.finfo(their_lg.dtype).eps
    scale = their_lg.float().abs().amax().clamp_min(1.0)
    gap = (my_lg.float() - their_lg.float()).abs().max()
    if gap > 2 * eps * scale:
        raise CaptureError(f"{where}: logits differ by up to {gap:.3g} (bound {2 * eps * scale:.3g})")
    their_w, their_ids = router_weights_and_ids(theirs, where)
    my_w, my_ids = router_weights_and_ids(mine, where)
    if my_w.dtype != their_w.dtype or my_ids.dtype != their_ids.dtype:
        raise CaptureError(f"{where}: weights {my_w.dtype} and ids {my_ids.dtype} against the module's "
                           f"{their_w.dtype} and {their_ids.dtype}")
    ids, w = route(spec, my_lg.float(), None, my_ids.shape[1])  # the reference on the fused logits
    _compare(where, spec, selection_scores(spec, my_lg.float(), None), ids, w, my_ids.long(), my_w.float(),
             _tolerance(my_w.dtype))


def detach(module: torch.nn.Module) -> None:
    """Restore `module`'s own forward (nothing when moetune never attached to it)."""
    if getattr(module, "_moetune_router", None) is None:
        return
    module.__dict__.pop("forward", None)
    del module._moetune_router
