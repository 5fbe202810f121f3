"""The router of a block in one launch: logits, scores, top-k and the routing weights of a few tokens.

    x [T, D], W [E, D] (, bias [E]) ──▶ logits [T, E]   x·Wᵀ (+ bias), rounded to the logits' dtype
                                        weights [T, k]  of the `Router` kind (moetune/ir/routing.py)
                                        ids [T, k]      int64, in descending order of their scores

A decode step's router is a GEMV of E rows followed by a softmax, a top-k and a renormalisation: four or
five small kernels, each about as long as its launch, before the experts can start. Here the E rows are
split over the grid (BE rows a program, every program reading all T ≤ `MAX_TOKENS` tokens), each program
writes its logits, and the last program to finish (a ticket from an atomic counter, reset by that program
for the next call) reads the T rows of logits back and does the rest in registers: the softmax over E, k
passes of an arg-max (ties to the lower expert id), the renormalisation or the softmax over the k values.

Kinds: softmax_topk (renormalised or not) and topk_softmax, with or without a logit bias; the scores of
softmax_topk are taken over the rounded logits, as the models compute them. sigmoid_grouped_topk is not
here (`refusal`). The counter is one int32 per router module, zero between calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ir import Router
from .launch import launch
from .layout import cdiv, next_pow2

MAX_TOKENS = 16  # tokens a launch takes: every program reads them all
MAX_TOKEN_EXPERTS = 2048  # T·E above which the model's own router (a GEMM, then top-k) is the faster (bench/README)
KINDS = {"softmax_topk": 0, "topk_softmax": 1}
_TILE = 8192  # elements of a program's [BT, BE, BD] product tile
_PROGRAMS = 128  # programs the E rows are split over, where E allows


def fused_tokens(E: int) -> int:
    """The most tokens the fused router takes a call for a router of E experts (`MAX_TOKEN_EXPERTS`)."""
    return max(1, min(MAX_TOKENS, MAX_TOKEN_EXPERTS // E))


def refusal(spec: Router) -> str | None:
    """Why the fused router kernel cannot compute `spec`'s routing (None: it can)."""
    if spec.kind not in KINDS:
        return f"router kind {spec.kind}: the fused router kernel computes {' and '.join(KINDS)}"
    return None


@triton.jit
def fused_router_kernel(x_ptr, s_x, w_ptr, s_w, b_ptr, logits_ptr, wts_ptr, ids_ptr, cnt_ptr, T, E, D,
                        K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                        BD: tl.constexpr, KIND: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.arange(0, BT)
    e = pid * BE + tl.arange(0, BE)
    tm, em = t < T, e < E
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        xv = tl.load(x_ptr + t[:, None].to(tl.int64) * s_x + d[None, :], mask=tm[:, None] & dm[None, :],
                     other=0.0).to(tl.float32)  # [BT, BD]
        wv = tl.load(w_ptr + e[:, None].to(tl.int64) * s_w + d[None, :], mask=em[:, None] & dm[None, :],
                     other=0.0).to(tl.float32)  # [BE, BD]
        acc += tl.sum(xv[:, None, :] * wv[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e, mask=em, other=0.0).to(tl.float32)[None, :]
    out = logits_ptr + t[:, None] * E + e[None, :]
    tl.store(out, acc.to(logits_ptr.dtype.element_ty), mask=tm[:, None] & em[None, :])
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:  # every program's logits are written: the rest in this one
        ea = tl.arange(0, EP)
        real = ea[None, :] < E  # [1, EP]; the rows past T read zeros, their results are not stored
        lg = tl.load(logits_ptr + t[:, None] * E + ea[None, :], mask=tm[:, None] & real, other=0.0,
                     cache_modifier=".cg").to(tl.float32)  # [BT, EP]
        lg = tl.where(real, lg, float("-inf"))
        if KIND == 0:
            p = tl.exp(lg - tl.max(lg, axis=1)[:, None])
            s = tl.where(real, p / tl.sum(p, axis=1)[:, None], float("-inf"))
        else:
            s = lg
        kk = tl.arange(0, KP)
        top = tl.zeros((BT, KP), dtype=tl.float32)
        idx = tl.zeros((BT, KP), dtype=tl.int32)
        # a NaN score ranks above every number (as torch.topk ranks it) and keeps its NaN as the value
        r = tl.where(s != s, float("inf"), s)
        for j in tl.static_range(K):
            v = tl.max(r, axis=1)  # [BT]
            i = tl.min(tl.where(r == v[:, None], ea[None, :], EP), axis=1)  # the lowest expert of the maximum
            pick = ea[None, :] == i[:, None]
            top = tl.where(kk[None, :] == j, tl.sum(tl.where(pick, s, 0.0), axis=1)[:, None], top)
            idx = tl.where(kk[None, :] == j, i[:, None], idx)
            r = tl.where(pick, float("-inf"), r)
        km = kk[None, :] < K
        if KIND == 0:
            w = top
            if RENORM:
                w = w / tl.sum(tl.where(km, w, 0.0), axis=1)[:, None]
        else:
            q = tl.where(km, tl.exp(top - tl.max(tl.where(km, top, float("-inf")), axis=1)[:, None]), 0.0)
            w = q / tl.sum(q, axis=1)[:, None]
        at = t[:, None] * K + kk[None, :]
        tl.store(wts_ptr + at, w.to(wts_ptr.dtype.element_ty), mask=tm[:, None] & km)
        tl.store(ids_ptr + at, idx.to(tl.int64), mask=tm[:, None] & km)
        tl.atomic_xchg(cnt_ptr, 0)


def tiles(T: int, E: int, D: int) -> tuple[int, int, int, int]:
    """(BT, BE, BD, warps): all T tokens a program, E split over about `_PROGRAMS` programs, as much of D a
    load as the product tile holds, one warp per 2048 elements of it (the tail's reductions over E stay
    within few warps)."""
    bt = next_pow2(T)
    be = max(1, next_pow2(max(1, E // _PROGRAMS)))
    while be > 1 and bt * be * 128 > _TILE:
        be //= 2
    bd = max(16, min(next_pow2(D), _TILE // (bt * be)))
    return bt, be, bd, max(1, min(4, bt * be * bd // 2048))


def fused_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counter: torch.Tensor,
                spec: Router, k: int, logits_dtype: torch.dtype, weights_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [T, E] in `logits_dtype`, weights [T, k] in `weights_dtype`, ids [T, k] int64) of x [T, D] with
    1 ≤ T ≤ MAX_TOKENS under the router weight [E, D] (and bias [E]); `counter` an int32 [1] at zero."""
    T, D = x.shape
    E = weight.shape[0]
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"fused_route takes 1 to {MAX_TOKENS} tokens, not {T}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    logits = torch.empty(T, E, dtype=logits_dtype, device=x.device)
    wts = torch.empty(T, k, dtype=weights_dtype, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    bt, be, bd, warps = tiles(T, E, D)
    launch(fused_router_kernel, (cdiv(E, be),), x, x.stride(0), weight, weight.stride(0),
           weight if bias is None else bias, logits, wts, ids, counter, T, E, D,
           K=k, KP=next_pow2(k), EP=next_pow2(E), BT=bt, BE=be, BD=bd, KIND=KINDS[spec.kind],
           RENORM=bool(spec.renormalize), HAS_BIAS=bias is not None, num_warps=warps)
    return logits, wts, ids
